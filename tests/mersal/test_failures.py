"""Regressions of an adversarial review, on the memory transport: how attempts end and settle.

A handler that cancels its own task fails its attempts (p25); a dead letter the error queue
refuses does not get its message handled again (p18), nor does it let the messages of its
partition key overtake it (p17); two different messages that share an id do not lend their sends
one id (p13); a handler that swallows its timeout is cancelled again, and a stop ends even when a
handler ignores every cancellation (p01, p01b); a task a failed attempt left behind cannot send
through `app.transaction()` (p22); a stop returns a long lane to its queue, in order, before it
returns (p09); the handler clock keeps no message context alive (p19).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from mersal import (
    App,
    Envelope,
    Header,
    MersalError,
    MessageContext,
    OutcomeUnknown,
    RetryPolicy,
    TransactionClosed,
)
from mersal.transport import Consumer, Delivery, Outgoing
from mersal.transport.memory import MemoryBroker, MemoryTransport
from tests.support import DelegatingTransport, eventually

pytestmark = pytest.mark.timeout(60)

ERROR_QUEUE = "error"
FAIL_FAST = RetryPolicy(immediate=0, delayed=[], error_queue=ERROR_QUEUE)
"""One attempt, then the error queue."""
THREE_ATTEMPTS = RetryPolicy(immediate=2, delayed=[], error_queue=ERROR_QUEUE)
"""Three attempts in a row, then the error queue."""


@dataclass
class Job:
    n: int


@dataclass
class Order:
    amount: int


@dataclass
class Charge:
    amount: int


@dataclass
class Note:
    text: str


class Broken(Exception):
    """A handler failure on purpose."""


def broker_of(app: App) -> MemoryBroker:
    """The memory broker under `app`'s transport (wrapped or not)."""
    transport = app.transport
    while isinstance(transport, DelegatingTransport):
        transport = transport.inner
    assert isinstance(transport, MemoryTransport)
    return transport.broker


def settled(broker: MemoryBroker, queue: str) -> bool:
    """Whether `queue` has nothing ready and nothing unacknowledged."""
    found = broker.queues[queue]
    return not found.ready and not found.unacked


def waiting(broker: MemoryBroker, queue: str) -> list[Envelope]:
    """The envelopes ready in `queue`, in order."""
    return [stored.envelope for stored in broker.queues[queue].ready]


async def dead_lettered(broker: MemoryBroker, queue: str) -> list[Envelope]:
    """Wait until `queue` is settled and the error queue holds a dead letter; what it holds."""
    await eventually(
        lambda: settled(broker, queue) and bool(broker.queues[ERROR_QUEUE].ready),
        f"{queue!r} settled and a dead letter in the error queue",
    )
    return waiting(broker, ERROR_QUEUE)


def number_of(envelope: Envelope) -> int:
    """The `n` field of a JSON body."""
    return int(json.loads(envelope.body)["n"])


class RefusingErrorQueue(DelegatingTransport):
    """A memory transport whose error queue refuses the first `refusals` messages sent to it."""

    def __init__(self, url: str, refusals: int, error: type[MersalError] = MersalError) -> None:
        super().__init__(MemoryTransport(url))
        self.refusals = refusals
        self.refused = 0
        self.error = error

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        """Refuse what goes to the error queue while refusals are left; send the rest."""
        results: list[Exception | None] = []
        for outgoing in messages:
            if outgoing.address == ERROR_QUEUE and self.refused < self.refusals:
                self.refused += 1
                results.append(self.error("the error queue is full (reject-publish), on purpose"))
            else:
                results.extend(await self.inner.send_each([outgoing]))
        return results


# p25: a handler that cancels its own task.


async def test_a_handler_cancelling_its_own_task_fails_each_attempt_then_dead_letters(
    memory_url: str,
) -> None:
    calls = 0

    async def handle(message: Job) -> None:
        nonlocal calls
        calls += 1
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(1)

    app = App("self-cancel", transport=memory_url, retry=THREE_ATTEMPTS)
    app.register(Job, handle)
    app.route(Job, "self-cancel")
    async with app:
        broker = broker_of(app)
        await app.send(Job(1))
        [dead] = await dead_lettered(broker, "self-cancel")

    assert calls == THREE_ATTEMPTS.max_attempts
    assert dead.headers[Header.ERROR_TYPE].endswith("CancelledError")
    assert dead.headers[Header.ERROR_ATTEMPTS] == str(THREE_ATTEMPTS.max_attempts)


