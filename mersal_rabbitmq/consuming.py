"""Consuming: one channel per consumer, deliveries owed exactly one ack or nack.

Each consumer has a channel of its own with its prefetch. It registers with the connection's
registry, which restores it after a reconnect: a new channel, its queue declared again (when
this transport declared it), consuming again. A consumer whose channel closed on its own, or
that the broker cancelled (its queue was deleted), asks for the same restore; that is tried a
bounded number of times while connected, and then `get()` raises `ConsumerLost`.
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
from aio_pika.abc import AbstractChannel
from aiormq.abc import DeliveredMessage

from mersal.errors import ConsumerClosed, MersalError, Unroutable
from mersal.messages import describe
from mersal.transport import partition_queue
from mersal_rabbitmq.acks import Acks
from mersal_rabbitmq.connection import Connection, Lost, Registration, Restore, close_quietly
from mersal_rabbitmq.failures import CHANNEL_ERRORS, why
from mersal_rabbitmq.topology import Topology
from mersal_rabbitmq.wire import envelope_of, redelivered

log = logging.getLogger("mersal.rabbitmq")

ACK_MODES = ("manual", "on_receive", "none")
"""When deliveries are acked: after handling, on arrival, or never (consumed without acks)."""
ACK_DRAIN_TIMEOUT = 2.0
"""Seconds a closing consumer waits for its noted acks to be written."""
RESUBSCRIBE_DELAYS = (0.2, 0.5, 1.0, 2.0, 5.0)
"""The pauses between a lost consumer's attempts to consume again."""


class ConsumerLost(ConsumerClosed):
    """The broker took a consumer away and consuming again kept failing."""


class ConsumerHost(Protocol):
    """What a consumer needs of its transport: channels, recovery, its queue, and release."""

    async def channel(self) -> AbstractChannel:
        """A new channel, once connected."""
        ...

    def register(
        self, what: str, restore: Restore, *, delays: Sequence[float], lost: Lost
    ) -> Registration:
        """Run `restore` after every reconnect and when asked; `lost` hears if it gives up."""
        ...

    async def redeclare(self, queue: str) -> None:
        """Declare `queue` and its bindings again, if they were declared here."""
        ...

    def forget(self, consumer: RabbitMQConsumer) -> None:
        """The consumer is done (closed, every delivery settled): stop tracking it."""
        ...


