"""The worker: concurrency limit, per-key ordering, graceful stop and the grace period."""

import asyncio
import json
import logging
import random
import time
import uuid
from dataclasses import dataclass

import pytest

from mersal import (
    App,
    Delivery,
    Envelope,
    Header,
    MessageContext,
    OutcomeUnknown,
    RetryPolicy,
)
from mersal.testing import Harness
from mersal.transport import Consumer
from mersal.transport.memory import MemoryTransport
from tests.mersal.support import (
    ERROR_QUEUE,
    RefusingErrorQueue,
    broker_of,
    in_queue,
    number_of,
    settled,
)
from tests.support import DelegatingTransport, eventually


@dataclass
class Job:
    n: int


@dataclass
class Keyed:
    key: str
    n: int


@dataclass
class Finished:
    n: int


async def test_at_most_and_exactly_concurrency_messages_run_at_once() -> None:
    running = 0
    peak = 0
    handled: list[int] = []
    four_running = asyncio.Event()
    release = asyncio.Event()

    async def handle(message: Job) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        if running == 4:
            four_running.set()
        try:
            await release.wait()
        finally:
            running -= 1
        handled.append(message.n)

    app = App("jobs", concurrency=4)
    app.register(Job, handle)
    async with Harness(app) as bus:
        for n in range(10):
            await app.send_local(Job(n))
        async with asyncio.timeout(2):
            await four_running.wait()
        assert running == 4
        assert app.in_flight == 4
        # The other six wait in the queue, not in the worker.
        assert len(bus.broker.queues["jobs"]) == 6
        release.set()
        await bus.idle()

    assert peak == 4
    assert sorted(handled) == list(range(10))


async def test_messages_of_one_partition_key_run_in_order_and_keys_interleave() -> None:
    keys = ["alpha", "beta", "gamma"]
    started: dict[str, list[int]] = {key: [] for key in keys}
    finished: dict[str, list[int]] = {key: [] for key in keys}
    active: dict[str, int] = {key: 0 for key in keys}
    overlaps: set[frozenset[str]] = set()

    async def handle(message: Keyed) -> None:
        active[message.key] += 1
        assert active[message.key] == 1, "two messages of one key ran at once"
        started[message.key].append(message.n)
        others = {key for key, count in active.items() if count and key != message.key}
        overlaps.update(frozenset({message.key, other}) for other in others)
        await asyncio.sleep(random.random() / 500)  # the workload
        finished[message.key].append(message.n)
        active[message.key] -= 1

    app = App("lanes", concurrency=8)
    app.register(Keyed, handle)
    async with Harness(app) as bus:
        for n in range(20):
            for key in keys:
                await app.send_local(Keyed(key, n), partition_key=key)
        await bus.idle(timeout=10)

    for key in keys:
        assert started[key] == list(range(20)), key
        assert finished[key] == list(range(20)), key
    assert overlaps, "no two keys were ever handled at the same time"
    assert bus.dead_lettered == []


async def test_messages_without_a_key_run_concurrently() -> None:
    both_running = asyncio.Event()
    running = 0

    async def handle(message: Job) -> None:
        nonlocal running
        running += 1
        if running == 2:
            both_running.set()
        async with asyncio.timeout(2):
            await both_running.wait()
        running -= 1

    app = App("jobs", concurrency=4)
    app.register(Job, handle)
    async with Harness(app) as bus:
        await app.send_local(Job(1))
        await app.send_local(Job(2))
        await bus.idle()

    assert both_running.is_set()
    assert bus.dead_lettered == []


async def test_an_immediate_retry_keeps_the_order_of_its_partition_key() -> None:
    handled: list[tuple[int, int]] = []

    async def handle(message: Keyed, context: MessageContext) -> None:
        handled.append((message.n, context.attempt))
        if message.n == 0 and context.attempt == 1:
            raise RuntimeError("transient")

    app = App("lanes", retry=RetryPolicy(immediate=1, delayed=[]))
    app.register(Keyed, handle)
    async with Harness(app) as bus:
        for n in range(3):
            await app.send_local(Keyed("k", n), partition_key="k")
        await bus.idle()

    assert handled == [(0, 1), (0, 2), (1, 1), (2, 1)]
    assert bus.dead_lettered == []


