"""The JSON codec: round trips, helpful decode errors, and JSON other languages can read."""

import enum
import json
import sys
import uuid
from dataclasses import InitVar, dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from typing import Annotated

import attrs
import msgspec
import pydantic
import pytest

from mersal import DecodeError, EncodeError
from mersal.serialization import JsonCodec

PLACED_AT = datetime(2024, 5, 1, 12, 30, 15, 250_000, tzinfo=UTC)


@dataclass
class Line:
    sku: str
    quantity: int


@dataclass
class OrderPlaced:
    order_id: str
    amount: float
    placed_at: datetime
    lines: list[Line]
    coupon: str | None = None
    tags: list[str] = field(default_factory=list)


class ShipmentStruct(msgspec.Struct):
    shipment_id: str
    weight: float
    shipped_at: datetime
    parcels: list[int]
    carrier: str | None = None


class CamelStruct(msgspec.Struct, rename="camel"):
    order_id: str


class LineModel(pydantic.BaseModel):
    sku: str
    quantity: int


class InvoiceModel(pydantic.BaseModel):
    invoice_id: str
    total: float
    issued_at: datetime
    lines: list[LineModel]
    note: str | None = None


class AliasedModel(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(populate_by_name=True)

    order_id: str = pydantic.Field(alias="orderId")


@pytest.fixture
def codec() -> JsonCodec:
    return JsonCodec()


# Round trips.


def test_a_dataclass_round_trips(codec: JsonCodec) -> None:
    order = OrderPlaced(
        order_id="o-1",
        amount=9.5,
        placed_at=PLACED_AT,
        lines=[Line("sku-1", 2), Line("sku-\u00e9", 1)],
        tags=["new"],
    )

    decoded = codec.decode(codec.encode(order), OrderPlaced)

    assert decoded == order
    assert isinstance(decoded.lines[0], Line)
    assert decoded.coupon is None


def test_an_optional_field_that_is_set_round_trips(codec: JsonCodec) -> None:
    order = OrderPlaced("o-2", 1.0, PLACED_AT, [], coupon="SPRING")

    assert codec.decode(codec.encode(order), OrderPlaced).coupon == "SPRING"


def test_a_datetime_with_an_offset_keeps_its_instant(codec: JsonCodec) -> None:
    local = PLACED_AT.astimezone(timezone(timedelta(hours=5, minutes=30)))
    order = OrderPlaced("o-3", 1.0, local, [])

    decoded = codec.decode(codec.encode(order), OrderPlaced)

    assert decoded.placed_at == PLACED_AT
    assert decoded.placed_at.utcoffset() == timedelta(hours=5, minutes=30)


def test_a_msgspec_struct_round_trips(codec: JsonCodec) -> None:
    shipment = ShipmentStruct("s-1", 2.25, PLACED_AT, [1, 2, 3], carrier="dhl")

    assert codec.decode(codec.encode(shipment), ShipmentStruct) == shipment


def test_a_renamed_msgspec_struct_round_trips_in_its_wire_names(codec: JsonCodec) -> None:
    body = codec.encode(CamelStruct("o-1"))

    assert json.loads(body) == {"orderId": "o-1"}
    assert codec.decode(body, CamelStruct) == CamelStruct("o-1")


def test_a_pydantic_model_round_trips(codec: JsonCodec) -> None:
    invoice = InvoiceModel(
        invoice_id="i-1",
        total=12.5,
        issued_at=PLACED_AT,
        lines=[LineModel(sku="a", quantity=1)],
    )

    assert codec.decode(codec.encode(invoice), InvoiceModel) == invoice


def test_a_pydantic_model_with_aliases_round_trips_in_its_wire_names(codec: JsonCodec) -> None:
    body = codec.encode(AliasedModel(orderId="o-1"))

    assert json.loads(body) == {"orderId": "o-1"}
    assert codec.decode(body, AliasedModel) == AliasedModel(orderId="o-1")


# Decode errors.

VALID = {
    OrderPlaced: {
        "order_id": "o-1",
        "amount": 1.0,
        "placed_at": "2024-05-01T00:00:00Z",
        "lines": [],
    },
    ShipmentStruct: {
        "shipment_id": "s-1",
        "weight": 1.0,
        "shipped_at": "2024-05-01T00:00:00Z",
        "parcels": [],
    },
    InvoiceModel: {
        "invoice_id": "i-1",
        "total": 1.0,
        "issued_at": "2024-05-01T00:00:00Z",
        "lines": [],
    },
}
WRONG_TYPE = {OrderPlaced: "amount", ShipmentStruct: "weight", InvoiceModel: "total"}
REQUIRED = {OrderPlaced: "order_id", ShipmentStruct: "shipment_id", InvoiceModel: "invoice_id"}
CLASSES = list(VALID)


@pytest.mark.parametrize("cls", CLASSES)
def test_valid_bodies_decode(codec: JsonCodec, cls: type) -> None:
    assert isinstance(codec.decode(json.dumps(VALID[cls]).encode(), cls), cls)


@pytest.mark.parametrize("cls", CLASSES)
def test_a_field_of_the_wrong_type_is_a_decode_error_naming_class_and_field(
    codec: JsonCodec, cls: type
) -> None:
    body = json.dumps({**VALID[cls], WRONG_TYPE[cls]: "not a number"}).encode()

    with pytest.raises(DecodeError) as raised:
        codec.decode(body, cls)

    assert cls.__qualname__ in str(raised.value)
    assert WRONG_TYPE[cls] in str(raised.value)


@pytest.mark.parametrize("cls", CLASSES)
def test_a_missing_field_is_a_decode_error_naming_class_and_field(
    codec: JsonCodec, cls: type
) -> None:
    body = json.dumps({k: v for k, v in VALID[cls].items() if k != REQUIRED[cls]}).encode()

    with pytest.raises(DecodeError) as raised:
        codec.decode(body, cls)

    assert cls.__qualname__ in str(raised.value)
    assert REQUIRED[cls] in str(raised.value)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("body", [b"{not json", b"", b'{"order_id": "o-1"', b"\xff\xfe"])
def test_invalid_json_is_a_decode_error(codec: JsonCodec, cls: type, body: bytes) -> None:
    with pytest.raises(DecodeError, match="JSON"):
        codec.decode(body, cls)


@pytest.mark.parametrize(
    "cls",
    [OrderPlaced, ShipmentStruct, InvoiceModel],
)
def test_the_invalid_json_error_names_the_class(codec: JsonCodec, cls: type) -> None:
    with pytest.raises(DecodeError) as raised:
        codec.decode(b"{not json", cls)

    assert cls.__qualname__ in str(raised.value)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"42", b"null", b"true"])
