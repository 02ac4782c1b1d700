"""Wire type names, the type registry (an allow-list that never imports), and envelopes."""

import collections
import os
import sys
import uuid
from dataclasses import dataclass
from typing import Any

import attrs
import msgspec
import pydantic
import pytest

from mersal import (
    App,
    ConfigurationError,
    DecodeError,
    Envelope,
    Header,
    message,
)
from mersal.messages import (
    IDS_PER_DRAW,
    SHOWN_LENGTH,
    TypeRegistry,
    derived_id,
    describe,
    new_id,
    shown,
    type_name_of,
)
from mersal.testing import Harness


@dataclass
class Plain:
    value: int


@message("orders.PlaceOrder.v2")
@dataclass
class Named:
    order_id: str


@dataclass
class NamedChild(Named):
    note: str = ""


@message("orders.Slotted.v1")
@dataclass(slots=True)
class NamedThenSlotted:
    order_id: str


@dataclass(slots=True)
@message("orders.SlottedOuter.v1")
class SlottedThenNamed:
    order_id: str


@message("orders.Struct.v1")
class NamedStruct(msgspec.Struct):
    order_id: str


@message("orders.Model.v1")
class NamedModel(pydantic.BaseModel):
    order_id: str


class Event:
    pass


class OrderEvent(Event):
    pass


class OrderShipped(OrderEvent):
    pass


# Wire names.


def test_the_default_name_is_module_and_qualified_name() -> None:
    assert type_name_of(Plain) == f"{__name__}.Plain"


def test_a_nested_class_name_includes_its_outer_class() -> None:
    class Outer:
        @dataclass
        class Inner:
            value: int

    assert type_name_of(Outer.Inner).endswith(".Outer.Inner")
    assert type_name_of(Outer.Inner).startswith(f"{__name__}.")


@pytest.mark.parametrize(
    ("cls", "name"),
    [
        (Named, "orders.PlaceOrder.v2"),
        (NamedThenSlotted, "orders.Slotted.v1"),
        (SlottedThenNamed, "orders.SlottedOuter.v1"),
        (NamedStruct, "orders.Struct.v1"),
        (NamedModel, "orders.Model.v1"),
    ],
)
def test_message_sets_the_wire_name(cls: type, name: str) -> None:
    assert type_name_of(cls) == name


def test_a_subclass_does_not_inherit_the_declared_name() -> None:
    assert type_name_of(NamedChild) == f"{__name__}.NamedChild"
    assert type_name_of(Named) == "orders.PlaceOrder.v2"


@pytest.mark.parametrize("name", ["", "   ", "orders PlaceOrder", "orders.\tX", "x\n"])
def test_message_rejects_a_name_that_is_empty_or_has_spaces(name: str) -> None:
    with pytest.raises(ConfigurationError, match="message type name"):
        message(name)


# The registry.


def test_add_returns_the_name_and_resolve_returns_the_class() -> None:
    registry = TypeRegistry()

    assert registry.add(Named) == "orders.PlaceOrder.v2"
    assert registry.add(Plain) == f"{__name__}.Plain"

    assert registry.resolve("orders.PlaceOrder.v2") is Named
    assert registry.resolve(f"{__name__}.Plain") is Plain
    assert Named in registry
    assert NamedChild not in registry


def test_adding_the_same_class_twice_is_fine() -> None:
    registry = TypeRegistry()
    registry.add(Named)

    assert registry.add(Named) == "orders.PlaceOrder.v2"
    assert registry.resolve("orders.PlaceOrder.v2") is Named


def test_name_of_allows_a_class_on_first_use() -> None:
    registry = TypeRegistry()

    assert registry.name_of(Plain) == f"{__name__}.Plain"
    assert registry.resolve(f"{__name__}.Plain") is Plain


def test_two_classes_with_one_name_are_refused_naming_both_and_suggesting_message() -> None:
    @message("orders.Clash.v1")
    @dataclass
    class First:
        value: int

    @message("orders.Clash.v1")
    @dataclass
    class Second:
        value: int

    registry = TypeRegistry()
    registry.add(First)

    with pytest.raises(ConfigurationError) as raised:
        registry.add(Second)

    text = str(raised.value)
    assert "orders.Clash.v1" in text
    assert First.__qualname__ in text
    assert Second.__qualname__ in text
    assert "@message" in text
    assert registry.resolve("orders.Clash.v1") is First