class RabbitMQConsumer:
    """Deliveries from a queue (and its partitions), on a channel of its own; restored."""

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
        self._delays = delays
        self._channel: AbstractChannel | None = None
        self._underlay: aiormq.abc.AbstractChannel | None = None
        self._acks: Acks | None = None
        self._tags: dict[str, str] = {}  # consumer tag -> queue, on the current channel
        self._consuming = False
        self._buffer: deque[tuple[AbstractChannel, str, DeliveredMessage]] = deque()
        self._ready = asyncio.Event()
        self._outstanding: set[RabbitMQDelivery] = set()
        self._closed = False
        self._failure: str | None = None
        self._registration: Registration | None = None
        self._closing: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Begin consuming, restored from now on; on failure nothing is left open."""
        try:
            await self._subscribe()
        except BaseException:
            await self.abandon()
            await self._close_channel()
            raise
        self._registration = self._host.register(
            f"consuming {self.queue!r}", self._restore, delays=self._delays, lost=self._fail
        )

    async def get(self) -> RabbitMQDelivery:
        """The next delivery, waiting for one (through reconnects)."""
        while True:
            if self._closed:
                raise ConsumerClosed(f"consumer of {self.queue!r} is closed")
            while self._buffer:
                channel, queue, message = self._buffer.popleft()
                if not channel.is_closed:  # else its channel died: the broker delivers it again
                    acks = self._acks if channel is self._channel else None
                    delivery = RabbitMQDelivery(self, message, acks, queue)
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
        if self._registration is not None:
            await self._registration.cancel()
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

    # Subscribing, and restoring after a loss.

    async def _subscribe(self) -> None:
        """Consume every queue not consumed yet on the channel (a new one if it closed)."""
        channel = self._channel
        if channel is None or channel.is_closed:
            channel = await self._open()
        underlay = await channel.get_underlay_channel()
        for queue in self.queues:
            if queue in self._tags.values():
                continue
            consuming = await underlay.basic_consume(
                queue, partial(self._on_message, channel, queue), no_ack=self._ack_mode == "none"
            )
            assert consuming.consumer_tag is not None
            self._tags[consuming.consumer_tag] = queue
        self._underlay = underlay
        self._consuming = True

    async def _open(self) -> AbstractChannel:
        channel = await self._host.channel()
        try:
            await channel.set_qos(prefetch_count=self.prefetch)
            underlay = await channel.get_underlay_channel()
        except BaseException:
            await close_quietly(channel)
            raise
        underlay.on_consumer_cancel_callbacks.add(self._on_cancel)
        channel.close_callbacks.add(self._on_channel_close)
        self._channel = channel
        self._tags = {}
        self._acks = Acks(underlay) if self._ack_mode == "manual" else None
        return channel

    async def _restore(self) -> None:
        """Declare the queues again and consume again, unless consuming on an open channel."""
        channel = self._channel
        if self._consuming and channel is not None and not channel.is_closed:
            return
        for queue in self.queues:
            await self._host.redeclare(queue)
        await self._subscribe()
        log.info("consuming %r again", self.queue)

    async def _on_message(
        self, channel: AbstractChannel, queue: str, message: DeliveredMessage
    ) -> None:
        acks = self._acks if channel is self._channel else None
        if acks is not None:
            acks.received(_tag(message))
        if self._closed:
            return  # arrived after the cancel: the channel's close returns it to its place
        if channel is not self._channel:
            if self._ack_mode == "manual":
                with contextlib.suppress(Exception):
                    await _nack(message, acks, requeue=True)
            return
        if self._ack_mode == "on_receive":
            await _ack(message)
        self._buffer.append((channel, queue, message))
        self._ready.set()

    def _on_cancel(self, frame: aiormq.spec.Basic.Cancel) -> None:
        queue = self._tags.pop(frame.consumer_tag or "", None)
        if self._closed or queue is None or not self._consuming:
            return
        log.warning(
            "RabbitMQ cancelled the consumer of %r (was the queue deleted?); "
            "declaring the queue again and consuming again",
            queue,
        )
        self._lost()

    def _on_channel_close(self, channel: object, error: BaseException | None) -> None:
        # What arrived on that channel cannot be acked any more: the broker delivers it again.
        self._buffer = deque(item for item in self._buffer if item[0] is not channel)
        if self._closed or channel is not self._channel or not self._consuming:
            return
        log.warning(
            "the channel consuming %r closed (%s); consuming again when connected",
            self.queue,
            why(error),
        )
        self._lost()

    def _lost(self) -> None:
        self._consuming = False
        if self._registration is not None:
            self._registration.restore()

    def _fail(self, error: Exception, attempts: int) -> None:
        self._failure = (
            f"lost the consumer of {self.queue!r} and could not consume again in {attempts} "
            f"attempts ({type(error).__name__}: {error}); check that the queue exists"
        )
        log.error("%s", self._failure)
        self._ready.set()

    # Closing.

    async def _cancel_consumers(self) -> None:
        underlay, channel = self._underlay, self._channel
        if underlay is None or channel is None or channel.is_closed:
            return
        for tag in list(self._tags):
            try:
                await underlay.basic_cancel(tag)
            except Exception as error:  # closing anyway
                log.debug("cancelling the consumer of %r failed: %s", self._tags[tag], error)

    async def _send_acks(self) -> None:
        channel, acks = self._channel, self._acks
        if acks is not None and channel is not None and not channel.is_closed:
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

    __slots__ = ("_acks", "_consumer", "_message", "_settled", "envelope", "queue", "redelivered")

    def __init__(
        self,
        consumer: RabbitMQConsumer,
        message: DeliveredMessage,
        acks: Acks | None = None,
        queue: str | None = None,
    ) -> None:
        self._consumer = consumer
        self._message = message
        self._acks = acks
        self._settled = False
        self.envelope = envelope_of(message)
        self.queue = queue or consumer.queue
        self.redelivered = redelivered(message)

    @property
    def message(self) -> DeliveredMessage:
        """The AMQP message as received: channel, delivery tag, properties; settle with ack/nack."""
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
        await self._settle(partial(_ack, self._message, self._acks))

    async def nack(self, requeue: bool = True) -> None:
        """Return the message to its queue; `requeue=False` lets the broker drop it.

        Returned while its consumer closes, it is left to the channel's close, which puts it
        back where it was in the queue.
        """
        if requeue and self._consumer.closed:
            await self._settle(_left_to_the_close)
            return
        await self._settle(partial(_nack, self._message, self._acks, requeue=requeue))

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
    """The consumers on one connection: started, restored through it, tracked until done."""

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

    async def channel(self) -> AbstractChannel:
        """A new channel, once connected."""
        return await self._connection.channel()

    def register(
        self, what: str, restore: Restore, *, delays: Sequence[float], lost: Lost
    ) -> Registration:
        """Run `restore` after every reconnect and when asked; `lost` hears if it gives up."""
        return self._connection.register(what, restore, delays=delays, lost=lost)

    async def redeclare(self, queue: str) -> None:
        """Declare `queue` and its bindings again, if they were declared here."""
        await self._topology.restore_queue(queue)

    def forget(self, consumer: RabbitMQConsumer) -> None:
        """The consumer is done (closed, every delivery settled): stop tracking it."""
        self._live.discard(consumer)


async def _left_to_the_close() -> None:
    """Settle nothing now: the channel's close returns the delivery to its place in the queue."""


def _tag(message: DeliveredMessage) -> int:
    assert message.delivery_tag is not None
    return message.delivery_tag


async def _ack(message: DeliveredMessage, acks: Acks | None = None) -> None:
    if acks is None:
        await message.channel.basic_ack(_tag(message))
        return
    if message.channel.is_closed:
        raise aiormq.exceptions.ChannelInvalidStateError(f"{message.channel!r} closed")
    acks.ack(_tag(message))


async def _nack(message: DeliveredMessage, acks: Acks | None = None, *, requeue: bool) -> None:
    await message.channel.basic_nack(_tag(message), requeue=requeue)
    if acks is not None:
        acks.nacked(_tag(message))