# p18: the error queue refuses the dead letter for a while.


async def test_a_message_whose_dead_letter_is_refused_is_not_handled_again(memory_url: str) -> None:
    calls = 0

    async def handle(message: Job) -> None:
        nonlocal calls
        calls += 1
        raise Broken("always fails")

    transport = RefusingErrorQueue(memory_url, refusals=3)
    app = App("full-errors", transport=transport, retry=THREE_ATTEMPTS)
    app.register(Job, handle)
    app.route(Job, "full-errors")
    async with app:
        app.settler.backoff = 0.01  # return the delivery at once after a refusal
        broker = broker_of(app)
        await app.send(Job(1))
        [dead] = await dead_lettered(broker, "full-errors")

    assert transport.refused == 3  # refused three times, taken the fourth
    assert calls == THREE_ATTEMPTS.max_attempts  # not handled again each time it came back
    assert dead.headers[Header.ERROR_ATTEMPTS] == str(THREE_ATTEMPTS.max_attempts)
    assert number_of(dead) == 1


# p17: a key's lane when the dead letter of its head cannot be sent once.


async def test_a_lane_waits_for_its_head_whose_dead_letter_was_refused_once(
    memory_url: str,
) -> None:
    events: list[tuple[str, int]] = []

    async def handle(message: Job) -> None:
        events.append(("handled", message.n))
        if message.n == 1 and events.count(("handled", 1)) == 1:
            raise Broken("step 1 fails (fail-fast to the error queue)")

    transport = RefusingErrorQueue(memory_url, refusals=1, error=OutcomeUnknown)
    app = App("lane", transport=transport, retry=FAIL_FAST, concurrency=4)
    app.register(Job, handle)
    app.route(Job, "lane")
    async with app:
        app.settler.backoff = 0.01
        broker = broker_of(app)
        broker.observers.append(
            lambda o: (
                events.append(("dead", number_of(o.envelope))) if o.address == ERROR_QUEUE else None
            )
        )
        async with app.transaction():  # one batch: the three wait in one lane
            for n in (1, 2, 3):
                await app.send(Job(n), partition_key="acct-1")
        await eventually(
            lambda: (
                settled(broker, "lane")
                and ("handled", 3) in events
                and (("dead", 1) in events or events.count(("handled", 1)) > 1)
            ),
            "the lane's head dead-lettered or handled again, and message 3 handled",
            timeout=5,
        )

    assert transport.refused == 1
    # 1 is not handled again; its dead letter leaves before 2 and 3 are handled.
    assert events == [("handled", 1), ("dead", 1), ("handled", 2), ("handled", 3)]
    assert [number_of(e) for e in waiting(broker, ERROR_QUEUE)] == [1]


# p13: two different messages that came with one id.


async def test_two_different_messages_with_one_id_send_messages_with_different_ids(
    memory_url: str,
) -> None:
    middle = App("middle", transport=memory_url)
    producer = App("producer", transport=memory_url)
    producer.route(Order, "middle")
    middle.route(Charge, "down")

    async def on_order(message: Order) -> None:
        await middle.send(Charge(message.amount))

    middle.register(Order, on_order)
    sink = MemoryTransport(memory_url)
    await sink.start()
    try:
        await sink.declare("down")
        async with middle, producer:
            broker = broker_of(middle)
            # A producer that numbers its messages itself, carelessly: one id, two bodies.
            await producer.send(Order(10), headers={Header.MESSAGE_ID: "1"})
            await producer.send(Order(99), headers={Header.MESSAGE_ID: "1"})
            # The same message once more (a duplicate): it derives what the first one did.
            await producer.send(Order(10), headers={Header.MESSAGE_ID: "1"})
            await eventually(
                lambda: len(broker.queues["down"].ready) == 3,
                'three messages waiting in the "down" queue',
                timeout=5,
            )
            down = waiting(broker, "down")
    finally:
        await sink.stop()

    amounts = [json.loads(envelope.body)["amount"] for envelope in down]
    ids = [envelope.headers[Header.MESSAGE_ID] for envelope in down]
    assert amounts == [10, 99, 10]
    assert ids[0] != ids[1]
    assert ids[2] == ids[0]


