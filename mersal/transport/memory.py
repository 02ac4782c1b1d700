"""An in-process broker with the semantics of RabbitMQ: queues, topics, acks, delays."""

from __future__ import annotations

import asyncio
import bisect
import weakref
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from mersal.errors import ConsumerClosed, MersalError, Unroutable, Unsendable
from mersal.inspection import QueueReport, QueueStatus
from mersal.messages import Envelope
from mersal.transport import Outgoing, delay_of, first_failure
from mersal.transport.limits import DEFAULT_LIMITS, Limits, problem_of


@dataclass(slots=True)
class _Stored:
    envelope: Envelope
    seq: int
    redelivered: bool = False


@dataclass
class MemoryQueue:
    """One queue: ready messages in order and the consumers waiting for them."""

    name: str
    ready: deque[_Stored] = field(default_factory=deque)
    waiters: dict[asyncio.Future[None], None] = field(default_factory=dict)
    """The consumers' `get`s waiting for a message, in the order they began to wait."""
    unacked: int = 0
    consumers: int = 0
    _sequence: int = 0

    def put(self, envelope: Envelope) -> None:
        """Append a message and wake the consumers waiting for one."""
        self._sequence += 1
        self.ready.append(_Stored(envelope, self._sequence))
        self._wake()

    def requeue(self, stored: _Stored) -> None:
        """Return a message to its original place in the queue, marked redelivered."""
        stored.redelivered = True
        bisect.insort(self.ready, stored, key=_sequence_of)
        self._wake()

    def _wake(self) -> None:
        waiters, self.waiters = self.waiters, {}
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def __len__(self) -> int:
        return len(self.ready)

    @property
    def idle(self) -> bool:
        """Nothing unacknowledged, and nothing ready unless nobody consumes the queue."""
        return not self.unacked and not (self.ready and self.consumers)


def _sequence_of(stored: _Stored) -> int:
    return stored.seq


class MemoryBroker:
    """Queues and topic bindings shared by every memory transport of one name in one loop."""

    def __init__(self) -> None:
        self.queues: dict[str, MemoryQueue] = {}
        self.bindings: dict[str, list[str]] = {}
        self.delayed = 0
        self.observers: list[Callable[[Outgoing], None]] = []
        self._later: dict[asyncio.TimerHandle, tuple[str, Envelope]] = {}

    def declare(self, name: str) -> MemoryQueue:
        """The queue of that name, created if missing."""
        queue = self.queues.get(name)
        if queue is None:
            queue = self.queues[name] = MemoryQueue(name)
        return queue

    def delete(self, name: str) -> None:
        """Remove a queue and its bindings."""
        self.queues.pop(name, None)
        for queues in self.bindings.values():
            if name in queues:
                queues.remove(name)

    @property
    def idle(self) -> bool:
        """No consumed queue holds a message, none is unacked and none waits for its time."""
        return not self.delayed and all(queue.idle for queue in self.queues.values())

    def bind(self, queue: str, topic: str) -> None:
        """Deliver what is published on `topic` to `queue` as well."""
        if queue not in self.queues:
            raise Unroutable(f"no queue named {queue!r} to bind to {topic!r}: declare it first")
        queues = self.bindings.setdefault(topic, [])
        if queue not in queues:
            queues.append(queue)

    def prune(self, queue: str, topics: Collection[str]) -> None:
        """Stop delivering to `queue` what is published on any topic not in `topics`."""
        for topic, queues in self.bindings.items():
            if topic not in topics and queue in queues:
                queues.remove(queue)

    def route(self, outgoing: Outgoing) -> None:
        """Put one message on its queue, or on every queue bound to its topic."""
        if outgoing.publish:
            targets = [self.queues[name] for name in self.bindings.get(outgoing.address, ())]
        else:
            queue = self.queues.get(outgoing.address)
            if queue is None:
                raise Unroutable(
                    f"no queue named {outgoing.address!r}: start the app that owns it, "
                    "or check the route"
                )
            targets = [queue]
        for observe in self.observers:
            observe(outgoing)
        for target in targets:
            self._enqueue(target, outgoing.envelope.copy())

    def _enqueue(self, queue: MemoryQueue, envelope: Envelope) -> None:
        delay = delay_of(envelope)
        if delay <= 0:
            queue.put(envelope)
            return
        self.delayed += 1
        handle: asyncio.TimerHandle | None = None

        def due() -> None:
            assert handle is not None
            self._deliver_later(handle)

        handle = asyncio.get_running_loop().call_later(delay, due)
        self._later[handle] = (queue.name, envelope)

    def waiting(self) -> list[tuple[str, Envelope, float]]:
        """What waits for its time: queue, message and seconds until it is due, soonest first."""
        now = asyncio.get_running_loop().time()
        later = sorted(self._later.items(), key=lambda item: item[0].when())
        return [(queue, envelope, handle.when() - now) for handle, (queue, envelope) in later]

    def deliver_delayed(self, within: float | None = None) -> int:
        """Deliver now what waits to be delivered within `within` seconds (None: everything).

        Returns how many messages were delivered early.
        """
        horizon = None if within is None else asyncio.get_running_loop().time() + within
        due = [h for h in self._later if horizon is None or h.when() <= horizon]
        for handle in sorted(due, key=lambda h: h.when()):
            handle.cancel()
            self._deliver_later(handle)
        return len(due)

    def _deliver_later(self, handle: asyncio.TimerHandle) -> None:
        later = self._later.pop(handle, None)
        if later is None:
            return
        self.delayed -= 1
        name, envelope = later
        queue = self.queues.get(name)
        if queue is not None:
            queue.put(envelope)