async def test_a_slow_partition_key_does_not_starve_other_keys() -> None:
    release = asyncio.Event()
    handled: list[tuple[str, int]] = []

    async def handle(message: Keyed) -> None:
        if message.key == "hot":
            await release.wait()
        handled.append((message.key, message.n))

    app = App("lanes", concurrency=4, grace_period=0.5)
    app.register(Keyed, handle)
    async with Harness(app) as bus:
        for n in range(5):
            await app.send_local(Keyed("hot", n), partition_key="hot")
        await app.send_local(Keyed("other", 0), partition_key="other")
        try:
            # Only one "hot" message runs; three slots are free for the "other" key.
            await eventually(
                lambda: handled == [("other", 0)],
                "the other key's message handled while the hot key's first one runs",
                timeout=1,
            )
        finally:
            release.set()
            await bus.idle()

    assert handled == [("other", 0), *(("hot", n) for n in range(5))]
    assert bus.dead_lettered == []


async def test_stop_lets_in_flight_messages_finish_and_acks_them(memory_url: str) -> None:
    started = asyncio.Event()
    release = asyncio.Event()
    finished: list[int] = []

    async def handle(message: Job) -> None:
        started.set()
        await release.wait()
        finished.append(message.n)

    app = App("jobs", transport=memory_url, concurrency=2)
    app.register(Job, handle)
    await app.start()
    await app.send_local(Job(1))
    await app.send_local(Job(2))
    async with asyncio.timeout(2):
        await started.wait()
    await eventually(lambda: app.in_flight == 2, "two messages in flight")

    queue = app.transport.broker.queues["jobs"]  # type: ignore[attr-defined]
    stopping = asyncio.create_task(app.stop())
    await eventually(lambda: queue.consumers == 0, "stop() has begun: no more fetching")
    assert not stopping.done()  # stop() waits for the two in-flight messages
    release.set()
    async with asyncio.timeout(2):
        await stopping

    assert sorted(finished) == [1, 2]
    assert not app.running
    assert len(queue) == 0
    assert queue.unacked == 0


async def test_a_handler_finishing_during_stop_can_still_send(memory_url: str) -> None:
    started = asyncio.Event()
    release = asyncio.Event()
    errors: list[BaseException] = []

    async def handle(message: Job, context: MessageContext) -> None:
        started.set()
        await release.wait()
        try:
            await context.app.send(Finished(message.n))
        except Exception as error:
            errors.append(error)
            raise

    app = App(
        "jobs", transport=memory_url, retry=RetryPolicy(immediate=0, delayed=[], error_queue="e")
    )
    app.route(Finished, "finished")
    app.register(Job, handle)
    await app.start()
    await app.transport.declare("finished")
    await app.send_local(Job(1))
    async with asyncio.timeout(2):
        await started.wait()
    queue = app.transport.broker.queues["jobs"]  # type: ignore[attr-defined]
    stopping = asyncio.create_task(app.stop())
    await eventually(lambda: queue.consumers == 0, "stop() has begun: no more fetching")
    assert not stopping.done()
    release.set()
    async with asyncio.timeout(2):
        await stopping

    broker = app.transport.broker  # type: ignore[attr-defined]
    assert errors == []
    assert len(broker.queues["finished"]) == 1
    assert len(broker.queues["e"]) == 0
    assert (len(queue), queue.unacked) == (0, 0)  # the job itself was acked


async def test_stop_returns_a_message_that_outlives_the_grace_period(memory_url: str) -> None:
    started = asyncio.Event()
    cancelled: list[int] = []

    async def never_finishes(message: Job) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(message.n)
            raise

    first = App("jobs", transport=memory_url, grace_period=0.2)
    first.register(Job, never_finishes)
    await first.start()
    message_id = await first.send_local(Job(7))
    async with asyncio.timeout(2):
        await started.wait()

    began = time.monotonic()
    async with asyncio.timeout(2):
        await first.stop()
    took = time.monotonic() - began
    assert 0.15 <= took < 1.0
    assert cancelled == [7]

    redelivered: asyncio.Future[tuple[Job, str, bool]] = asyncio.get_running_loop().create_future()

    async def handle(message: Job, context: MessageContext) -> None:
        redelivered.set_result((message, context.message_id, context.delivery.redelivered))

    second = App("jobs", transport=memory_url)
    second.register(Job, handle)
    async with second:
        async with asyncio.timeout(2):
            got = await redelivered
        await eventually(lambda: second.in_flight == 0, "the redelivered message settled")

    assert got == (Job(7), message_id, True)
    queue = second.transport.broker.queues["jobs"]  # type: ignore[attr-defined]
    assert len(queue) == 0
    assert queue.unacked == 0


