"""A newcomer's mistakes: each error or warning quotes what to change."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import attrs
import msgspec
import pydantic
import pytest
from sqlalchemy.ext.asyncio import AsyncSession

import mersal
from mersal import App, ConfigurationError, EncodeError, MersalError
from mersal.serialization import JsonCodec
from mersal.testing import Harness
from tests.support import eventually


@dataclass
class PlaceOrder:
    order_id: str


@dataclass
class Animal:
    name: str


@dataclass
class Dog(Animal):
    breed: str


class Event:
    """A plain base class of message classes (a marker): handlers and routes for it cover them."""


@dataclass
class OrderPlaced(Event):
    order_id: str


class Money:
    """A value msgspec cannot encode."""

    def __init__(self, cents: int) -> None:
        self.cents = cents


@dataclass
class Line:
    sku: str
    price: object


@dataclass
class Invoice:
    number: int
    lines: list[Line]


class PydanticOrder(pydantic.BaseModel):
    order_id: str


class StructOrder(msgspec.Struct):
    order_id: str


@attrs.define
class AttrsOrder:
    order_id: str


async def noop(message: object) -> None:
    pass


class SessionHandler:
    """Asks for the message's session, as the design's sample handler does."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def __call__(self, message: PlaceOrder) -> None:
        pass


class Orders:
    """A repository on the message's session."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session


class RepositoryHandler:
    def __init__(self, orders: Orders) -> None:
        self.orders = orders

    async def __call__(self, message: PlaceOrder) -> None:
        pass


# 1. A session without a database.


@pytest.mark.parametrize(
    ("handler", "trail"),
    [
        (SessionHandler, "session: AsyncSession"),
        (RepositoryHandler, "orders: Orders -> session: AsyncSession"),
    ],
)
async def test_a_handler_asking_for_a_session_without_a_database_is_told_to_pass_one(
    handler: type, trail: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MERSAL_DATABASE", raising=False)
    app = App("orders")
    app.register(PlaceOrder, handler)
    with pytest.raises(ConfigurationError) as raised:
        await app.start()
    assert str(raised.value) == (
        f"handler {handler.__qualname__} needs {trail}, the message's database session, but "
        "the app has no database: pass App(database='postgresql+asyncpg://...') (or set "
        "MERSAL_DATABASE), or drop the session from the handler"
    )
    assert not app.running


async def test_a_session_bound_in_the_users_container_is_not_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lagom import Container

    monkeypatch.delenv("MERSAL_DATABASE", raising=False)
    container = Container()
    container[AsyncSession] = lambda: None  # type: ignore[assignment,return-value]
    app = App("orders", container=container)
    app.register(PlaceOrder, SessionHandler)
    async with Harness(app):
        assert app.running


# 2. Types that are not messages.


def _register(app: App, message_type: Any) -> None:
    app.register(message_type, noop)


def _route(app: App, message_type: Any) -> None:
    app.route(message_type, "orders")


def _subscribe(app: App, message_type: Any) -> None:
    app.subscribe(message_type)


USES = {"register": (_register, ", ..."), "route": (_route, ", ..."), "subscribe": (_subscribe, "")}
SUPPORTED = "a message is a dataclass, a pydantic model, a msgspec Struct or an attrs class"


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


# 3. Messages that cannot be encoded.


async def test_a_field_that_cannot_be_encoded_raises_encode_error_and_nothing_is_sent() -> None:
    app = App("billing")
    app.route(Invoice, "billing")
    app.register(Invoice, noop)
    async with Harness(app) as bus:
        with pytest.raises(EncodeError) as raised:
            await app.send(Invoice(7, [Line("pen", 1.5), Line("ink", Money(250))]))
        await bus.idle()
        assert bus.sent == []
    assert str(raised.value) == (
        "cannot encode Invoice as JSON: field lines[1].price holds a Money; give the field a "
        "type JSON can carry (str, int, float, bool, None, list, dict with str keys, datetime, "
        "UUID, Decimal, enum, or a dataclass, pydantic model, msgspec Struct or attrs class) or "
        "convert the value before sending"
    )
    assert issubclass(EncodeError, MersalError)
    assert mersal.EncodeError is EncodeError


async def test_publishing_an_object_that_is_not_a_message_says_what_a_message_is() -> None:
    app = App("billing")
    async with Harness(app) as bus:
        with pytest.raises(EncodeError) as raised:
            await app.publish(Money(250))
        assert bus.published == []
    assert str(raised.value) == (
        "cannot send Money: a message is a dataclass, a pydantic model, a msgspec Struct or an "
        "attrs class; make Money one (e.g. decorate it with @dataclass)"
    )


async def test_a_message_that_cannot_be_encoded_is_not_buffered_in_its_transaction() -> None:
    app = App("billing")
    app.route(Invoice, "billing")
    app.register(Invoice, noop)
    async with Harness(app) as bus:
        async with app.transaction():
            await app.send(Invoice(1, []))
            with pytest.raises(EncodeError, match="field lines"):
                await app.send(Invoice(2, [Line("ink", Money(250))]))
            await app.send(Invoice(3, []))
        await bus.idle()
    assert bus.sent_of(Invoice) == [Invoice(1, []), Invoice(3, [])]


@pytest.mark.parametrize("amount", [math.inf, -math.inf, math.nan])
async def test_a_float_json_cannot_carry_raises_encode_error_instead_of_arriving_as_null(
    amount: float,
) -> None:
    app = App("billing")
    app.route(Line, "billing")
    app.register(Line, noop)
    async with Harness(app) as bus:
        with pytest.raises(EncodeError) as raised:
            await app.send(Line("pen", amount))
        await app.send(Line("ink", 2.5))
        await bus.idle()
        assert bus.sent_of(Line) == [Line("ink", 2.5)]
        assert bus.dead_lettered == []
    assert str(raised.value) == (
        f"cannot encode Line as JSON: field price holds {amount!r}, which JSON cannot carry (it "
        "would arrive as null): send a finite number"
    )


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


# 5. Handled types that nothing this app configures delivers.

UNDELIVERED = (
    "app 'billing' handles PlaceOrder but neither routes it to its own queue nor subscribes to "
    "it: its handler runs only for a PlaceOrder sent with send_local, routed here by another "
    "app or replied to this app; app.route(PlaceOrder, 'billing') if this app receives it, "
    "app.subscribe(PlaceOrder) if it is a published event"
)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "mersal.app" and r.levelno == logging.WARNING
    ]


async def test_a_handled_type_neither_routed_here_nor_subscribed_is_warned_of_at_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = App("billing")
    app.register(PlaceOrder, noop)
    app.route(PlaceOrder, "orders")  # routed, but elsewhere
    with caplog.at_level(logging.WARNING, logger="mersal.app"):
        async with Harness(app):
            pass
    assert _warnings(caplog) == [UNDELIVERED]


@pytest.mark.parametrize(
    "configure",
    [
        pytest.param(lambda app: app.route(PlaceOrder, "billing"), id="routed-here"),
        pytest.param(lambda app: app.subscribe(PlaceOrder), id="subscribed"),
    ],
)
async def test_a_handled_type_routed_here_or_subscribed_is_not_warned_of(
    configure: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app = App("billing")
    app.register(PlaceOrder, noop)
    configure(app)
    with caplog.at_level(logging.WARNING, logger="mersal.app"):
        async with Harness(app):
            pass
    assert _warnings(caplog) == []


@pytest.mark.parametrize(
    "configure",
    [
        pytest.param(lambda app: app.subscribe(Dog), id="a-subclass-subscribed"),
        pytest.param(lambda app: app.route(Dog, "vet"), id="a-subclass-routed-here"),
        pytest.param(lambda app: app.route(Animal, "vet"), id="a-base-routed-here"),
    ],
)
async def test_a_handled_type_reached_through_a_related_class_is_not_warned_of(
    configure: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app = App("vet")
    app.register(Animal, noop)  # a Dog is an Animal: Dog messages reach this handler
    app.register(Dog, noop)  # a route for Animal covers Dog
    configure(app)
    with caplog.at_level(logging.WARNING, logger="mersal.app"):
        async with Harness(app):
            pass
    assert _warnings(caplog) == []


# 7. memory:// in `mersal run`.

MEMORY_SERVICE = """
from dataclasses import dataclass