_brokers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, MemoryBroker]] = (
    weakref.WeakKeyDictionary()
)


def broker_named(name: str) -> MemoryBroker:
    """The broker of this name in the running event loop (apps in one loop share it)."""
    brokers = _brokers.setdefault(asyncio.get_running_loop(), {})
    broker = brokers.get(name)
    if broker is None:
        broker = brokers[name] = MemoryBroker()
    return broker


class MemoryDelivery:
    """A message handed to a memory consumer, awaiting its ack or nack."""

    __slots__ = ("_consumer", "_settled", "_stored", "envelope", "queue", "redelivered")

    def __init__(self, consumer: MemoryConsumer, stored: _Stored) -> None:
        self._consumer = consumer
        self._stored = stored
        self._settled = False
        self.envelope = stored.envelope.copy()
        self.queue = consumer.queue.name
        self.redelivered = stored.redelivered

    async def ack(self) -> None:
        """Remove the message for good."""
        self._settle()

    async def nack(self, requeue: bool = True) -> None:
        """Put the message back at the head of its queue, marked redelivered."""
        self._settle()
        if requeue:
            self._consumer.queue.requeue(self._stored)

    def _settle(self) -> None:
        if self._settled:
            raise MersalError(
                f"delivery {self.envelope.message_id} was already settled (acked, nacked, or "
                "returned when its transport stopped)"
            )
        self._settled = True
        self._consumer.release(self)


class MemoryConsumer:
    """Takes messages from one queue, at most `prefetch` unacknowledged."""

    def __init__(
        self,
        queue: MemoryQueue,
        prefetch: int,
        on_done: Callable[[MemoryConsumer], None] | None = None,
    ) -> None:
        self.queue = queue
        self.prefetch = max(1, prefetch)
        self.unacked = 0
        self._closed = False
        self._room: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._on_done = on_done
        self.outstanding: dict[MemoryDelivery, None] = {}
        queue.consumers += 1

    @property
    def done(self) -> bool:
        """Closed, with every delivery it handed out settled."""
        return self._closed and not self.outstanding

    async def get(self) -> MemoryDelivery:
        """The next message, waiting until one is ready and there is room for it."""
        queue = self.queue
        while True:
            if self._closed:
                raise ConsumerClosed(f"consumer of {queue.name!r} is closed")
            if self.unacked < self.prefetch and queue.ready:
                self.unacked += 1
                queue.unacked += 1
                delivery = MemoryDelivery(self, queue.ready.popleft())
                self.outstanding[delivery] = None
                return delivery
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            if self.unacked < self.prefetch:
                queue.waiters[waiter] = None
            else:
                self._room = waiter
            try:
                await waiter
            finally:  # woken, closed or cancelled: the waiter is done with either way
                queue.waiters.pop(waiter, None)
                self._waiter = None

    def release(self, delivery: MemoryDelivery) -> None:
        """One delivery was settled: make room for the next."""
        self.outstanding.pop(delivery, None)
        self.unacked -= 1
        self.queue.unacked -= 1
        room, self._room = self._room, None
        if room is not None and not room.done():
            room.set_result(None)
        if self._closed and self._on_done is not None and not self.outstanding:
            self._on_done(self)

    async def close(self) -> None:
        """Stop taking messages; wake a waiting `get` so that it raises `ConsumerClosed`."""
        if self._closed:
            return
        self._closed = True
        self.queue.consumers -= 1
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self.done and self._on_done is not None:
            self._on_done(self)