async def test_a_partition_key_keeps_its_order_across_a_graceful_stop(memory_url: str) -> None:
    started = asyncio.Event()
    release = asyncio.Event()
    first_handled: list[int] = []

    async def blocked(message: Keyed) -> None:
        first_handled.append(message.n)
        started.set()
        await release.wait()

    first = App("lanes", transport=memory_url, concurrency=4)
    first.register(Keyed, blocked)
    await first.start()
    for n in range(8):
        await first.send_local(Keyed("k", n), partition_key="k")
    async with asyncio.timeout(2):
        await started.wait()
    # Message 0 runs; 1-7 wait in its lane (lane entries take no slot; prefetch is 2 x 4).
    await eventually(
        lambda: first.in_flight == 8, "the running message and the seven in its lane in flight"
    )
    queue = first.transport.broker.queues["lanes"]  # type: ignore[attr-defined]
    stopping = asyncio.create_task(first.stop())
    await eventually(lambda: queue.consumers == 0, "stop() has begun: no more fetching")
    release.set()
    async with asyncio.timeout(2):
        await stopping
    assert first_handled == [0]

    second_handled: list[int] = []

    async def record(message: Keyed) -> None:
        second_handled.append(message.n)

    second = App("lanes", transport=memory_url, concurrency=4)
    second.register(Keyed, record)
    async with second:
        await eventually(lambda: len(second_handled) == 7, "the seven returned messages handled")

    assert second_handled == [1, 2, 3, 4, 5, 6, 7]


async def test_in_flight_counts_the_messages_a_stop_is_draining(memory_url: str) -> None:
    release = asyncio.Event()

    async def handle(message: Job) -> None:
        await release.wait()

    app = App("jobs", transport=memory_url, concurrency=2)
    app.register(Job, handle)
    await app.start()
    await app.send_local(Job(1))
    await app.send_local(Job(2))
    await eventually(lambda: app.in_flight == 2, "two messages in flight")
    queue = app.transport.broker.queues["jobs"]  # type: ignore[attr-defined]
    stopping = asyncio.create_task(app.stop())
    try:
        await eventually(lambda: queue.consumers == 0, "stop() has begun")
        assert not stopping.done()
        assert app.in_flight == 2
    finally:
        release.set()
        async with asyncio.timeout(2):
            await stopping