# p01 / p01b: handlers that swallow cancellation.


async def test_a_handler_that_swallows_its_timeout_is_cancelled_again_and_dead_lettered(
    memory_url: str,
) -> None:
    calls = 0
    swallowed = 0
    finished = False

    async def handle(message: Job) -> None:
        nonlocal calls, swallowed, finished
        calls += 1
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            swallowed += 1
        await asyncio.sleep(30)  # and awaits again
        finished = True

    app = App(
        "swallow",
        transport=memory_url,
        retry=FAIL_FAST,
        handler_timeout=0.2,
        grace_period=0.5,
    )
    app.register(Job, handle)
    app.route(Job, "swallow")
    async with app:
        broker = broker_of(app)
        started = time.monotonic()
        await app.send(Job(1))
        await eventually(
            lambda: bool(broker.queues[ERROR_QUEUE].ready), "the dead letter", timeout=3
        )
        took = time.monotonic() - started
        await eventually(lambda: settled(broker, "swallow"), "the delivery settled")
        [dead] = waiting(broker, ERROR_QUEUE)

    assert dead.headers[Header.ERROR_TYPE] == "mersal.timeouts.HandlerTimeout"
    assert (calls, swallowed, finished) == (1, 1, False)
    assert took < 2.0


async def test_stop_returns_in_bounded_time_when_a_handler_ignores_every_cancellation(
    memory_url: str,
) -> None:
    grace = 0.2
    entered = asyncio.Event()
    release = asyncio.Event()
    cancellations = 0

    async def handle(message: Job) -> None:
        nonlocal cancellations
        entered.set()
        while not release.is_set():  # a careless retry loop: catches even cancellation
            try:
                await release.wait()
            except BaseException:
                cancellations += 1

    app = App(
        "stubborn",
        transport=memory_url,
        retry=FAIL_FAST,
        handler_timeout=None,
        grace_period=grace,
    )
    app.register(Job, handle)
    app.route(Job, "stubborn")
    await app.start()
    broker = broker_of(app)
    stopping: asyncio.Future[None] | None = None
    try:
        await app.send(Job(1))
        await asyncio.wait_for(entered.wait(), 5)
        started = time.monotonic()
        stopping = asyncio.ensure_future(app.stop())
        done, _ = await asyncio.wait({stopping}, timeout=grace + 6)
        took = time.monotonic() - started
        assert stopping in done, f"app.stop() still running after {took:.1f}s"
        stopping.result()
        assert took <= grace + 6
        assert cancellations >= 1
        assert not app.running
        # The message is not lost: the transport returned it when it stopped.
        queue = broker.queues["stubborn"]
        assert (len(queue.ready), queue.unacked) == (1, 0)
    finally:
        release.set()  # let the handler end, so that the test's event loop can close
        if stopping is None:
            await app.stop()
        else:
            await asyncio.wait_for(asyncio.shield(stopping), 10)


# p22: a task left behind by a failed attempt.


async def test_a_task_left_behind_cannot_send_through_app_transaction_after_the_attempt(
    memory_url: str,
) -> None:
    attempt_over = asyncio.Event()
    left_behind: list[asyncio.Task[None]] = []
    outcomes: list[str] = []
    notes: list[str] = []

    app = App("left-behind", transport=memory_url, retry=FAIL_FAST)

    async def later() -> None:
        await attempt_over.wait()
        try:
            async with app.transaction():
                await app.send_local(Note("from a block after the attempt"))
            outcomes.append("sent")
        except TransactionClosed:
            outcomes.append("TransactionClosed")

    async def work(message: Job) -> None:
        left_behind.append(asyncio.get_running_loop().create_task(later()))
        raise Broken("the attempt fails")

    async def note(message: Note) -> None:
        notes.append(message.text)

    app.register(Job, work)
    app.register(Note, note)
    routed: list[Outgoing] = []
    async with app:
        broker = broker_of(app)
        broker.observers.append(routed.append)
        await app.send_local(Job(1))
        await dead_lettered(broker, "left-behind")
        attempt_over.set()
        await asyncio.wait_for(asyncio.gather(*left_behind), 5)
        await eventually(
            lambda: settled(broker, "left-behind"),
            "the delivery settled after the left-behind task ran",
        )

    assert outcomes == ["TransactionClosed"]
    assert notes == []
    note_type = app.types.name_of(Note)
    assert [o for o in routed if o.envelope.headers.get(Header.TYPE) == note_type] == []