class MemoryTransport:
    """The `memory://[name]` transport: an in-process broker shared by the apps of one loop.

    It refuses what RabbitMQ would refuse (`limits`), so that code tried on it works there too.
    """

    def __init__(self, url: str = "memory://", *, limits: Limits = DEFAULT_LIMITS) -> None:
        self.address = url
        self.name = url.partition("://")[2] or "default"
        self.limits = limits
        self._temporary: list[str] = []
        self._consumers: dict[MemoryConsumer, None] = {}
        self._broker: MemoryBroker | None = None

    @property
    def broker(self) -> MemoryBroker:
        """The broker this transport talks to (available once started)."""
        if self._broker is None:
            self._broker = broker_named(self.name)
        return self._broker

    async def start(self) -> None:
        """Attach to the loop's broker of this name."""
        self._broker = broker_named(self.name)

    async def stop(self) -> None:
        """Return unacknowledged deliveries to their queues; remove temporary queues."""
        for consumer in list(self._consumers):
            await consumer.close()
            for delivery in list(consumer.outstanding):
                await delivery.nack(requeue=True)
        self._consumers.clear()
        for name in self._temporary:
            self.broker.delete(name)
        self._temporary.clear()

    async def declare(self, queue: str, *, temporary: bool = False, partitions: int = 0) -> None:
        """Create `queue` if it does not exist (partitions: one process keeps key order anyway)."""
        self.broker.declare(queue)
        if temporary:
            self._temporary.append(queue)

    async def bind(self, queue: str, topic: str) -> None:
        """Deliver what is published on `topic` to `queue`."""
        self.broker.bind(queue, topic)

    async def prune_bindings(self, queue: str, topics: Collection[str]) -> None:
        """Stop delivering to `queue` what is published on any topic not in `topics`."""
        self.broker.prune(queue, topics)

    async def send(self, messages: Sequence[Outgoing]) -> None:
        """Route each message now (or at its deliver-at time); raise the first failure."""
        first_failure(await self.send_each(messages))

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        """Route each message it can carry; for each, None or why it could not go."""
        return [self._route(outgoing) for outgoing in messages]

    def _route(self, outgoing: Outgoing) -> Exception | None:
        if not outgoing.checked and (problem := problem_of(outgoing, self.limits)) is not None:
            return Unsendable(f"cannot send it to {outgoing.address!r}: {problem}")
        try:
            self.broker.route(outgoing)
        except Unroutable as error:
            return error
        return None

    async def consume(self, queue: str, *, prefetch: int) -> MemoryConsumer:
        """Receive from an existing queue."""
        found = self.broker.queues.get(queue)
        if found is None:
            raise Unroutable(f"no queue named {queue!r} to consume from: declare it first")
        consumer = MemoryConsumer(found, prefetch, self._forget)
        self._consumers[consumer] = None
        return consumer

    def _forget(self, consumer: MemoryConsumer) -> None:
        self._consumers.pop(consumer, None)

    async def queue_status(
        self,
        names: Sequence[str],
        *,
        waits_of: Sequence[str] = (),
        delays: Sequence[float] = (),
        management: str | None = None,
    ) -> QueueReport:
        """Ready, unacked and consumer counts of `names` (delays are timers here, not queues)."""
        counted = []
        for name in names:
            queue = self.broker.queues.get(name)
            if queue is None:
                counted.append(QueueStatus(name, exists=False))
            else:
                counted.append(QueueStatus(name, True, len(queue), queue.unacked, queue.consumers))
        return QueueReport(counted)