@pytest.mark.parametrize(
    "thing",
    [
        42,
        "orders.PlaceOrder",
        None,
        pytest.param(Plain(1), id="an unhashable instance"),
        pytest.param([Plain], id="a list"),
    ],
)
def test_adding_something_that_is_not_a_class_is_refused(thing: object) -> None:
    with pytest.raises(ConfigurationError, match="not a class"):
        TypeRegistry().add(thing)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name",
    [
        "os.system",
        "builtins.eval",
        "subprocess.Popen",
        "collections.OrderedDict",
        f"{__name__}.Plain",
        "",
        "orders.PlaceOrder.v1",
    ],
)
def test_an_unknown_name_is_a_decode_error_and_imports_nothing(name: str) -> None:
    registry = TypeRegistry()
    registry.add(Named)
    modules = set(sys.modules)

    with pytest.raises(DecodeError, match="unknown message type"):
        registry.resolve(name)

    assert set(sys.modules) - modules == set()


def test_resolving_a_name_in_an_unimported_module_does_not_import_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, "json.tool", raising=False)
    registry = TypeRegistry()
    registry.add(Plain)

    with pytest.raises(DecodeError):
        registry.resolve("json.tool.main")

    assert "json.tool" not in sys.modules


def test_a_subclass_of_a_registered_class_resolves_by_its_own_name() -> None:
    registry = TypeRegistry()
    registry.add(Event)

    assert registry.resolve(type_name_of(OrderShipped)) is OrderShipped
    assert registry.resolve(type_name_of(OrderEvent)) is OrderEvent
    assert OrderShipped in registry


def test_a_subclass_of_a_decorated_class_resolves_by_its_default_name() -> None:
    registry = TypeRegistry()
    registry.add(Named)

    assert registry.resolve(f"{__name__}.NamedChild") is NamedChild
    with pytest.raises(DecodeError):
        registry.resolve("orders.PlaceOrder.v2.NamedChild")


def test_a_registered_object_does_not_make_every_class_resolvable() -> None:
    registry = TypeRegistry()
    registry.add(object)

    for name in [
        f"{__name__}.Plain",
        "collections.OrderedDict",
        "subprocess.Popen",
        "builtins.type",
        "builtins.eval",
    ]:
        with pytest.raises(DecodeError):
            registry.resolve(name)
    assert Plain not in registry
    assert collections.OrderedDict not in registry


def test_a_class_outside_the_registered_hierarchy_stays_unknown() -> None:
    registry = TypeRegistry()
    registry.add(OrderEvent)

    with pytest.raises(DecodeError):
        registry.resolve(type_name_of(Event))  # a base class is not allowed by its subclass
    with pytest.raises(DecodeError):
        registry.resolve(f"{__name__}.Plain")


# Envelopes.


def test_envelope_copy_adds_and_replaces_headers_without_touching_the_original() -> None:
    original = Envelope({Header.MESSAGE_ID: "m-1", Header.ATTEMPT: "1"}, b"body")

    copied = original.copy(**{Header.ATTEMPT: "2", Header.DELIVER_AT: "123.0"})

    assert original.headers == {Header.MESSAGE_ID: "m-1", Header.ATTEMPT: "1"}
    assert copied.headers == {
        Header.MESSAGE_ID: "m-1",
        Header.ATTEMPT: "2",
        Header.DELIVER_AT: "123.0",
    }
    assert copied.body == original.body
    copied.headers["x-later"] = "1"
    assert "x-later" not in original.headers


def test_envelope_properties_read_their_headers() -> None:
    envelope = Envelope(
        {Header.MESSAGE_ID: "m-1", Header.TYPE: "t.T", Header.PARTITION_KEY: "k"}, b""
    )

    assert (envelope.message_id, envelope.type_name, envelope.partition_key) == ("m-1", "t.T", "k")
    assert Envelope({}, b"").message_id is None


