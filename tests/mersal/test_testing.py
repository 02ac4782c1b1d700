"""The test harness: what it records, and idle()."""

import asyncio
import re
from dataclasses import dataclass

import pytest

from mersal import (
    App,
    ConfigurationError,
    DecodeError,
    Envelope,
    Header,
    MersalError,
    MessageContext,
    RetryPolicy,
    Unroutable,
    message,
)
from mersal.testing import DeadLetter, Harness, NotIdle
from mersal.transport import Outgoing
from tests.support import eventually


@dataclass
class PlaceOrder:
    order_id: str


@dataclass
class OrderPlaced:
    order_id: str


@dataclass
class Remind:
    text: str


@dataclass
class Explode:
    n: int


@dataclass
class A:
    n: int


@dataclass
class B:
    n: int


@dataclass
class C:
    n: int


async def test_it_records_sent_published_deferred_and_dead_lettered_as_objects() -> None:
    async def place(message: PlaceOrder, context: MessageContext) -> None:
        await context.app.publish(OrderPlaced(message.order_id))
        await context.app.defer(0.05, Remind(f"follow up {message.order_id}"))

    async def remind(message: Remind) -> None:
        pass

    async def on_placed(message: OrderPlaced) -> None:
        pass

    async def explode(message: Explode) -> None:
        raise KeyError(message.n)

    orders = App("orders", retry=RetryPolicy(immediate=0, delayed=[], error_queue="errors"))
    orders.route(PlaceOrder, "orders")
    orders.route(Explode, "orders")
    orders.register(PlaceOrder, place)
    orders.register(Remind, remind)
    orders.register(Explode, explode)
    audit = App("audit")
    audit.register(OrderPlaced, on_placed)
    audit.subscribe(OrderPlaced)

    async with Harness(orders, audit) as bus:
        placed_id = await orders.send(PlaceOrder("o-1"))
        await orders.send(Explode(3))
        await bus.idle()

    assert bus.sent_of(PlaceOrder) == [PlaceOrder("o-1")]
    assert bus.sent_of(Explode) == [Explode(3)]
    assert bus.published_of(OrderPlaced) == [OrderPlaced("o-1")]
    assert [r.message for r in bus.deferred] == [Remind("follow up o-1")]
    assert bus.dead_lettered_of(Explode) == [Explode(3)]

    sent = bus.sent[0]
    assert (sent.address, sent.message_id, sent.headers[Header.TYPE]) == (
        "orders",
        placed_id,
        f"{PlaceOrder.__module__}.PlaceOrder",
    )
    [published] = bus.published
    assert published.address == f"{OrderPlaced.__module__}.OrderPlaced"
    assert published.headers[Header.CAUSATION_ID] == placed_id
    [deferred] = bus.deferred
    assert deferred.address == "orders"
    assert Header.DELIVER_AT in deferred.headers
    [dead] = bus.dead_lettered
    assert isinstance(dead, DeadLetter)
    assert dead.address == "errors"
    assert dead.error_type == "builtins.KeyError"
    assert dead.error_message == "3"
    assert dead.attempts == 1
    assert dead.source_queue == "orders"
    # Each list holds only its kind.
    assert not any(isinstance(r.message, Explode) for r in bus.published + bus.deferred)
    assert bus.published_of(PlaceOrder) == []
    assert bus.sent_of(OrderPlaced) == []


async def ignore(message: object) -> None:
    pass


async def test_an_undecodable_dead_letter_is_recorded_with_its_raw_body() -> None:
    app = App("orders", retry=RetryPolicy(immediate=0, delayed=[], error_queue="errors"))
    app.register(PlaceOrder, ignore)
    async with Harness(app) as bus:
        envelope = Envelope({Header.MESSAGE_ID: "m-1", Header.TYPE: "who.Knows"}, b"\x00\x01")
        await app.transport.send([Outgoing("orders", envelope)])
        await bus.idle()

    [dead] = bus.dead_lettered
    assert dead.message == b"\x00\x01"
    assert dead.message_id == "m-1"
    assert "who.Knows" in dead.error_message


