"""Consuming: one restored channel per consumer, deliveries owed exactly one ack or nack.

Each consumer has a channel of its own (`channels.RestoredChannel`, aio-pika's robust channel)
with its prefetch and one consumer per queue, and aio-pika restores it: the channel reopened
with its QoS, its queues looked up again and its consumers consuming again with their tags and
arguments. What aio-pika lacks, the consumer adds, in its `Recovery`: before the channel is
restored its queues are declared again with their bindings (when this transport declared them:
a temporary queue went with the old connection, a queue may have been deleted meanwhile); a
consumer that the broker cancelled, its queue deleted, consumes again (aio-pika leaves it
cancelled); and a consumer that cannot come back is given up after a bounded number of
attempts, and then `get()` raises `ConsumerLost`. The recovery runs when the channel closes
(with the connection, or alone) and when the broker cancels one of its consumers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from functools import partial
from typing import Protocol

import aiormq
from aiormq.abc import DeliveredMessage

from mersal.errors import ConsumerClosed, MersalError, Unroutable
from mersal.messages import describe
from mersal.transport import partition_queue
from mersal_rabbitmq.acks import Acks
from mersal_rabbitmq.channels import Cancelled, RestoredChannel, RestoredQueue, close_quietly
from mersal_rabbitmq.connection import Connection
from mersal_rabbitmq.failures import CHANNEL_ERRORS, why
from mersal_rabbitmq.recovery import Lost, Recovery, Restore
from mersal_rabbitmq.topology import Topology
from mersal_rabbitmq.wire import envelope_of, redelivered

log = logging.getLogger("mersal.rabbitmq")

ACK_MODES = ("manual", "on_receive", "none")
"""When deliveries are acked: after handling, on arrival, or never (consumed without acks)."""
ACK_DRAIN_TIMEOUT = 2.0
"""Seconds a closing consumer waits for its noted acks to be written."""
RESUBSCRIBE_DELAYS = (0.2, 0.5, 1.0, 2.0, 5.0)
"""The pauses between a lost consumer's attempts to consume again."""

Underlay = aiormq.abc.AbstractChannel


class ConsumerLost(ConsumerClosed):
    """The broker took a consumer away and consuming again kept failing."""


class ConsumerHost(Protocol):
    """What a consumer needs of its transport: channels, recovery, its queues, and release."""

    async def channel(self, cancelled: Cancelled) -> RestoredChannel:
        """A new restored channel, once connected; `cancelled` hears the broker's cancels."""
        ...

    def recovery(
        self, what: str, restore: Restore, *, delays: Sequence[float], lost: Lost
    ) -> Recovery:
        """A recovery of one object: `restore` when asked, bounded by `delays`, then `lost`."""
        ...

    async def redeclare(self, queue: str) -> None:
        """Declare `queue` and its bindings again, if they were declared here."""
        ...

    async def exists(self, queue: str) -> bool:
        """Whether `queue` exists (nothing is made)."""
        ...

    def forget(self, consumer: RabbitMQConsumer) -> None:
        """The consumer is done (closed, every delivery settled): stop tracking it."""
        ...