async def test_a_worker_that_loses_its_consumer_reports_it(
    memory_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = App("lost", transport=memory_url)
    app.register(Job, _ignore)
    async with app:
        assert app.healthy
        queue = app.transport.broker.queues["lost"]  # type: ignore[attr-defined]
        assert queue.consumers == 1
        await app._worker.consumer.close()  # type: ignore[union-attr]  # as if the broker lost it
        await eventually(lambda: not app.healthy, "the app reports itself unhealthy")

    failures = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("stopped receiving" in r.getMessage() for r in failures)


async def _ignore(message: Job) -> None:
    return None


class DeclaresForever(DelegatingTransport):
    """A transport whose declarations never end (a broker that stopped answering)."""

    def __init__(self) -> None:
        super().__init__(MemoryTransport(f"memory://declares-forever-{uuid.uuid4().hex}"))
        self.declaring = asyncio.Event()
        self.stopped = False

    async def declare(self, queue: str, *, temporary: bool = False) -> None:
        self.declaring.set()
        await asyncio.Event().wait()

    async def stop(self) -> None:
        self.stopped = True
        await self.inner.stop()


async def test_a_stop_during_start_ends_the_start_and_leaves_the_app_stopped() -> None:
    transport = DeclaresForever()
    app = App("declares-forever", transport=transport)
    starting = asyncio.create_task(app.start())
    await asyncio.wait_for(transport.declaring.wait(), 5)

    await asyncio.wait_for(app.stop(), 5)

    with pytest.raises(asyncio.CancelledError):
        await starting
    assert not app.running
    assert transport.stopped


@dataclass
class PlainDelivery:
    """A transport's delivery written as a plain dataclass: equal by value, not hashable."""

    inner: Delivery
    envelope: Envelope
    queue: str
    redelivered: bool

    async def ack(self) -> None:
        """Ack the delivery underneath."""
        await self.inner.ack()

    async def nack(self, requeue: bool = True) -> None:
        """Nack the delivery underneath."""
        await self.inner.nack(requeue)


class PlainConsumer:
    """A consumer handing out `PlainDelivery`s."""

    def __init__(self, inner: Consumer) -> None:
        self.inner = inner

    async def get(self) -> Delivery:
        """The next delivery, as a dataclass."""
        got = await self.inner.get()
        return PlainDelivery(got, got.envelope, got.queue, got.redelivered)

    async def close(self) -> None:
        """Stop receiving."""
        await self.inner.close()


class PlainTransport(DelegatingTransport):
    """A memory transport whose deliveries are plain dataclasses."""

    async def consume(self, queue: str, *, prefetch: int) -> Consumer:
        """Consume through `PlainConsumer`."""
        return PlainConsumer(await self.inner.consume(queue, prefetch=prefetch))


async def test_deliveries_that_are_not_hashable_are_handled() -> None:
    handled: list[int] = []

    async def handle(message: Job) -> None:
        handled.append(message.n)

    app = App("jobs", transport=PlainTransport(MemoryTransport(f"memory://{uuid.uuid4().hex}")))
    app.register(Job, handle)
    async with app:
        await app.send_local(Job(1))
        await app.send_local(Job(2))
        await eventually(lambda: sorted(handled) == [1, 2], "both jobs handled")
        await eventually(lambda: app.in_flight == 0, "nothing in flight")


POLICY = RetryPolicy(immediate=1, delayed=[0.05], error_queue="error")
"""Two attempts in a row, one delayed attempt, then the error queue: three handler calls."""


# A stop past the grace period, and one busy partition key holding back no other.


async def test_stopping_past_the_grace_period_returns_the_message_without_counting_it() -> None:
    started = asyncio.Event()
    calls: list[int] = []

    async def handle(message: Job) -> None:
        calls.append(message.n)
        started.set()
        await asyncio.Event().wait()

    app = App("stopping", retry=POLICY, grace_period=0.1)
    app.register(Job, handle)
    bus = Harness(app)
    await bus.start()
    try:
        message_id = await app.send_local(Job(1))
        async with asyncio.timeout(2):
            await started.wait()
    finally:
        began = time.monotonic()
        await bus.stop()
    assert time.monotonic() - began < 2.0

    queue = bus.broker.queues["stopping"]
    assert queue.unacked == 0
    [back] = in_queue(bus.broker, "stopping")
    assert back.message_id == message_id
    assert Header.ATTEMPT not in back.headers  # the cut-off attempt did not count
    assert calls == [1]
    assert bus.retried == []
    assert bus.dead_lettered == []
    assert in_queue(bus.broker, "error") == []


async def test_a_hot_keys_backlog_does_not_hold_back_other_keys_and_keeps_its_order() -> None:
    hot: list[int] = []
    others: list[int] = []
    began = 0.0
    others_done = asyncio.Event()

    async def handle(message: Job, context: MessageContext) -> None:
        await asyncio.sleep(0.05)
        if context.envelope.partition_key == "hot":
            hot.append(message.n)
            return
        others.append(message.n)
        if len(others) == 200:
            others_done.set()

    app = App("fair", concurrency=32, retry=POLICY, grace_period=1.0)
    app.register(Job, handle)
    async with Harness(app) as bus:
        began = time.monotonic()
        for n in range(200):
            await app.send_local(Job(n), partition_key="hot")
        for n in range(200):
            await app.send_local(Job(n), partition_key=f"key-{n}")
        async with asyncio.timeout(15):
            await others_done.wait()
        took = time.monotonic() - began

    assert took < 2.0, f"the other keys took {took:.2f}s behind the hot key"
    assert sorted(others) == list(range(200))
    assert hot == list(range(len(hot)))
    queue = bus.broker.queues["fair"]
    assert queue.unacked == 0
    # What the stop returned of the hot key waits in order, behind what was handled.
    left = [json.loads(e.body)["n"] for e in in_queue(bus.broker, "fair")]
    assert left == list(range(len(hot), 200))


FAIL_FAST = RetryPolicy(immediate=0, delayed=[], error_queue=ERROR_QUEUE)
"""One attempt, then the error queue."""


class Broken(Exception):
    """A handler failure on purpose."""


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


# A key's lane behind a dead letter that could not leave, handlers that ignore cancellation,
# and a stop with a long lane.


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
    assert [number_of(e) for e in in_queue(broker, ERROR_QUEUE)] == [1]


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
    assert [number_of(envelope) for envelope in in_queue(broker, "lanes")] == list(range(count))
    assert not [r for r in caplog.records if "already settled" in r.getMessage()]
