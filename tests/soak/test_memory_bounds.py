"""Nothing grows without bound: a soak, and the structures looked at directly.

The soak runs an App on a private memory broker: messages with distinct partition keys, sent in
batches and waited for, while short-lived consumers come and go on a side queue. Memory (RSS,
read from /proc/self/statm after a full collection) at the end must stay within a small margin
of memory after the first tenth of the messages, and the per-key and per-consumer structures
(the worker's lanes, the transport's consumers, the queues' waiters) must be back to what one
idle app needs. It runs at two sizes: `reduced` (30,000 messages, 300 consumers; `make test`)
and `full` (200,000 messages, 2,000 consumers; `make chaos`).

The other tests look at one structure each that a message, a key, a consumer or a hostile
producer could make grow: RabbitMQ's consumers, a RabbitMQ consumer's buffer, a memory queue's
waiters, the type registry and the codec's decoders, the reply waiters, the relay's failure
counts and the test harness's observers. The RabbitMQ ones look from outside: closed consumers
through weak references (nothing may still hold one) and the broker's own lists of channels and
consumers (`rabbitmqctl`), a consumer's buffer through the message bodies still in memory.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import tracemalloc
import types
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aio_pika
import pytest

from mersal import App, MessageContext, RetryPolicy
from mersal.errors import ConsumerClosed, RequestTimeout
from mersal.messages import Envelope, Header
from mersal.outbox import Relay
from mersal.testing import Harness
from mersal.transport import Consumer, Delivery, Outgoing
from mersal.transport.memory import MemoryQueue, MemoryTransport
from mersal_rabbitmq import RabbitMQTransport
from mersal_sqlalchemy import SqlOutboxStore, make_engine, make_tables
from mersal_sqlalchemy.outbox import write_outbox
from mersal_sqlalchemy.schema import prepare_schema
from tests.support import (
    RABBITMQ_HOST,
    DelegatingTransport,
    broker_channels,
    broker_consumers,
    eventually,
    rabbitmqctl,
)

PAGE = os.sysconf("SC_PAGE_SIZE")
MiB = 1024 * 1024
BATCH = 1_000
"""Messages sent before waiting for them to be handled."""


@dataclass(frozen=True)
class Size:
    """How long the soak runs and how much memory it may gain after its base point."""

    messages: int
    consumers: int
    base_at: int
    margin: int


REDUCED = Size(messages=30_000, consumers=300, base_at=3_000, margin=2 * MiB)
FULL = Size(messages=200_000, consumers=2_000, base_at=20_000, margin=4 * MiB)
SIZES = [
    pytest.param(REDUCED, id="reduced", marks=pytest.mark.timeout(90)),
    pytest.param(FULL, id="full", marks=[pytest.mark.chaos, pytest.mark.timeout(600)]),
]


@dataclass
class Tick:
    """The soak's message: small, one per partition key."""

    n: int


@dataclass
class Ask:
    """A request the responder answers (late, for odd n)."""

    n: int


@dataclass
class Answer:
    """The responder's reply."""

    n: int


def rss() -> int:
    """This process's resident memory in bytes, after a full garbage collection."""
    gc.collect()
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


class Tally:
    """Counts handled messages; `reached` is set once `target` of them were handled."""

    def __init__(self) -> None:
        self.handled = 0
        self.target = 0
        self.reached = asyncio.Event()

    def expect(self, target: int) -> None:
        """Wait (through `reached`) for `target` handled messages in all."""
        self.target = target
        self.reached.clear()
        if self.handled >= target:
            self.reached.set()

    def count(self) -> None:
        """One more message was handled."""
        self.handled += 1
        if self.handled >= self.target:
            self.reached.set()


def side_envelope(n: int) -> Envelope:
    """A message for the short-lived consumers' side queue."""
    return Envelope({Header.MESSAGE_ID: f"side-{n}"}, b"side")