class RabbitMQConsumer:
    """Deliveries from a queue (and its partitions), on a restored channel of its own."""

    def __init__(
        self,
        host: ConsumerHost,
        queue: str,
        prefetch: int,
        *,
        ack_mode: str = "manual",
        delays: Sequence[float] = RESUBSCRIBE_DELAYS,
        partitions: Sequence[str] = (),
    ) -> None:
        self.queue = queue
        self.queues = [queue, *partitions]
        """Every queue consumed: the queue, then its partitions (each with `prefetch`)."""
        self.prefetch = max(1, prefetch)
        self._host = host
        self._ack_mode = ack_mode
        self._channel: RestoredChannel | None = None
        self._consumers: dict[str, RestoredQueue] = {}  # consumer tag -> its queue
        self._cancelled: set[str] = set()  # tags the broker cancelled on `_underlay`
        self._underlay: Underlay | None = None  # the underlying channel consumed on
        self._acks: Acks | None = None
        self._consuming = False
        self._buffer: deque[tuple[Underlay, str, DeliveredMessage]] = deque()
        self._ready = asyncio.Event()
        self._outstanding: set[RabbitMQDelivery] = set()
        self._closed = False
        self._failure: str | None = None
        self._recovery = host.recovery(
            f"consuming {queue!r}", self._consume_again, delays=delays, lost=self._fail
        )
        self._closing: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Begin consuming, restored from now on; on failure nothing is left open."""
        try:
            await self._subscribe()
        except BaseException:
            await self.abandon()
            await self._close_channel()
            raise

    async def get(self) -> RabbitMQDelivery:
        """The next delivery, waiting for one (through reconnects)."""
        while True:
            if self._closed:
                raise ConsumerClosed(f"consumer of {self.queue!r} is closed")
            while self._buffer:
                underlay, queue, message = self._buffer.popleft()
                if self._owed(underlay):  # else its channel died: the broker delivers it again
                    acks = self._acks if self._acks and self._acks.channel is underlay else None
                    delivery = RabbitMQDelivery(self, message, underlay, acks, queue)
                    self._outstanding.add(delivery)
                    return delivery
            if self._failure is not None:
                raise ConsumerLost(self._failure)
            self._ready.clear()
            await self._ready.wait()

    async def close(self) -> None:
        """Stop consuming and return the buffered deliveries; handed-out ones stay owed.

        Nothing is nacked or cancelled one by one: what was buffered, arrives meanwhile or is
        returned stays unacked until the channel closes after the last settled delivery, and
        the broker then puts it all back at the head of the queue in its order. (A quorum queue
        puts a nacked message at its tail, and a delivery that crosses a cancel too, behind
        later messages of the same partition key.) Consuming without acks, the consumer is
        cancelled: what the broker sent would be gone.
        """
        if self._closed:
            return
        await self.abandon()
        if self._ack_mode == "none":  # the broker forgets what it sends: stop it sending
            await self._cancel_consumers()
        self._consuming = False
        self._buffer.clear()
        if not self._outstanding:
            await self._close_channel()

    async def abandon(self) -> None:
        """Stop at once, sending only the acks already noted (the connection is about to close)."""
        self._closed = True
        self._ready.set()
        await self._recovery.cancel()
        await self._send_acks()

    @property
    def closed(self) -> bool:
        """Whether the consumer was closed (or abandoned): it takes no more deliveries."""
        return self._closed

    @property
    def acked_already(self) -> bool:
        """Whether deliveries were acked on arrival (or need no ack): settling does nothing."""
        return self._ack_mode != "manual"

    def settled(self, delivery: RabbitMQDelivery) -> None:
        """A delivery was acked or nacked; a closed consumer's channel closes after the last."""
        self._outstanding.discard(delivery)
        if self._closed and not self._outstanding and self._closing is None:
            self._closing = asyncio.create_task(self._close_channel())

    # Subscribing, and consuming again after a loss.

    async def _subscribe(self) -> None:
        """A restored channel with the prefetch, consuming every queue."""
        channel = self._channel = await self._host.channel(self._on_cancel)
        channel.close_callbacks.add(self._on_channel_close)
        await channel.set_qos(prefetch_count=self.prefetch)
        for queue in self.queues:
            await self._consume(await channel.existing_queue(queue))
        self._underlay = await channel.get_underlay_channel()
        self._consuming = True

    async def _consume(self, amqp_queue: RestoredQueue, tag: str | None = None) -> None:
        """Consume `amqp_queue` (again, with the same `tag`): aio-pika remembers it."""
        no_ack = self._ack_mode == "none"
        tag = await amqp_queue.consume(self._on_message, no_ack=no_ack, consumer_tag=tag)
        self._consumers[tag] = amqp_queue

    async def _consume_again(self) -> None:
        """Declare the queues again, let aio-pika restore the channel, consume what it left.

        aio-pika reopens a closed channel with its QoS and consumers; a consumer the broker
        cancelled is consumed again here, once its queue is there.
        """
        channel = self._channel
        if channel is None or (self._consuming and not channel.is_closed):
            return
        for queue in self.queues:
            await self._host.redeclare(queue)
        await channel.restore()
        underlay = await channel.get_underlay_channel()
        if underlay is not self._underlay:  # reopened: aio-pika consumed with every tag again
            self._underlay, self._cancelled = underlay, set()
        for tag in sorted(self._cancelled):
            amqp_queue = self._consumers[tag]
            if not await self._host.exists(amqp_queue.name):
                raise Unroutable(f"no queue named {amqp_queue.name!r} to consume from")
            await self._consume(amqp_queue, tag)
            self._cancelled.discard(tag)
        if channel.is_closed:
            raise aiormq.exceptions.ChannelInvalidStateError(f"{channel!r} closed as it opened")
        self._consuming = True
        log.info("consuming %r again", self.queue)

    async def _on_message(self, message: DeliveredMessage) -> None:
        underlay = message.channel
        if underlay.is_closed and self._ack_mode != "none":
            return  # not acked, nor can it be now: the broker delivers it again
        acks = self._acks_for(underlay)
        if acks is not None:
            acks.received(_tag(message))
        if self._closed:
            return  # arrived after the cancel: the channel's close returns it to its place
        if self._ack_mode == "on_receive":
            await _ack(underlay, _tag(message))
        amqp_queue = self._consumers.get(getattr(message.delivery, "consumer_tag", None) or "")
        queue = self.queue if amqp_queue is None else amqp_queue.name
        self._buffer.append((underlay, queue, message))
        self._ready.set()

    def _owed(self, underlay: Underlay) -> bool:
        """Whether a delivery on `underlay` is still this consumer's to hand out.

        With manual acks, not once its channel closed: the broker delivers it again. Acked on
        arrival, or consumed without acks, the broker forgot it: it is handed out regardless.
        """
        return self._ack_mode != "manual" or not underlay.is_closed

    def _acks_for(self, underlay: Underlay) -> Acks | None:
        """The acks of `underlay`, the channel deliveries now come on (manual acks only)."""
        if self._ack_mode != "manual":
            return None
        if self._acks is None or self._acks.channel is not underlay:
            self._acks = Acks(underlay)
        return self._acks

    def _on_cancel(self, tag: str) -> None:
        amqp_queue = self._consumers.get(tag)
        if amqp_queue is None:
            return
        self._cancelled.add(tag)
        if self._closed or not self._consuming:
            return
        log.warning(
            "RabbitMQ cancelled the consumer of %r (was the queue deleted?); "
            "declaring the queue again and consuming again",
            amqp_queue.name,
        )
        self._lost()

    def _on_channel_close(self, channel: object, error: BaseException | None) -> None:
        # What arrived on that channel cannot be acked any more: the broker delivers it again.
        self._buffer = deque(item for item in self._buffer if self._owed(item[0]))
        if self._closed or not self._consuming:
            return
        log.warning(
            "the channel consuming %r closed (%s); consuming again when connected",
            self.queue,
            why(error),
        )
        self._lost()

    def _lost(self) -> None:
        self._consuming = False
        self._recovery.ask()

    def _fail(self, error: Exception, attempts: int) -> None:
        self._failure = (
            f"lost the consumer of {self.queue!r} and could not consume again in {attempts} "
            f"attempts ({type(error).__name__}: {error}); check that the queue exists"
        )
        log.error("%s", self._failure)
        self._ready.set()

    # Closing.

    async def _cancel_consumers(self) -> None:
        channel = self._channel
        if channel is None or channel.is_closed:
            return
        for tag, amqp_queue in list(self._consumers.items()):
            try:
                await amqp_queue.cancel(tag)
            except Exception as error:  # closing anyway
                log.debug("cancelling the consumer of %r failed: %s", amqp_queue.name, error)

    async def _send_acks(self) -> None:
        acks = self._acks
        if acks is not None and not acks.channel.is_closed:
            with contextlib.suppress(TimeoutError):  # a blocked connection: they come again
                async with asyncio.timeout(ACK_DRAIN_TIMEOUT):
                    await acks.drain()

    async def _close_channel(self) -> None:
        self._host.forget(self)
        await self._send_acks()
        channel, self._channel = self._channel, None
        if channel is not None:
            await close_quietly(channel)