def test_json_that_is_not_an_object_is_a_decode_error_naming_the_class(
    codec: JsonCodec, cls: type, body: bytes
) -> None:
    with pytest.raises(DecodeError) as raised:
        codec.decode(body, cls)

    assert cls.__qualname__ in str(raised.value)


# Interoperability.


def test_output_is_compact_utf8_json_any_json_library_reads(codec: JsonCodec) -> None:
    order = OrderPlaced("o-1", 9.5, PLACED_AT, [Line("caf\u00e9", 2)], coupon=None)

    body = codec.encode(order)

    assert isinstance(body, bytes)
    assert body.decode("utf-8")
    assert b": " not in body and b", " not in body and b"\n" not in body
    assert json.loads(body) == {
        "order_id": "o-1",
        "amount": 9.5,
        "placed_at": "2024-05-01T12:30:15.250000Z",
        "lines": [{"sku": "caf\u00e9", "quantity": 2}],
        "coupon": None,
        "tags": [],
    }


def test_pydantic_output_is_plain_json(codec: JsonCodec) -> None:
    invoice = InvoiceModel(invoice_id="i-1", total=3.0, issued_at=PLACED_AT, lines=[])

    body = codec.encode(invoice)

    assert b": " not in body and b", " not in body
    decoded = json.loads(body)
    assert decoded["invoice_id"] == "i-1"
    assert decoded["total"] == 3.0
    assert datetime.fromisoformat(decoded["issued_at"]) == PLACED_AT


@pytest.mark.parametrize("cls", CLASSES)
def test_a_body_from_another_producer_with_extra_fields_and_spacing_decodes(
    codec: JsonCodec, cls: type
) -> None:
    body = json.dumps({"added_in_v2": {"x": [1]}, **VALID[cls]}, indent=2).encode()

    assert isinstance(codec.decode(body, cls), cls)


def test_the_content_type_is_json(codec: JsonCodec) -> None:
    assert codec.content_type == "application/json"


# Checking that an encoded message decodes back, as a receiver decodes it.


class Colour(enum.Enum):
    RED = "red"