# p09: a stop with a long lane.


ROUND_TRIP_HOPS = 20
"""Event loop turns a nack takes on its way to the broker and back (a broker's is slower)."""


class RoundTripDelivery:
    """A delivery whose nack takes a round trip, as a broker's does."""

    def __init__(self, inner: Delivery) -> None:
        self.inner = inner
        self.envelope = inner.envelope
        self.queue = inner.queue
        self.redelivered = inner.redelivered

    async def ack(self) -> None:
        """Ack."""
        await self.inner.ack()

    async def nack(self, requeue: bool = True) -> None:
        """Nack, after a round trip through the event loop."""
        for _ in range(ROUND_TRIP_HOPS):
            await asyncio.sleep(0)
        await self.inner.nack(requeue)


class RoundTripConsumer:
    """A consumer whose deliveries nack as a broker's do (not at once)."""

    def __init__(self, inner: Consumer) -> None:
        self.inner = inner

    async def get(self) -> Delivery:
        """The next delivery."""
        return RoundTripDelivery(await self.inner.get())

    async def close(self) -> None:
        """Stop receiving."""
        await self.inner.close()


class StopWatcher(DelegatingTransport):
    """A memory transport that notes how many deliveries of `queue` were owed when it stopped."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(MemoryTransport(url))
        self.queue = queue
        self.owed_at_stop: int | None = None

    async def consume(self, queue: str, *, prefetch: int) -> Consumer:
        """Consume; deliveries nack through the event loop."""
        return RoundTripConsumer(await self.inner.consume(queue, prefetch=prefetch))

    async def stop(self) -> None:
        """Note what the worker left unsettled, then stop (which returns it)."""
        transport = self.inner
        assert isinstance(transport, MemoryTransport)
        queue = transport.broker.queues.get(self.queue)
        if queue is not None and self.owed_at_stop is None:
            self.owed_at_stop = queue.unacked
        await super().stop()


async def test_a_stop_returns_a_long_lane_to_its_queue_in_order_before_it_returns(
    memory_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="mersal")
    count = 2_000
    handled: list[int] = []
    entered = asyncio.Event()

    async def handle(message: Job) -> None:
        handled.append(message.n)
        entered.set()
        await asyncio.Event().wait()  # busy until the stop cancels it

    transport = StopWatcher(memory_url, "lanes")
    app = App("lanes", transport=transport, concurrency=4, prefetch=count, grace_period=0.05)
    app.register(Job, handle)
    app.route(Job, "lanes")
    await app.start()
    try:
        broker = broker_of(app)
        async with app.transaction():
            for n in range(count):
                await app.send(Job(n), partition_key="one-key")
        await asyncio.wait_for(entered.wait(), 5)
        queue = broker.queues["lanes"]
        await eventually(
            lambda: queue.unacked == count, "every message waiting unacked in the lane", timeout=5
        )
    finally:
        await app.stop()

    assert transport.owed_at_stop == 0  # the worker returned every one before the transport
    assert handled == [0]
    assert queue.unacked == 0
    assert [number_of(envelope) for envelope in waiting(broker, "lanes")] == list(range(count))
    assert not [r for r in caplog.records if "already settled" in r.getMessage()]


# p19: the handler clock and the first message's context.


class Marker:
    """An object only a message's context holds (MessageContext itself takes no weakref)."""


async def test_the_handler_clock_keeps_no_message_context_alive(memory_url: str) -> None:
    markers: list[weakref.ref[Marker]] = []

    async def handle(message: Job, context: MessageContext) -> None:
        marker = Marker()
        context.items["marker"] = marker
        markers.append(weakref.ref(marker))

    app = App("clock", transport=memory_url, handler_timeout=1.0)
    app.register(Job, handle)
    app.route(Job, "clock")
    async with app:
        broker = broker_of(app)
        await app.send(Job(1))
        await eventually(
            lambda: len(markers) == 1 and settled(broker, "clock"),
            "the message handled and settled",
        )

        def collected() -> bool:
            gc.collect()
            return markers[0]() is None

        # The clock's watchdog is still running; it must not hold the first message's context.
        await eventually(collected, "the first message's context collected", timeout=2)
        assert app.running