class RabbitMQDelivery:
    """A message received from RabbitMQ, owed exactly one ack or nack."""

    __slots__ = (
        "_acks",
        "_channel",
        "_consumer",
        "_message",
        "_settled",
        "envelope",
        "queue",
        "redelivered",
    )

    def __init__(
        self,
        consumer: RabbitMQConsumer,
        message: DeliveredMessage,
        channel: Underlay,
        acks: Acks | None = None,
        queue: str | None = None,
    ) -> None:
        self._consumer = consumer
        self._message = message
        self._channel = channel
        self._acks = acks
        self._settled = False
        self.envelope = envelope_of(message)
        self.queue = queue or consumer.queue
        self.redelivered = redelivered(message)

    @property
    def message(self) -> DeliveredMessage:
        """The AMQP message as aiormq read it: its channel, `delivery`, `header.properties`, body.

        Settle the delivery with its own `ack` / `nack`, not on the channel.
        """
        return self._message

    @property
    def exchange(self) -> str:
        """The exchange the message came through ('' for the default exchange)."""
        return self._message.exchange or ""

    @property
    def routing_key(self) -> str:
        """The routing key the message was published with."""
        return self._message.routing_key or ""

    @property
    def delivery_tag(self) -> int | None:
        """The message's delivery tag on its consumer's channel."""
        return self._message.delivery_tag

    async def ack(self) -> None:
        """Remove the message from its queue; raises if its channel died (it comes back).

        The ack goes with others noted within a few milliseconds (see `mersal_rabbitmq.acks`).
        """
        await self._settle(partial(_ack, self._channel, _tag(self._message), self._acks))

    async def nack(self, requeue: bool = True) -> None:
        """Give the message back to its queue; `requeue=False` lets the broker drop it.

        Returned while its consumer closes, it is left to the channel's close, which puts it
        back where it was in the queue.
        """
        if requeue and self._consumer.closed:
            await self._settle(_left_to_the_close)
            return
        tag = _tag(self._message)
        await self._settle(partial(_nack, self._channel, tag, self._acks, requeue=requeue))

    async def _settle(self, action: Callable[[], Awaitable[None]]) -> None:
        if self._settled:
            raise MersalError(f"delivery {self.envelope.message_id} was already acked or nacked")
        self._settled = True
        if self._consumer.acked_already:
            self._consumer.settled(self)
            return
        try:
            await action()
        except CHANNEL_ERRORS as error:
            raise MersalError(
                f"could not settle {describe(self.envelope.headers)} from {self.queue!r}: "
                f"its channel is gone ({type(error).__name__}); RabbitMQ will deliver it again"
            ) from error
        finally:
            self._consumer.settled(self)


