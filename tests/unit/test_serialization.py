"""The JSON codec: round trips, helpful decode errors, and JSON other languages can read."""

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone

import msgspec
import pydantic
import pytest

from mersal import DecodeError
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