class SideQueue:
    """The short-lived consumers of one memory queue, each ending in its own way."""

    def __init__(self, transport: MemoryTransport, name: str) -> None:
        self.transport = transport
        self.name = name
        self.opened = 0
        self.sent = 0

    @property
    def queue(self) -> MemoryQueue:
        """The broker's queue."""
        return self.transport.broker.queues[self.name]

    async def consume(self, prefetch: int = 2) -> Consumer:
        """A new consumer of the side queue (counted)."""
        self.opened += 1
        return await self.transport.consume(self.name, prefetch=prefetch)

    async def top_up(self, ready: int) -> None:
        """Send until `ready` messages wait in the side queue."""
        while len(self.queue) < ready:
            self.sent += 1
            await self.transport.send([Outgoing(self.name, side_envelope(self.sent))])

    async def close_while_waiting(self) -> None:
        """Open a consumer on the (empty) queue, close it while its get waits."""
        consumer = await self.consume()
        getting = asyncio.ensure_future(consumer.get())
        await asyncio.sleep(0)
        assert not getting.done(), "the side queue should be empty here"
        await consumer.close()
        with pytest.raises(ConsumerClosed):
            await getting

    async def take_and_leave(self, n: int) -> None:
        """Take two deliveries and settle them before or after closing, by `n`."""
        await self.top_up(2)
        consumer = await self.consume()
        first, second = await consumer.get(), await consumer.get()
        match n % 4:
            case 0:  # settled, then closed
                await first.ack()
                await second.ack()
                await consumer.close()
            case 1:  # one settled before the close, one after
                await first.ack()
                await consumer.close()
                await second.ack()
            case 2:  # both settled after the close, one given back
                await consumer.close()
                await first.nack(requeue=True)
                await second.ack()
            case _:  # both given back after the close
                await consumer.close()
                await second.nack(requeue=True)
                await first.nack(requeue=True)

    async def drain(self) -> None:
        """Take and ack whatever waits, so that the queue ends empty."""
        consumer = await self.consume(prefetch=10)
        while len(self.queue):
            await (await consumer.get()).ack()
        await consumer.close()

    async def cycle(self, consumers: int) -> None:
        """`consumers` short-lived consumers in all, the queue empty before and after."""
        waiting = max(1, consumers // 5)
        for _ in range(waiting):
            await self.close_while_waiting()
        for n in range(consumers - waiting - 1):
            await self.take_and_leave(n)
        await self.drain()


async def settled(app: App, queue: MemoryQueue) -> None:
    """Wait until the app handles nothing and nothing of its queue is ready or unacked."""
    await eventually(
        lambda: app.in_flight == 0 and not queue.ready and not queue.unacked,
        f"app {app.name!r} idle",
        timeout=30,
    )


@pytest.mark.parametrize("size", SIZES)
async def test_distinct_keys_and_short_lived_consumers_leave_memory_where_it_was(
    size: Size,
) -> None:
    batches, rest = divmod(size.messages, BATCH)
    per_batch, leftover = divmod(size.consumers, batches)
    assert rest == 0 and leftover == 0 and per_batch >= 3 and size.base_at % BATCH == 0
    tag = uuid.uuid4().hex[:10]
    app = App(
        f"soak-{tag}",
        transport=f"memory://soak-{tag}",
        retry=RetryPolicy(immediate=0, delayed=[]),
    )
    tally = Tally()

    async def tick(message: Tick) -> None:
        tally.count()

    app.register(Tick, tick)
    app.route(Tick, app.name)
    samples: list[tuple[int, int]] = []
    async with app:
        transport = app.transport
        assert isinstance(transport, MemoryTransport)
        side = SideQueue(transport, f"soak-side-{tag}")
        await transport.declare(side.name)
        home = transport.broker.queues[app.name]
        worker = app.worker
        assert worker is not None
        base = 0
        for batch in range(batches):
            first = batch * BATCH
            for n in range(first, first + BATCH):
                await app.send(Tick(n), partition_key=f"key-{n}")
            tally.expect(first + BATCH)
            async with asyncio.timeout(30):
                await tally.reached.wait()
            await side.cycle(per_batch)
            if first + BATCH == size.base_at:
                await settled(app, home)
                base = rss()
                samples.append((first + BATCH, base))
        await settled(app, home)
        end = rss()
        samples.append((size.messages, end))

        lanes, tasks = dict(worker._lanes), set(worker._tasks)
        consumers = list(transport._consumers)
        waiters = {name: len(queue.waiters) for name, queue in transport.broker.queues.items()}
        side_queue = side.queue
        assert (side_queue.consumers, side_queue.unacked, len(side_queue)) == (0, 0, 0)

    assert tally.handled == size.messages
    assert side.opened == size.consumers
    assert lanes == {}, f"{len(lanes)} lanes left, e.g. {next(iter(lanes))!r}"
    assert tasks == set()
    assert consumers == [worker.consumer], (
        f"the memory transport still holds {len(consumers)} consumers after "
        f"{size.consumers} short-lived ones closed"
    )
    assert all(count <= 1 for count in waiters.values()), waiters
    grown = end - base
    shown = ", ".join(f"{n:,}: {memory / MiB:.2f} MiB" for n, memory in samples)
    print(f"soak RSS after messages {shown}; grown {grown / MiB:.2f} MiB")  # shown with -s
    assert grown <= size.margin, f"RSS grew {grown / MiB:.2f} MiB after the base point ({shown})"


# RabbitMQ, seen from outside: what lets go of a closed consumer, what the broker counts.


async def ready_in(url: str, queue: str) -> int:
    """How many messages are ready in `queue` (a passive declare on a connection of its own)."""
    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        return int(declared.declaration_result.message_count or 0)


async def delete_queues(url: str, names: Sequence[str]) -> None:
    """Delete the test's queues (missing ones are fine)."""
    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel()
        for name in names:
            await channel.queue_delete(name)


class ShortLived:
    """Short-lived consumers of one RabbitMQ queue, each ending its own way, weakly remembered."""

    def __init__(self, transport: RabbitMQTransport, queue: str) -> None:
        self.transport = transport
        self.queue = queue
        self.sent = 0
        self.acked = 0
        self.closed: list[weakref.ref[Consumer]] = []

    async def send(self) -> None:
        """One more message for the queue."""
        self.sent += 1
        await self.transport.send([Outgoing(self.queue, side_envelope(self.sent))])

    async def one(self, n: int) -> None:
        """A consumer that ends in a way chosen by `n`."""
        consumer = await self.transport.consume(self.queue, prefetch=2)
        self.closed.append(weakref.ref(consumer))
        variant = n % 5
        if variant == 3:  # closed at once: whatever it buffered goes back
            await consumer.close()
            return
        if variant == 4:  # closed while its get waits (or after it took something)
            getting = asyncio.ensure_future(consumer.get())
            await asyncio.sleep(0.005)
            await consumer.close()
            try:
                delivery: Delivery = await getting
            except ConsumerClosed:
                return
            await delivery.nack(requeue=True)
            return
        await self.send()
        async with asyncio.timeout(10):
            delivery = await consumer.get()
        if variant == 0:  # settled, then closed
            await delivery.ack()
            await consumer.close()
            self.acked += 1
            return
        await consumer.close()
        if variant == 1:  # settled after the close
            await delivery.ack()
            self.acked += 1
            return
        await delivery.nack(requeue=True)  # given back after the close

    def kept(self) -> int:
        """How many of the closed consumers something still holds, after a full collection."""
        gc.collect()
        return sum(ref() is not None for ref in self.closed)

    async def released(self, nudge: str) -> bool:
        """Whether nothing holds a closed consumer; if something does, a publish to `nudge`.

        aiormq's reader keeps the channel it last read a frame for (a local of its loop) until
        it reads one for another channel, and a closed channel still holds its consumer's
        callbacks. The last consumer's channel may close after the test's last publish (a
        consumer settled after its close closes its channel in the background), its Close-Ok
        then the last frame read: a confirmed publish moves the reader on to the publishing
        channel. Only that is released so: a consumer that Mersal holds (the transport, the
        connection's registry, a task that never ends) stays.
        """
        if self.kept() == 0:
            return True
        await self.transport.send([Outgoing(nudge, side_envelope(0))])
        return self.kept() == 0

    def holders(self) -> str:
        """What holds the closed consumers still alive, a few referrers deep (for a failure)."""
        gc.collect()
        alive = [(n, ref()) for n, ref in enumerate(self.closed) if ref() is not None]
        lines = [f"{len(alive)} kept:"]
        ignored = {id(alive), id(self.closed), id(lines), *(id(pair) for pair in alive)}
        for n, consumer in alive[:3]:
            lines.append(f"consumer {n} (ending {n % 5}), held by:")
            lines += referrers(consumer, ignored | {id(sys._getframe())}, depth=5)
        del alive
        return "\n".join(lines)


def referrers(target: object, ignored: set[int], depth: int, width: int = 4) -> list[str]:
    """A tree of what refers to `target`, `depth` referrers deep (each object shown once)."""
    lines: list[str] = []
    seen = {id(target), id(lines)}  # and the lists of referrers found on the way down

    def walk(item: object, level: int) -> None:
        if level > depth or len(lines) >= 80:
            return
        found = gc.get_referrers(item)
        seen.add(id(found))
        skipped = ignored | seen
        found = [holder for holder in found if id(holder) not in skipped]
        seen.add(id(found))
        for index in range(min(width, len(found))):
            seen.add(id(found[index]))
            lines.append(f"{'  ' * level}<- {shown(found[index])}")
            if not isinstance(found[index], types.ModuleType):
                walk(found[index], level + 1)
        if len(found) > width:
            lines.append(f"{'  ' * level}<- ... {len(found) - width} more")

    walk(target, 1)
    return lines


def shown(item: object) -> str:
    """An object of a referrer tree, briefly."""
    if isinstance(item, types.FrameType | types.CoroutineType):
        code = item.f_code if isinstance(item, types.FrameType) else item.cr_code
        return f"{type(item).__name__} {code.co_qualname} ({code.co_filename})"
    if isinstance(item, types.MethodType):
        return f"method {item.__func__.__qualname__}"
    if isinstance(item, dict | list | set | tuple):
        return f"{type(item).__name__} of {len(item)}"
    try:
        return f"{type(item).__name__} {repr(item)[:120]}"
    except Exception:  # some break while half torn down (aio-pika's OneShotCallback)
        return type(item).__name__


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_rabbitmq_lets_go_of_short_lived_consumers_and_closes_their_channels(
    vhost: str,
) -> None:
    url = f"amqp://guest:guest@{RABBITMQ_HOST}/{vhost}"
    tag = uuid.uuid4().hex[:10]
    home, queue = f"soak-home-{tag}", f"soak-side-{tag}"
    name = f"soak-{tag}"  # the connection's name, as the broker lists it
    transport = RabbitMQTransport(f"{url}?name={name}")
    await transport.start()
    try:
        await transport.declare(home)
        await transport.declare(queue)
        await transport.consume(home, prefetch=10)
        await transport.send([Outgoing(home, side_envelope(0))])  # opens a publisher
        channels_before = await asyncio.to_thread(broker_channels, name)
        side = ShortLived(transport, queue)
        for n in range(200):
            await side.one(n)
        try:
            await eventually(
                lambda: side.released(nudge=home),
                "nothing holds a closed consumer (not the transport, its connection or channels)",
                timeout=10,
                interval=0.05,
            )
        except AssertionError as error:
            raise AssertionError(f"{error}\n{side.holders()}") from None
        consumers = await asyncio.to_thread(broker_consumers, vhost)
        assert (consumers[home], consumers[queue]) == (1, 0), consumers

        # A closed consumer's channel closes once its last delivery is settled.
        async def channels_closed() -> bool:
            open_now = await asyncio.to_thread(broker_channels, name)
            return open_now <= channels_before + transport.channels

        await eventually(
            channels_closed,
            f"at most {channels_before} + {transport.channels} channels open",
            timeout=10,
            interval=0.2,
        )

        async def nothing_lost() -> bool:
            return await ready_in(url, queue) == side.sent - side.acked

        await eventually(nothing_lost, "every message not acked is back in its queue", timeout=10)
    finally:
        await transport.stop()
        await delete_queues(url, [home, queue])


async def test_consumers_closed_while_waiting_on_an_idle_memory_queue_leave_no_waiters() -> None:
    transport = MemoryTransport(f"memory://soak-{uuid.uuid4().hex}")
    await transport.start()
    await transport.declare("idle")
    live = await transport.consume("idle", prefetch=10)
    live_get = asyncio.ensure_future(live.get())
    await asyncio.sleep(0)
    side = SideQueue(transport, "idle")
    try:
        for _ in range(2_000):
            await side.close_while_waiting()
        waiters = len(side.queue.waiters)
        assert list(transport._consumers) == [live]
    finally:
        live_get.cancel()
        await transport.stop()
    assert waiters <= 1, f"{waiters} waiters on a queue with one consumer waiting"


async def test_an_app_restarted_on_an_idle_memory_queue_leaves_no_waiters() -> None:
    url = f"memory://soak-{uuid.uuid4().hex}"
    name = f"idle-{uuid.uuid4().hex[:8]}"
    for _ in range(500):  # the worker's stop cancels its get(), whose waiter stays
        async with App(name, transport=url):
            await asyncio.sleep(0)
    transport = MemoryTransport(url)
    waiters = len(transport.broker.queues[name].waiters)
    assert waiters <= 1, f"{waiters} waiters on a queue nobody consumes any more"


LOST_BODY = 100_000
"""The size of each message the lost-channel test buffers: large enough to see in memory."""
LOSSES = 5
"""How many channels the lost-channel test loses."""


@pytest.mark.integration
@pytest.mark.timeout(90)
async def test_a_rabbitmq_consumer_keeps_nothing_from_the_channels_it_lost(
    vhost: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mersal.rabbitmq")
    url = f"amqp://guest:guest@{RABBITMQ_HOST}/{vhost}"
    queue = f"soak-lost-{uuid.uuid4().hex[:10]}"
    transport = RabbitMQTransport(url)
    await transport.start()
    try:
        await transport.declare(queue)
        consumer = await transport.consume(queue, prefetch=5)
        body = b"x" * LOST_BODY
        await transport.send(
            [Outgoing(queue, Envelope({Header.MESSAGE_ID: f"lost-{n}"}, body)) for n in range(5)]
        )

        async def five_delivered() -> bool:
            return await ready_in(url, queue) == 0  # a prefetch of 5: all on its channel

        def consuming_again() -> int:
            return sum(f"consuming {queue!r} again" in r.getMessage() for r in caplog.records)

        async def lose_the_channel() -> None:
            """Lose the channel of all five, untaken (with the connection: both come back)."""
            await eventually(five_delivered, "all five delivered to the consumer", timeout=10)
            before = consuming_again()
            await asyncio.to_thread(rabbitmqctl, "close_all_connections", "-p", vhost, "soak")
            await eventually(
                lambda: consuming_again() > before, "consuming again on a new channel", timeout=10
            )

        tracemalloc.start()
        try:
            for _ in range(LOSSES):
                await lose_the_channel()
            await eventually(five_delivered, "all five delivered once more", timeout=10)
            gc.collect()
            snapshot = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        # the blocks of a body's size allocated since (the logs keep small things: tracebacks)
        bodies = sum(trace.size >= LOST_BODY for trace in snapshot.traces)
        held = [await asyncio.wait_for(consumer.get(), 10) for _ in range(5)]
        for delivery in held:
            await delivery.ack()
        await consumer.close()
    finally:
        await transport.stop()
        await delete_queues(url, [queue])
    assert {delivery.envelope.message_id for delivery in held} == {f"lost-{n}" for n in range(5)}
    # The five buffered now, and as many again to spare (a read buffer); kept, the five of each
    # lost channel would add 5 * LOSSES more.
    assert bodies <= 10, f"{bodies} bodies held after {LOSSES} lost channels: theirs are kept"


async def test_hostile_type_names_leave_nothing_in_the_registry_or_the_codec() -> None:
    tag = uuid.uuid4().hex[:10]
    app = App(f"types-{tag}", transport=f"memory://soak-{tag}", retry=RetryPolicy(immediate=0))
    tally = Tally()

    async def tick(message: Tick) -> None:
        tally.count()

    app.register(Tick, tick)
    async with app:
        transport = app.transport
        assert isinstance(transport, MemoryTransport)
        broker = transport.broker
        tally.expect(1)
        await app.send_local(Tick(0))
        async with asyncio.timeout(5):
            await tally.reached.wait()
        codec = app.codec
        assert isinstance(codec.__dict__.get("_decoders"), dict)

        def sizes() -> tuple[int, ...]:
            return (
                len(app.types._by_name),
                len(app.types._by_type),
                len(app.handlers._by_type),
                len(codec.__dict__["_decoders"]),
            )

        before = sizes()
        for n in range(2_000):  # as a hostile producer: straight onto the queue
            name = f"{__name__}.Tick{n}" if n % 2 else f"hostile.{uuid.uuid4().hex}.v{n}"
            headers = {Header.TYPE: name, Header.MESSAGE_ID: f"hostile-{n}"}
            broker.route(Outgoing(app.name, Envelope(headers, b'{"n": 1}')))
        errors = broker.queues[app.retry.error_queue]
        await eventually(lambda: len(errors) == 2_000, "2,000 dead letters", timeout=20)
        after = sizes()
    assert after == before


async def test_requests_answered_late_or_never_leave_no_reply_waiters() -> None:
    url = f"memory://soak-{uuid.uuid4().hex}"
    tag = uuid.uuid4().hex[:8]
    requester = App(f"asker-{tag}", transport=url)
    responder = App(f"answerer-{tag}", transport=url, concurrency=128)  # none waits for a slot
    answered = Tally()

    async def answer(message: Ask, context: MessageContext) -> None:
        if message.n % 2:
            await asyncio.sleep(0.3)  # after the requester gave up
        await responder.reply(Answer(message.n))
        answered.count()

    responder.register(Ask, answer)
    requester.route(Ask, responder.name)
    requester.types.add(Answer)
    async with responder, requester:

        async def ask(n: int) -> object:
            try:
                return await requester.request(Ask(n), timeout=0.1, reply_type=Answer)
            except RequestTimeout:
                return None

        results = await asyncio.gather(*(ask(n) for n in range(100)))
        answered.expect(100)
        async with asyncio.timeout(5):
            await answered.reached.wait()
        replies = requester._requests.replies
        assert replies is not None
        transport = requester.transport
        assert isinstance(transport, MemoryTransport)
        reply_queue = transport.broker.queues[replies.queue]
        await eventually(lambda: reply_queue.idle, "the late replies were taken and dropped")
        waiting = dict(replies.waiting)
    assert [r for r in results if r is not None] == [Answer(n) for n in range(0, 100, 2)]
    assert waiting == {}


class GlitchyTransport(DelegatingTransport):
    """Every send fails with an error nobody classified (not a MersalError)."""

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        """Report a glitch for every message."""
        return [RuntimeError("a glitch nobody classified") for _ in messages]


async def test_the_relay_forgets_failure_counts_of_rows_that_left_some_other_way(
    tmp_path: Path,
) -> None:
    database = f"sqlite+aiosqlite:///{tmp_path / 'outbox.db'}"
    engine = make_engine(database)
    tables = make_tables()
    try:
        await prepare_schema(engine, tables, database, create=True)
        rows = [
            Outgoing("sink", Envelope({Header.MESSAGE_ID: f"row-{n}"}, b"{}")) for n in range(200)
        ]
        async with engine.begin() as connection:
            await write_outbox(connection, tables.outbox, "orders", rows, None)
        store = SqlOutboxStore(engine, tables.outbox, "orders")
        transport = GlitchyTransport(MemoryTransport(f"memory://soak-{uuid.uuid4().hex}"))
        relay = Relay(store, transport, batch=500)
        with pytest.raises(RuntimeError):
            await relay.flush()
        assert len(relay._failures) == 200  # each row failed once and was released
        async with engine.begin() as connection:  # another relay sent them, or a purge
            await connection.execute(tables.outbox.delete())
        assert await relay.flush() == 0
        remembered = len(relay._failures)
    finally:
        await engine.dispose()
    assert remembered == 0, f"the relay remembers failures of {remembered} rows that are gone"


async def test_a_harness_started_again_records_each_message_once() -> None:
    app = App(f"again-{uuid.uuid4().hex[:8]}")

    async def tick(message: Tick) -> None:
        pass

    app.register(Tick, tick)
    app.route(Tick, app.name)
    bus = Harness(app)
    for n in range(3):
        async with bus:
            await app.send(Tick(n))
            await bus.idle()
    assert bus.sent_of(Tick) == [Tick(0), Tick(1), Tick(2)]
    assert bus.broker.observers == []  # a stopped harness records nothing more