class Consumers:
    """The consumers on one connection: started, their queues declared again, tracked."""

    def __init__(self, connection: Connection, topology: Topology, ack_mode: str) -> None:
        self._connection = connection
        self._topology = topology
        self._ack_mode = ack_mode
        self._live: set[RabbitMQConsumer] = set()

    def __iter__(self) -> Iterator[RabbitMQConsumer]:
        """The consumers not done yet."""
        return iter(list(self._live))

    async def consume(
        self, queue: str, prefetch: int, delays: Sequence[float] = RESUBSCRIBE_DELAYS
    ) -> RabbitMQConsumer:
        """A started consumer of an existing `queue` (and its partitions), `prefetch` each.

        A connection lost meanwhile is waited for, as a declaration waits for it.
        """
        count = self._topology.partitions.get(queue, 0)
        started: list[RabbitMQConsumer] = []

        async def starting() -> None:
            consumer = RabbitMQConsumer(
                self,
                queue,
                prefetch,
                ack_mode=self._ack_mode,
                delays=delays,
                partitions=[partition_queue(queue, index) for index in range(count)],
            )
            try:
                await consumer.start()  # closes what it opened if it fails
            except aiormq.exceptions.ChannelNotFoundEntity:
                raise Unroutable(
                    f"no queue named {queue!r} to consume from: declare it first"
                ) from None
            started.append(consumer)

        await self._topology.through_reconnects(f"consume {queue!r}", starting)
        self._live.add(started[0])
        return started[0]

    async def abandon(self) -> None:
        """Stop every consumer at once (the connection is about to close)."""
        consumers, self._live = self._live, set()
        for consumer in consumers:
            await consumer.abandon()

    async def channel(self, cancelled: Cancelled) -> RestoredChannel:
        """A new restored channel, once connected; `cancelled` hears the broker's cancels."""
        return await self._connection.restored_channel(cancelled)

    def recovery(
        self, what: str, restore: Restore, *, delays: Sequence[float], lost: Lost
    ) -> Recovery:
        """A recovery of one object: `restore` when asked, bounded by `delays`, then `lost`."""
        return Recovery(self._connection, what, restore, delays=delays, lost=lost)

    async def redeclare(self, queue: str) -> None:
        """Declare `queue` and its bindings again, if they were declared here."""
        await self._topology.restore_queue(queue)

    async def exists(self, queue: str) -> bool:
        """Whether `queue` exists (nothing is made)."""
        return await self._topology.exists(queue)

    def forget(self, consumer: RabbitMQConsumer) -> None:
        """The consumer is done (closed, every delivery settled): stop tracking it."""
        self._live.discard(consumer)


async def _left_to_the_close() -> None:
    """Settle nothing now: the channel's close returns the delivery to its place in the queue."""


def _tag(message: DeliveredMessage) -> int:
    assert message.delivery_tag is not None
    return message.delivery_tag


async def _ack(channel: Underlay, tag: int, acks: Acks | None = None) -> None:
    if acks is None:
        await channel.basic_ack(tag)
        return
    if channel.is_closed:
        raise aiormq.exceptions.ChannelInvalidStateError(f"{channel!r} closed")
    acks.ack(tag)


async def _nack(channel: Underlay, tag: int, acks: Acks | None = None, *, requeue: bool) -> None:
    await channel.basic_nack(tag, requeue=requeue)
    if acks is not None:
        acks.nacked(tag)