from mersal import App


@dataclass
class Ping:
    n: int


async def handle(ping: Ping) -> None:
    return None


app = App("lonely", transport="memory://lonely")
app.register(Ping, handle)
app.route(Ping, "lonely")
"""


async def test_mersal_run_on_memory_warns_that_no_other_process_reaches_it(
    tmp_path: Path,
) -> None:
    (tmp_path / "svc.py").write_text(MEMORY_SERVICE)
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MERSAL_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mersal.cli",
        "run",
        "svc:app",
        cwd=tmp_path,
        env={**environment, "PYTHONPATH": os.getcwd()},
        stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
    )
    lines: list[str] = []

    async def read() -> None:
        assert process.stderr is not None
        async for line in process.stderr:
            lines.append(line.decode().rstrip("\n"))

    reader = asyncio.create_task(read())
    try:
        await eventually(lambda: any("started" in line for line in lines), "started", timeout=20)
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(20):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await reader
    warned = [line.split(": ", 1)[1] for line in lines if "WARNING mersal.run" in line]
    assert warned == [
        "app 'lonely' runs on memory://lonely, a broker inside this process: no other process "
        "reaches it (a second `mersal run`, a web server or a script on the same URL gets an "
        "empty broker of its own, and their messages never meet); for several processes use "
        "RabbitMQ: MERSAL_TRANSPORT=amqp://user:password@host/vhost"
    ]