async def test_idle_returns_only_once_a_chain_of_messages_has_fully_run() -> None:
    handled: list[str] = []

    async def on_a(message: A, context: MessageContext) -> None:
        await asyncio.sleep(0.01)  # the workload
        handled.append("a")
        await context.app.send(B(message.n))

    async def on_b(message: B, context: MessageContext) -> None:
        await asyncio.sleep(0.01)
        handled.append("b")
        await context.app.defer(0.05, C(message.n))

    async def on_c(message: C) -> None:
        await asyncio.sleep(0.01)
        handled.append("c")

    first = App("first")
    first.route(A, "first")
    first.route(B, "second")
    first.register(A, on_a)
    second = App("second")
    second.route(C, "first")
    second.register(B, on_b)
    first.register(C, on_c)

    async with Harness(first, second) as bus:
        await first.send(A(1))
        await bus.idle()
        assert handled == ["a", "b", "c"]
        assert bus.sent_of(B) == [B(1)]
        assert [r.message for r in bus.deferred] == [C(1)]


async def test_idle_without_delayed_returns_before_a_deferred_message_arrives() -> None:
    arrived = asyncio.Event()

    async def remind(message: Remind) -> None:
        arrived.set()

    app = App("reminders")
    app.register(Remind, remind)
    async with Harness(app) as bus:
        await app.defer(0.3, Remind("later"))
        await bus.idle(include_delayed=False)
        assert not arrived.is_set()
        assert bus.broker.delayed == 1
        await bus.idle()
        assert arrived.is_set()
        assert bus.broker.delayed == 0


async def test_idle_raises_timeout_error_when_a_handler_never_finishes() -> None:
    started = asyncio.Event()

    async def hang(message: PlaceOrder) -> None:
        started.set()
        await asyncio.Event().wait()

    app = App("orders", grace_period=0.05)
    app.register(PlaceOrder, hang)
    async with Harness(app) as bus:
        await app.send_local(PlaceOrder("o-1"))
        loop = asyncio.get_running_loop()
        begun = loop.time()
        with pytest.raises(TimeoutError):
            await bus.idle(timeout=0.2)
        assert 0.15 <= loop.time() - begun < 1.0
        assert started.is_set()
        assert app.in_flight == 1


async def test_idle_names_the_delayed_retry_and_the_running_handler_it_still_waits_for() -> None:
    async def hang(message: PlaceOrder) -> None:
        await asyncio.Event().wait()

    async def explode(message: Explode) -> None:
        raise RuntimeError("boom")

    app = App("orders", grace_period=0.05, retry=RetryPolicy(immediate=0, delayed=[30.0]))
    app.register(PlaceOrder, hang)
    app.register(Explode, explode)
    async with Harness(app) as bus:
        await app.send_local(Explode(1))
        await eventually(lambda: bus.broker.delayed == 1, "the delayed retry")
        await app.send_local(PlaceOrder("o-1"))
        with pytest.raises(NotIdle) as raised:
            await bus.idle(timeout=0.2)

    assert isinstance(raised.value, TimeoutError)
    assert isinstance(raised.value, MersalError)
    assert re.fullmatch(
        r"Harness\.idle\(timeout=0\.2\): still waiting after 0\.2 s for: "
        r"a delayed retry of Explode \(attempt 2\) due in 29\.\d s; "
        r"1 handler running for PlaceOrder \(0\.\d s\)",
        str(raised.value),
    ), str(raised.value)


async def test_idle_names_the_messages_queued_behind_busy_handlers_and_a_deferred_one() -> None:
    async def hang(message: PlaceOrder) -> None:
        await asyncio.Event().wait()

    app = App("orders", grace_period=0.05, concurrency=1)
    app.register(PlaceOrder, hang)
    app.register(Remind, ignore)
    async with Harness(app) as bus:
        await app.defer(60.0, Remind("later"))
        for number in range(3):
            await app.send_local(PlaceOrder(f"o-{number}"))
        with pytest.raises(TimeoutError) as raised:
            await bus.idle(timeout=0.1)
        without_delayed = await _not_idle(bus, include_delayed=False)

    assert re.fullmatch(
        r"Harness\.idle\(timeout=0\.1\): still waiting after 0\.1 s for: "
        r"a deferred Remind due in 59\.\d s; 1 handler running for PlaceOrder \(0\.\d s\); "
        r"2 messages queued in 'orders', not yet taken",
        str(raised.value),
    ), str(raised.value)
    assert "Remind" not in without_delayed
    assert without_delayed.endswith("2 messages queued in 'orders', not yet taken")