class Rank(enum.IntEnum):
    FIRST = 1


@dataclass
class Everything:
    at: datetime
    local: datetime
    price: Decimal
    ref: uuid.UUID
    colour: Colour
    rank: Rank
    pair: tuple[int, str]
    many: tuple[int, ...]
    names: set[str]
    codes: frozenset[int]
    blob: bytes
    big: int
    ratio: float
    maybe: int | None = None
    counted: int = field(init=False, default=0)
    notes: list[str] = field(default_factory=list)


class TaggedStruct(msgspec.Struct, tag=True, rename="camel", omit_defaults=True):
    order_id: str
    line_count: int = 0


@attrs.define
class AttrsLine:
    sku: str
    quantity: int


class ComputedModel(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    net: float

    @pydantic.computed_field  # type: ignore[prop-decorator]
    @property
    def gross(self) -> float:
        return self.net * 1.2


class StrictComputedModel(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    net: float

    @pydantic.computed_field  # type: ignore[prop-decorator]
    @property
    def gross(self) -> float:
        return self.net * 1.2


@attrs.define
class AttrsPrivate:
    _note: str


class RowStruct(msgspec.Struct, array_like=True):
    sku: str
    quantity: int


class TaggedRowStruct(msgspec.Struct, array_like=True, tag=True):
    sku: str
    quantity: int


class ExcludedModel(pydantic.BaseModel):
    sku: str
    note: str = pydantic.Field(exclude=True)


@dataclass
class Order:
    order_id: str
    lines: list[Line]


@dataclass
class Counted:
    count: int


@dataclass
class Priced:
    amount: float


@dataclass
class Limited:
    count: Annotated[int, msgspec.Meta(ge=0)]


@dataclass
class Tally:
    by_sku: dict[str, int]


@dataclass
class Holder:
    line: LineModel


def everything() -> Everything:
    sent = Everything(
        at=PLACED_AT,
        local=datetime(2024, 5, 1, 12, 30),
        price=Decimal("19.99"),
        ref=uuid.UUID(int=7),
        colour=Colour.RED,
        rank=Rank.FIRST,
        pair=[3, "x"],  # type: ignore[arg-type]
        many=(1, 2, 3),
        names={"a", "b"},
        codes=frozenset({1}),
        blob=b"\x00\xff",
        big=2**80,
        ratio=2,
    )
    sent.counted = 5
    return sent


def sendable() -> list[object]:
    """Messages whose encoding changes their values' types but decodes back as their class."""
    extra = ComputedModel(net=10.0, note="kept")  # type: ignore[call-arg]
    return [
        everything(),
        TaggedStruct("o-1"),
        TaggedStruct("o-1", line_count=3),
        AttrsLine("pen", 2),
        AliasedModel(orderId="o-1"),
        extra,
        InvoiceModel(invoice_id="i-1", total=3, issued_at=PLACED_AT, lines=[]),
        Order("o-1", [Line("pen", 1), Line("ink", Rank.FIRST)]),
    ]


@pytest.mark.parametrize("sent", sendable(), ids=lambda sent: type(sent).__name__)
def test_a_message_whose_encoding_decodes_back_as_its_class_passes(
    codec: JsonCodec, sent: object
) -> None:
    body = codec.encode(sent)

    codec.validate(sent, body)

    assert type(codec.decode(body, type(sent))) is type(sent)


REFUSED = [
    (
        Priced("9.5"),  # type: ignore[arg-type]
        "cannot send Priced: field amount holds a str ('9.5') where Priced declares float; "
        "convert the value before sending",
    ),
    (
        Counted(True),
        "cannot send Counted: field count holds a bool (True) where Counted declares int; "
        "convert the value before sending",
    ),
    (
        Counted(1.0),  # type: ignore[arg-type]
        "cannot send Counted: field count holds a float (1.0) where Counted declares int; "
        "convert the value before sending",
    ),
    (
        Order("o-1", [Line("pen", 1), Line("ink", "2")]),  # type: ignore[arg-type]
        "cannot send Order: field lines[1].quantity holds a str ('2') where Order declares int; "
        "convert the value before sending",
    ),
    (
        TaggedStruct("o-1", line_count="3"),  # type: ignore[arg-type]
        "cannot send TaggedStruct: field lineCount holds a str ('3') where TaggedStruct declares "
        "int; convert the value before sending",
    ),
    (
        Counted(None),  # type: ignore[arg-type]
        "cannot send Counted: field count holds None where Counted declares int; convert the "
        "value before sending",
    ),
    (
        AttrsLine("pen", "2"),  # type: ignore[arg-type]
        "cannot send AttrsLine: field quantity holds a str ('2') where AttrsLine declares int; "
        "convert the value before sending",
    ),
    (
        Limited(-1),
        "cannot send Limited: field count holds an int (-1), which Limited refuses (Expected "
        "`int` >= 0); convert the value before sending",
    ),
    (
        Tally({"pen": "2"}),  # type: ignore[dict-item]
        "cannot send Tally: field by_sku[...] would not decode as Tally declares it (Expected "
        "`int`, got `str`); convert the value before sending",
    ),
    (
        LineModel.model_construct(sku="pen", quantity="two"),
        "cannot send LineModel: field quantity holds a str ('two'), which LineModel refuses: "
        "Input should be a valid integer, unable to parse string as an integer; convert the "
        "value before sending",
    ),
    (
        StrictComputedModel(net=10.0),
        "cannot send StrictComputedModel: field gross is a computed field, which "
        "StrictComputedModel refuses when it decodes its own encoding (extra='forbid'): let the "
        "model ignore extra fields, or drop the computed field",
    ),
    (
        RowStruct("pen", "2"),  # type: ignore[arg-type]
        "cannot send RowStruct: field quantity holds a str ('2') where RowStruct declares int; "
        "convert the value before sending",
    ),
    (
        TaggedRowStruct(7, 2),  # type: ignore[arg-type]
        "cannot send TaggedRowStruct: field sku holds an int (7) where TaggedRowStruct declares "
        "str; convert the value before sending",
    ),
    (
        ExcludedModel(sku="pen", note="fragile"),
        "cannot send ExcludedModel: field note is not in ExcludedModel's encoding (left out by "
        "Field(exclude=True), a serialization alias, a serializer or model_construct), so it "
        "would not decode: have the encoding carry it, or give the field a default",
    ),
    (
        AttrsPrivate("fragile"),
        "cannot send AttrsPrivate: field _note is left out of the encoding (msgspec does not "
        "encode an attrs class's fields whose names begin with an underscore), so it would not "
        "decode: rename the field without the underscore",
    ),
    (
        Holder(LineModel(sku="pen", quantity=1)),
        "cannot send Holder: field line holds a pydantic model (LineModel), which only a "
        "pydantic model can hold: make Holder a pydantic model too, or LineModel a dataclass",
    ),
]


@pytest.mark.filterwarnings("ignore::UserWarning")  # pydantic warns serializing a wrong value
@pytest.mark.parametrize(("sent", "text"), REFUSED, ids=lambda x: type(x).__name__)
def test_a_message_a_receiver_could_not_decode_is_an_encode_error_naming_the_field(
    codec: JsonCodec, sent: object, text: str
) -> None:
    body = codec.encode(sent)

    with pytest.raises(EncodeError) as raised:
        codec.validate(sent, body)

    assert str(raised.value) == text
    with pytest.raises(DecodeError):
        codec.decode(body, type(sent))


class FramedCodec(JsonCodec):
    """JSON after a marker byte: its own encode and decode around the JSON codec's."""

    def encode(self, message: object) -> bytes:
        return b"\x01" + super().encode(message)

    def decode(self, body: bytes, cls: type) -> object:
        return super().decode(body[1:], cls)


def test_a_codec_built_on_the_json_codec_checks_through_its_own_decode() -> None:
    codec = FramedCodec()

    codec.validate(Counted(3), codec.encode(Counted(3)))
    with pytest.raises(EncodeError) as raised:
        codec.validate(Counted("3"), codec.encode(Counted("3")))  # type: ignore[arg-type]

    assert str(raised.value) == (
        "cannot send Counted: field count holds a str ('3') where Counted declares int; "
        "convert the value before sending"
    )


@dataclass
class Node:
    child: "Node | None" = None


@dataclass
class Nested:
    items: list[object]


def test_a_message_that_holds_itself_is_an_encode_error_naming_the_cycle(
    codec: JsonCodec,
) -> None:
    node = Node()
    node.child = node

    with pytest.raises(EncodeError) as raised:
        codec.encode(node)

    assert str(raised.value) == (
        "cannot encode Node as JSON: field child holds the message itself again (a cycle), "
        "which JSON cannot carry; send a copy without the cycle (an id in place of the object)"
    )


def test_a_list_that_holds_itself_is_an_encode_error_naming_both_fields(
    codec: JsonCodec,
) -> None:
    items: list[object] = []
    items.append({"again": items})

    with pytest.raises(EncodeError) as raised:
        codec.encode(Nested(items))

    assert str(raised.value) == (
        "cannot encode Nested as JSON: field items[0]['again'] holds field items again (a "
        "cycle), which JSON cannot carry; send a copy without the cycle (an id in place of the "
        "object)"
    )


def test_a_message_nested_deeper_than_the_encoder_goes_is_an_encode_error(
    codec: JsonCodec,
) -> None:
    items: list[object] = []
    for _ in range(sys.getrecursionlimit() * 2):
        items = [items]

    with pytest.raises(EncodeError) as raised:
        codec.encode(Nested(items))

    assert str(raised.value) == (
        "cannot encode Nested as JSON: it nests too deeply; send a flatter Nested"
    )


def test_a_body_too_deep_for_a_receiver_to_decode_is_refused_at_the_send(
    codec: JsonCodec,
) -> None:
    depth = sys.getrecursionlimit() * 2
    body = b'{"items":' + b"[" * depth + b"]" * depth + b"}"

    with pytest.raises(EncodeError) as raised:
        codec.validate(Nested([]), body)

    assert str(raised.value) == (
        "cannot send Nested: it nests too deeply for a receiver to decode; send a flatter Nested"
    )
    with pytest.raises(DecodeError) as decoding:
        codec.decode(body, Nested)
    assert str(decoding.value) == "body nests too deeply to decode as Nested"


@dataclass
class Scaled:
    amount: int
    factor: InitVar[int] = 1


@dataclass
class EitherLine:
    line: Line | Counted


@pytest.mark.parametrize(
    ("sent", "reason"),
    [
        (Scaled(1), "TypeError: dataclasses with `InitVar` fields are not supported"),
        (
            EitherLine(Line("pen", 1)),
            "TypeError: Type unions may not contain more than one dataclass or attrs type - "
            "type `tests.mersal.test_serialization.Line | tests.mersal.test_serialization.Counted` "
            "is not supported",
        ),
    ],
    ids=lambda x: type(x).__name__,
)
def test_a_class_the_json_codec_cannot_decode_is_refused_at_the_send_saying_so(
    codec: JsonCodec, sent: object, reason: str
) -> None:
    name = type(sent).__qualname__

    with pytest.raises(EncodeError) as raised:
        codec.validate(sent, codec.encode(sent))

    assert str(raised.value) == (
        f"cannot send {name}: no {name} can be decoded, whatever it holds ({reason}); change "
        "the class: fields of types the JSON codec decodes (str, int, float, bool, None, list, "
        "dict with str keys, datetime, UUID, Decimal, enum, or a dataclass, pydantic model, "
        "msgspec Struct or attrs class), each named where the class's module can find it"
    )
    with pytest.raises(DecodeError) as decoding:
        codec.decode(b"{}", type(sent))
    assert str(decoding.value) == f"{name} cannot be decoded from JSON ({reason})"


class NodeModel(pydantic.BaseModel):
    child: "NodeModel | None" = None


def test_a_pydantic_model_that_holds_itself_is_an_encode_error_naming_the_cycle(
    codec: JsonCodec,
) -> None:
    node = NodeModel()
    node.child = node

    with pytest.raises(EncodeError) as raised:
        codec.encode(node)

    assert str(raised.value) == (
        "cannot encode NodeModel as JSON: field child holds the message itself again (a cycle), "
        "which JSON cannot carry; send a copy without the cycle (an id in place of the object)"
    )


class Money:
    """A value msgspec cannot encode."""

    def __init__(self, cents: int) -> None:
        self.cents = cents


# A field the codec cannot write is named in the error.


def test_a_pydantic_field_that_cannot_be_serialized_is_named() -> None:
    class Priced(pydantic.BaseModel, arbitrary_types_allowed=True):
        sku: str
        price: Money

    with pytest.raises(EncodeError) as raised:
        JsonCodec().encode(Priced(sku="pen", price=Money(250)))
    text = str(raised.value)
    assert text.startswith(
        f"cannot encode {Priced.__qualname__} as JSON: field price holds a Money ("
    )
    assert "PydanticSerializationError" in text