def test_new_ids_are_distinct_version_4_uuids() -> None:
    ids = [new_id() for _ in range(5 * IDS_PER_DRAW)]
    assert len(set(ids)) == len(ids)
    for text in ids[:: IDS_PER_DRAW // 2]:
        parsed = uuid.UUID(text)
        assert (parsed.version, parsed.variant, str(parsed)) == (4, uuid.RFC_4122, text)


def test_a_forked_child_draws_ids_of_its_own() -> None:
    new_id()  # the parent holds a draw of random bytes the child must not reuse
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(writer, new_id().encode())
        os._exit(0)
    os.close(writer)
    child = os.read(reader, 100).decode()
    os.waitpid(pid, 0)
    os.close(reader)
    assert child != new_id()
    assert uuid.UUID(child).version == 4


@pytest.mark.parametrize("name", ["a", "seed\x00 1", "héllo", "x" * 300])
def test_derived_ids_are_the_uuid5_of_the_name(name: str) -> None:
    namespace = uuid.uuid4()
    assert derived_id(namespace.bytes, name) == str(uuid.uuid5(namespace, name))


def test_log_lines_show_header_values_printable_on_one_line_and_short() -> None:
    headers = {
        Header.MESSAGE_ID: "m-1\nforged line",
        Header.TYPE: "t" * 500,
        Header.CORRELATION_ID: "c\x00\x1b[31m",
    }
    line = describe(headers)
    assert "\n" not in line and "\x00" not in line and "\x1b" not in line
    assert "id=m-1\\nforged\\x20line" in line
    assert f"type={'t' * 97}..." in line
    assert "correlation=c\\x00\\x1b[31m" in line


@pytest.mark.parametrize("value", ["\x00" * 200, "\\" * 101, "é\n" * 60, "x" * 101, " " * 30])
def test_a_shown_header_value_is_at_most_its_length_once_escaped(value: str) -> None:
    text = shown(value)
    assert len(text) <= SHOWN_LENGTH
    assert text.isprintable() and " " not in text


def test_a_shown_header_value_cannot_pass_for_another_field_of_the_line() -> None:
    line = describe({Header.MESSAGE_ID: "id=1 type=evil.Forged", Header.TYPE: "a\\x20b"})

    assert line.split() == [
        "id=id=1\\x20type=evil.Forged",
        "type=a\\\\x20b",
        "correlation=None",
    ]


@dataclass
class Job:
    n: int


async def _succeed(message: Job) -> None:
    return None


# Type names the broker cannot carry, refused where they are given.


def test_a_message_type_name_over_255_bytes_is_refused_where_it_is_given() -> None:
    with pytest.raises(ConfigurationError, match="255"):
        message("x" * 300)
    message("x" * 255)  # the longest that fits


@pytest.mark.parametrize("use", ["register", "route", "subscribe"])
def test_a_class_whose_default_type_name_is_over_255_bytes_is_refused(use: str) -> None:
    long_named: type = dataclass(type("L" * 300, (), {"__annotations__": {"n": int}}))
    app = App("names")
    with pytest.raises(ConfigurationError, match="255"):
        if use == "register":
            app.register(long_named, _succeed)
        elif use == "route":
            app.route(long_named, "names")
        else:
            app.subscribe(long_named)


@dataclass
class PlaceOrder:
    order_id: str


@dataclass
class OrderPlaced(Event):
    order_id: str


class Money:
    """A value msgspec cannot encode."""

    def __init__(self, cents: int) -> None:
        self.cents = cents


class PydanticOrder(pydantic.BaseModel):
    order_id: str


class StructOrder(msgspec.Struct):
    order_id: str


@attrs.define
class AttrsOrder:
    order_id: str


async def noop(message: object) -> None:
    pass


def _register(app: App, message_type: Any) -> None:
    app.register(message_type, noop)


def _route(app: App, message_type: Any) -> None:
    app.route(message_type, "orders")


def _subscribe(app: App, message_type: Any) -> None:
    app.subscribe(message_type)


USES = {"register": (_register, ", ..."), "route": (_route, ", ..."), "subscribe": (_subscribe, "")}


SUPPORTED = "a message is a dataclass, a pydantic model, a msgspec Struct or an attrs class"


# Types that are not message classes, refused with the kinds that are.


@pytest.mark.parametrize("use", sorted(USES))
@pytest.mark.parametrize("builtin", [int, str, dict])
def test_a_builtin_type_is_refused_with_the_supported_kinds(use: str, builtin: type) -> None:
    call, rest = USES[use]
    name = builtin.__qualname__
    with pytest.raises(ConfigurationError) as raised:
        call(App("a"), builtin)
    assert str(raised.value) == (
        f"app.{use}({name}{rest}): {name} is not a message class; {SUPPORTED}: wrap the value "
        f"in one (e.g. a @dataclass with a field of type {name})"
    )


@pytest.mark.parametrize("use", sorted(USES))
def test_a_plain_class_is_refused_with_how_to_make_it_a_message(use: str) -> None:
    call, rest = USES[use]
    with pytest.raises(ConfigurationError) as raised:
        call(App("a"), Money)
    assert str(raised.value) == (
        f"app.{use}(Money{rest}): Money is not a message class; {SUPPORTED}: make Money one "
        "(e.g. decorate it with @dataclass)"
    )


@pytest.mark.parametrize("use", sorted(USES))
def test_something_that_is_not_a_class_is_refused(use: str) -> None:
    call, _ = USES[use]
    with pytest.raises(ConfigurationError) as raised:
        call(App("a"), PlaceOrder("o-1"))
    assert str(raised.value) == (
        f"app.{use}() takes a message class, not PlaceOrder(order_id='o-1'): pass the class itself"
    )


@pytest.mark.parametrize("use", sorted(USES))
@pytest.mark.parametrize("kind", [PlaceOrder, PydanticOrder, StructOrder, AttrsOrder])
def test_every_supported_kind_of_message_class_is_accepted(use: str, kind: type) -> None:
    USES[use][0](App("a"), kind)


async def test_an_attrs_message_goes_round_trip() -> None:
    got: list[AttrsOrder] = []

    async def handle(message: AttrsOrder) -> None:
        got.append(message)

    app = App("orders")
    app.register(AttrsOrder, handle)
    app.route(AttrsOrder, "orders")
    async with Harness(app) as bus:
        await app.send(AttrsOrder("o-1"))
        await bus.idle()
    assert got == [AttrsOrder("o-1")]


async def test_a_plain_base_class_of_messages_can_be_handled_and_routed_not_subscribed() -> None:
    got: list[Event] = []

    async def audit(message: Event) -> None:
        got.append(message)

    app = App("audit")
    app.register(Event, audit)
    app.route(Event, "audit")
    with pytest.raises(ConfigurationError, match=r"app\.subscribe\(Event\): Event is not"):
        app.subscribe(Event)
    async with Harness(app) as bus:
        await app.send(OrderPlaced("o-1"))
        await bus.idle()
    assert got == [OrderPlaced("o-1")]


def test_a_codec_that_does_not_say_what_it_accepts_is_trusted_with_any_class() -> None:
    class BytesCodec:
        content_type = "application/octet-stream"

        def encode(self, message: object) -> bytes:
            return bytes(message)  # type: ignore[call-overload]

        def decode(self, body: bytes, cls: type) -> Any:
            return cls(body)

    app = App("a", codec=BytesCodec())
    app.register(bytes, noop)
    app.route(bytes, "a")
    app.subscribe(bytes)


@message("shared.Name.v1")
@dataclass
class First:
    a: int


@message("shared.Name.v1")
@dataclass
class Second:
    b: int


def test_one_message_name_on_two_classes_is_refused() -> None:
    app = App("a")
    app.register(First, noop)
    with pytest.raises(ConfigurationError) as raised:
        app.register(Second, noop)
    text = str(raised.value)
    assert "shared.Name.v1" in text
    assert "First" in text
    assert "Second" in text
    assert "@message(" in text