async def _not_idle(bus: Harness, *, include_delayed: bool) -> str:
    try:
        await bus.idle(timeout=0.05, include_delayed=include_delayed)
    except NotIdle as error:
        return str(error)
    raise AssertionError("idle() returned while a handler hangs")


def test_a_harness_needs_an_app() -> None:
    with pytest.raises(ConfigurationError, match="at least one app"):
        Harness()


async def test_a_harness_refuses_an_app_that_already_runs() -> None:
    app = App("orders")
    async with app:
        with pytest.raises(ConfigurationError, match="before starting it"):
            await Harness(app).start()


def test_the_broker_is_available_only_once_started() -> None:
    with pytest.raises(MersalError, match="start the Harness"):
        _ = Harness(App("orders")).broker


async def test_a_harness_that_fails_to_start_stops_the_apps_it_started() -> None:
    good = App("good")
    good.register(PlaceOrder, ignore)
    bad = App("bad")
    bad.subscribe(OrderPlaced)  # no handler: start() fails
    try:
        with pytest.raises(ConfigurationError, match="no handler"):
            async with Harness(good, bad):
                pass
        assert not good.running
    finally:
        await good.stop()


@pytest.mark.parametrize(
    "delay", [pytest.param(0.02, id="delayed"), pytest.param(0, id="no delay")]
)
async def test_delayed_retries_are_recorded_as_retried_not_as_sent(delay: float) -> None:
    attempts: list[int] = []

    async def flaky(message: PlaceOrder, context: MessageContext) -> None:
        attempts.append(context.attempt)
        if context.attempt == 1:
            raise RuntimeError("flaky")

    app = App("orders", retry=RetryPolicy(immediate=0, delayed=[delay]))
    app.register(PlaceOrder, flaky)
    async with Harness(app) as bus:
        await app.send_local(PlaceOrder("o-1"))
        await bus.idle()

    assert attempts == [1, 2]
    assert bus.sent_of(PlaceOrder) == [PlaceOrder("o-1")]
    assert [(r.message, r.headers[Header.ATTEMPT]) for r in bus.retried] == [
        (PlaceOrder("o-1"), "1")
    ]


async def test_a_message_the_broker_refused_is_not_recorded_as_sent() -> None:
    app = App("orders")
    app.route(PlaceOrder, "nobody-listens")
    async with Harness(app) as bus:
        with pytest.raises(Unroutable, match="nobody-listens"):
            await app.send(PlaceOrder("o-1"))

    assert bus.sent_of(PlaceOrder) == []


POLICY = RetryPolicy(immediate=1, delayed=[0.05], error_queue="error")
"""Two attempts in a row, one delayed attempt, then the error queue: three handler calls."""


@dataclass
class Ask:
    n: int


@message("settle.Answer")
@dataclass
class Answer:
    """The requester's reply class: a negative answer cannot be built."""

    n: int

    def __post_init__(self) -> None:
        if self.n == -2:
            raise asyncio.CancelledError()
        if self.n == -3:
            raise KeyboardInterrupt()
        if self.n < 0:
            raise RuntimeError(f"an answer cannot be negative ({self.n})")


@message("settle.Answer")
@dataclass
class AnswerOut:
    """The replier's class for the same wire name, which builds any answer."""

    n: int


async def test_the_harness_carries_a_reply_whose_class_cannot_be_built() -> None:
    async def answer(message: Ask, context: MessageContext) -> None:
        await context.app.reply(AnswerOut(message.n))

    client = App("client", retry=POLICY)
    client.route(Ask, "server")
    client.types.add(Answer)
    server = App("server", retry=POLICY)
    server.register(Ask, answer)
    async with Harness(client, server) as bus:
        with pytest.raises(DecodeError):
            await client.request(Ask(-1), reply_type=Answer, timeout=1)
        await bus.idle(timeout=5)
    [dead] = bus.dead_lettered
    assert dead.source_queue.startswith("client.replies.")
    assert dead.message == AnswerOut(-1)  # the app whose class can build it decoded it
