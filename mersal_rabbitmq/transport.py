"""The RabbitMQ transport (`amqp://…`): aio-pika underneath, the memory transport's semantics.

Topology
    A send goes through the default exchange (routing key = queue name) with `mandatory`, so a
    send to a missing queue raises `Unroutable`. A publish goes to one durable topic exchange,
    `mersal.events`, with the message type name as routing key, not mandatory (an event nobody
    subscribes to is fine); `bind(queue, topic)` binds with that exact name. Type names contain
    dots, which separate words in topic routing, but a binding key without wildcards still only
    matches itself. Queues are durable with `x-queue-type` = `queue_type`; a temporary queue is an
    exclusive, auto-delete, non-durable classic queue that goes away with the connection.

Delayed delivery
    RabbitMQ 3.10 has no delay plugin, so a message whose deliver-at lies in the future first
    goes to a wait queue of its destination, `<queue>.wait.<ms>`: durable, `x-message-ttl=<ms>`,
    dead-lettering through the default exchange with `x-dead-letter-routing-key=<queue>`. When
    the TTL runs out the broker moves the message to its queue. All messages of one wait queue
    share its TTL, so they expire in order at its head (per-message TTLs would wait behind longer
    ones). The delay left at send time is rounded UP to two significant digits (1234 ms waits
    1300 ms): never early, at most 10% late, and at most 90 wait queues per decade of delay per
    destination. A delayed publish waits in `mersal.events.<topic>.wait.<ms>`, which dead-letters
    into the topic exchange. Quorum wait queues dead-letter at-least-once. Wait queues are not
    removed automatically: `x-expires` ignores publishes and could drop waiting messages.

Channels
    One robust connection. Publishing uses a small pool of plain channels with publisher
    confirms and `on_return_raises` (not `aio_pika.pool.Pool`, which keeps closed channels,
    aio-pika #670); a closed channel is replaced when next needed. One message id is never in
    flight twice on one channel (aio-pika #689): a batch is split into runs without a repeated
    id, and a channel whose publish timed out or was cancelled is retired. Declarations use one
    channel, replaced when an error closed it (RabbitMQ closes it on a 406). Each consumer has a
    channel of its own.

Recovery
    aio-pika reconnects the connection; the plain channels die with it and this module restores
    the rest: after a reconnect it declares its topology again, and every consumer opens a new
    channel and consumes again. A consumer whose channel closed on its own, or that the broker
    cancelled (its queue was deleted), declares its queue again (when this transport declared
    it) and consumes again, a bounded number of times while connected; then `get()` raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from functools import partial
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aio_pika
import aiormq
from aio_pika.abc import (
    AbstractChannel,
    AbstractRobustConnection,
)
from aiormq.abc import DeliveredMessage

from mersal.errors import (
    ConfigurationError,
    ConsumerClosed,
    MersalError,
    OutcomeUnknown,
    Unroutable,
    Unsendable,
)
from mersal.messages import Envelope, Header, describe
from mersal.transport import Limits, Outgoing, first_failure, mask, problem_of

log = logging.getLogger("mersal.rabbitmq")

EVENTS = "mersal.events"
QUEUE_TYPES = ("classic", "quorum")
ACK_MODES = ("manual", "on_receive", "none")
RECONNECT_INTERVAL = 1.0
RESUBSCRIBE_DELAYS = (0.2, 0.5, 1.0, 2.0, 5.0)
MAX_WAIT_MS = 4_200_000_000  # the largest two-digit bucket under RabbitMQ's 2**32 - 1 ms TTL cap
PERSISTENT = int(aio_pika.DeliveryMode.PERSISTENT)
DEFAULT_FRAME_MAX = 131_072  # RabbitMQ's default frame_max
FRAME_SLACK = 4_096  # room for the properties and the frame's own fields
SHORT_STRING = 255  # bytes in an AMQP short string (message_id, type, reply_to, ...)

PROPERTY_HEADERS = (
    ("message_id", Header.MESSAGE_ID),
    ("correlation_id", Header.CORRELATION_ID),
    ("message_type", Header.TYPE),
    ("reply_to", Header.REPLY_TO),
    ("content_type", Header.CONTENT_TYPE),
)
IN_PROPERTIES = frozenset(header for _, header in PROPERTY_HEADERS)
"""Headers carried by AMQP properties alone (the receiver restores them from there)."""
DEAD_LETTER_HEADERS = ("x-death", "x-first-death-", "x-last-death-")
CHANNEL_ERRORS = (
    aiormq.exceptions.AMQPError,
    aiormq.exceptions.ChannelInvalidStateError,
    ConnectionError,
)
BROKER_REFUSALS = (
    aiormq.exceptions.ChannelPreconditionFailed,
    aiormq.exceptions.ChannelAccessRefused,
    aiormq.exceptions.ChannelNotFoundEntity,
)
"""Channel closes with which RabbitMQ refuses what a publish carried (406, 403, 404)."""

OpenChannel = Callable[[], Awaitable[AbstractChannel]]


class ConsumerLost(ConsumerClosed):
    """The broker took a consumer away and consuming again kept failing."""


class RabbitMQTransport:
    """The `amqp://` transport: queues, topics, confirmed publishes and wait queues on RabbitMQ.

    URL query parameters go to aio-pika (`heartbeat`, `name`, `reconnect_interval`, which
    defaults to 1 second here).

    `ack_mode="manual"` (the default) acks a delivery after it was handled. `"on_receive"` acks
    it as it arrives and `"none"` consumes without acks: faster, but a crash (or a stop) loses
    what was received and not yet handled. `fire_and_forget=True` publishes without confirms:
    faster, but a lost or unroutable message goes unnoticed.
    """

    resubscribe_delays: Sequence[float] = RESUBSCRIBE_DELAYS
    """The pauses between a lost consumer's attempts to consume again; then `get()` raises."""

    def __init__(
        self,
        url: str,
        *,
        queue_type: str = "classic",
        heartbeat: int | None = None,
        publish_timeout: float = 10.0,
        channels: int = 4,
        ack_mode: str = "manual",
        fire_and_forget: bool = False,
    ) -> None:
        if queue_type not in QUEUE_TYPES:
            raise ConfigurationError(
                f"RabbitMQTransport(queue_type={queue_type!r}) must be 'classic' or 'quorum'"
            )
        if not publish_timeout > 0:
            raise ConfigurationError(
                f"RabbitMQTransport(publish_timeout={publish_timeout!r}) must be > 0 seconds"
            )
        if not isinstance(channels, int) or channels < 1:
            raise ConfigurationError(f"RabbitMQTransport(channels={channels!r}) must be >= 1")
        if ack_mode not in ACK_MODES:
            raise ConfigurationError(
                f"RabbitMQTransport(ack_mode={ack_mode!r}) must be one of {', '.join(ACK_MODES)}"
            )
        self.ack_mode = ack_mode
        self.fire_and_forget = fire_and_forget
        self.address = url
        self.queue_type = queue_type
        self.heartbeat = heartbeat
        self.publish_timeout = publish_timeout
        self.channels = channels
        self.limits = Limits(max_delay=MAX_WAIT_MS / 1000)
        self._connection: AbstractRobustConnection | None = None
        self._topology = _Topology(self.open_channel, queue_type)
        self._pool = _PublisherPool(self._open_publisher, channels)
        self._consumers: set[RabbitMQConsumer] = set()
        self._restoring: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"<RabbitMQTransport {mask(self.address)}>"

    @property
    def queues(self) -> list[str]:
        """The queues this transport declared, wait queues included."""
        return list(self._topology.queues)

    @property
    def connected(self) -> bool:
        """Whether the connection to RabbitMQ is up right now."""
        connection = self._connection
        if connection is None or not connection.connected.is_set():
            return False
        transport = connection.transport
        return transport is not None and not transport.connection.is_closed

    # The Transport protocol.

    async def start(self) -> None:
        """Connect, and declare the topic exchange that publishes go through."""
        if self._connection is not None:
            return
        self._topology = _Topology(self.open_channel, self.queue_type)
        self._pool = _PublisherPool(self._open_publisher, self.channels)
        self._connection = await self._connect()
        self._connection.reconnect_callbacks.add(self._on_reconnect)
        self.limits = limits_for(self._connection)
        try:
            await self._topology.declare_exchange()
        except BaseException:
            await self.stop()
            raise
        log.info("connected to RabbitMQ at %s", mask(self.address))

    async def stop(self) -> None:
        """Disconnect: unacknowledged deliveries return to their queues."""
        connection, self._connection = self._connection, None
        consumers, self._consumers = self._consumers, set()
        for consumer in consumers:
            await consumer.abandon()
        await _cancel(self._restoring)
        if connection is not None:
            await connection.close()

    async def declare(self, queue: str, *, temporary: bool = False) -> None:
        """Make sure `queue` exists; a temporary one goes away with the connection."""
        self._require_connection()
        shape = temporary_shape() if temporary else durable_shape(self.queue_type)
        await self._topology.declare(queue, shape)

    async def bind(self, queue: str, topic: str) -> None:
        """Deliver messages published on `topic` to `queue` too."""
        self._require_connection()
        if any(word in ("*", "#") for word in topic.split(".")):
            raise ConfigurationError(f"topic {topic!r} has a wildcard word ('*' or '#')")
        await self._topology.bind(queue, topic)

    async def send(self, messages: Sequence[Outgoing]) -> None:
        """Publish all messages, in order, each confirmed by the broker within publish_timeout."""
        first_failure(await self.send_each(messages))

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        """Publish every message it can carry, in order; for each, None once confirmed, or why not.

        A message the broker answered by closing the channel (it refused something in it) had
        company on that channel: each such message is published again alone, on a channel of
        its own, so that only the one the broker refuses is reported as refused.
        """
        self._require_connection()
        results: list[Exception | None] = [None] * len(messages)
        carried: list[int] = []
        for index, outgoing in enumerate(messages):
            problem = problem_of(outgoing, self.limits)
            if problem is None:
                carried.append(index)
            else:
                results[index] = Unsendable(f"cannot send it to {outgoing.address!r}: {problem}")
        for run in distinct_runs([messages[index] for index in carried]):
            indices, carried = carried[: len(run)], carried[len(run) :]
            for index, result in zip(indices, await self._send_run(run), strict=True):
                results[index] = result
        if any(lost_channel(result) for result in results):
            await self._isolate(messages, results)
        return results

    async def _isolate(self, messages: Sequence[Outgoing], results: list[Exception | None]) -> None:
        """Send again, one by one and each on a channel of its own, what lost its channel.

        A refusal closes the channel others were publishing on (and with it perhaps the whole
        connection); alone, the message the broker refuses is known, and the others go. All of
        it within one publish timeout: in an outage, what is left stays "outcome unknown".
        """
        deadline = asyncio.get_running_loop().time() + self.publish_timeout
        for index, result in enumerate(results):
            if result is not None and not isinstance(result, Unsendable):
                results[index] = await self._send_alone(messages[index], deadline)

    async def consume(self, queue: str, *, prefetch: int) -> RabbitMQConsumer:
        """Start receiving from an existing `queue`, at most `prefetch` unacknowledged."""
        self._require_connection()
        consumer = RabbitMQConsumer(self, queue, prefetch)
        try:
            await consumer.start()
        except aiormq.exceptions.ChannelNotFoundEntity:
            raise Unroutable(
                f"no queue named {queue!r} to consume from: declare it first"
            ) from None
        self._consumers.add(consumer)
        return consumer

    def forget(self, consumer: RabbitMQConsumer) -> None:
        """A consumer is done (closed, every delivery settled): stop tracking it."""
        self._consumers.discard(consumer)

    # Connection and channels.

    async def _connect(self) -> AbstractRobustConnection:
        options: dict[str, Any] = {}
        if "reconnect_interval" not in parse_qs(urlsplit(self.address).query):
            options["reconnect_interval"] = RECONNECT_INTERVAL
        if self.heartbeat is not None:
            options["heartbeat"] = self.heartbeat
        try:
            connection: AbstractRobustConnection = await aio_pika.connect_robust(
                self.address, **options
            )
        except ValueError as error:
            raise ConfigurationError(
                f"{mask(self.address)} is not a usable AMQP URL ({error}): "
                "use amqp://user:password@host:port/vhost"
            ) from None
        except (OSError, aiormq.exceptions.AMQPError) as error:
            raise MersalError(
                f"cannot connect to RabbitMQ at {mask(self.address)}: "
                f"{type(error).__name__}: {error}; check the URL, the vhost and the credentials"
            ) from None
        return connection

    def _require_connection(self) -> AbstractRobustConnection:
        if self._connection is None:
            raise MersalError(
                f"the RabbitMQ transport for {mask(self.address)} is not started: "
                "`await transport.start()` first"
            )
        return self._connection

    async def wait_connected(self) -> None:
        """Wait until the connection is up (it reconnects by itself)."""
        await self._require_connection().ready()

    async def open_channel(self, *, confirms: bool = False) -> AbstractChannel:
        """A new plain channel (no robust restore: this module restores), once connected."""
        connection = self._require_connection()
        await connection.ready()
        channel = aio_pika.Channel(
            connection, publisher_confirms=confirms, on_return_raises=confirms
        )
        await channel.initialize()
        return channel

    async def _open_publisher(self) -> _Publisher:
        channel = await self.open_channel(confirms=not self.fire_and_forget)
        return _Publisher(channel, await channel.get_underlay_channel())

    def _on_reconnect(self, connection: object) -> None:
        self._restoring = asyncio.create_task(self._restore(), name="mersal-rabbitmq-restore")

    async def _restore(self) -> None:
        log.info("reconnected to RabbitMQ at %s; declaring the topology again", mask(self.address))
        await self._topology.restore()

    async def restore_queue(self, queue: str) -> None:
        """Declare `queue` and its bindings again, if this transport declared it."""
        await self._topology.restore_queue(queue)

    # Sending.

    async def _send_run(self, run: Sequence[Outgoing]) -> list[Exception | None]:
        """Publish messages with distinct ids on one channel; each one's result."""
        ids = {o.envelope.message_id for o in run if o.envelope.message_id}
        deadline = asyncio.get_running_loop().time() + self.publish_timeout
        try:
            async with asyncio.timeout_at(deadline):
                publisher = await self._claim(ids)
        except TimeoutError:
            unknown = OutcomeUnknown(
                f"no channel to publish on within {self.publish_timeout:g}s: "
                f"is RabbitMQ at {mask(self.address)} reachable? Send again"
            )
            return [unknown] * len(run)
        try:
            results = await asyncio.gather(
                *(self._publish(publisher, outgoing, deadline) for outgoing in run),
                return_exceptions=True,
            )
        except asyncio.CancelledError:
            publisher.retired = True  # confirms may still arrive for what was written
            raise
        finally:
            self._pool.release(publisher, ids)
        return [_result(result) for result in results]

    async def _send_alone(self, outgoing: Outgoing, deadline: float) -> Exception | None:
        """Publish one message on a channel of its own: the broker's refusal is then its own."""
        try:
            async with asyncio.timeout_at(deadline):
                publisher = await self._open_publisher()
        except (TimeoutError, RuntimeError, *CHANNEL_ERRORS) as error:  # aiormq: "closed"
            return OutcomeUnknown(f"no channel to publish on ({type(error).__name__}): send again")
        try:
            await self._publish(publisher, outgoing, deadline)
        except OutcomeUnknown as error:
            if refused_by_broker(error):
                return Unsendable(
                    f"RabbitMQ refused {describe(outgoing.envelope.headers)} to "
                    f"{outgoing.address!r} and closed the channel: {error.__cause__}"
                )
            return error
        except MersalError as error:
            return error
        finally:
            await _close_quietly(publisher.channel)
        return None

    async def _claim(self, ids: set[str]) -> _Publisher:
        """A publishing channel for `ids`, trying again while the connection comes back."""
        while True:
            try:
                return await self._pool.claim(ids)
            except CHANNEL_ERRORS as error:
                log.debug("no publishing channel yet (%s: %s)", type(error).__name__, error)
                await asyncio.sleep(0.1)

    async def _publish(self, publisher: _Publisher, outgoing: Outgoing, deadline: float) -> None:
        what = f"{describe(outgoing.envelope.headers)} to {outgoing.address!r}"
        try:
            async with asyncio.timeout_at(deadline):
                await self._deliver(publisher, outgoing)
        except TimeoutError:
            publisher.retired = True  # its confirm (or return) may still come on this channel
            raise OutcomeUnknown(
                f"{what} was not confirmed within {self.publish_timeout:g}s; send it again "
                "(the receiver's inbox drops duplicates)"
            ) from None
        except CHANNEL_ERRORS as error:
            raise OutcomeUnknown(
                f"{what} lost its channel before a confirm ({type(error).__name__}: {error}); "
                "send it again"
            ) from error

    async def _deliver(self, publisher: _Publisher, outgoing: Outgoing) -> None:
        exchange, routing_key, waiting = await self._destination(outgoing)
        if await publisher.publish(exchange, routing_key, outgoing.envelope):
            return
        if waiting:  # the wait queue was deleted since it was declared: declare it again, once
            self._topology.forget(routing_key)
            exchange, routing_key, _ = await self._destination(outgoing)
            if await publisher.publish(exchange, routing_key, outgoing.envelope):
                return
        raise Unroutable(
            f"no queue named {outgoing.address!r}: start the app that owns it, or check the route"
        )

    async def _destination(self, outgoing: Outgoing) -> tuple[str, str, bool]:
        """The exchange and routing key to publish to, and whether that is a wait queue."""
        exchange = EVENTS if outgoing.publish else ""
        delay = outgoing.delay
        if delay <= 0:
            return exchange, outgoing.address, False
        milliseconds = wait_milliseconds(delay)
        if milliseconds > MAX_WAIT_MS:
            raise Unsendable(
                f"a delay of {delay:.0f}s is over the {MAX_WAIT_MS // 1000}s RabbitMQ can wait"
            )
        queue = await self._topology.wait_queue(exchange, outgoing.address, milliseconds)
        return "", queue, True


class RabbitMQConsumer:
    """Deliveries from one queue, on a channel of its own; consumes again after losing it."""

    def __init__(self, transport: RabbitMQTransport, queue: str, prefetch: int) -> None:
        self.queue = queue
        self.prefetch = max(1, prefetch)
        self._transport = transport
        self._channel: AbstractChannel | None = None
        self._underlay: aiormq.abc.AbstractChannel | None = None
        self._tag: str | None = None
        self._consuming = False
        self._buffer: deque[tuple[AbstractChannel, DeliveredMessage]] = deque()
        self._ready = asyncio.Event()
        self._outstanding: set[RabbitMQDelivery] = set()
        self._closed = False
        self._failure: str | None = None
        self._recovery: asyncio.Task[None] | None = None
        self._closing: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Begin consuming; on failure nothing is left open."""
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
                channel, message = self._buffer.popleft()
                if not channel.is_closed:  # else its channel died: the broker delivers it again
                    delivery = RabbitMQDelivery(self, message)
                    self._outstanding.add(delivery)
                    return delivery
            if self._failure is not None:
                raise ConsumerLost(self._failure)
            self._ready.clear()
            await self._ready.wait()

    async def close(self) -> None:
        """Stop consuming and return the buffered deliveries; handed-out ones stay owed."""
        if self._closed:
            return
        await self.abandon()
        await self._cancel_consumer()
        await self._return_buffered()
        if not self._outstanding:
            await self._close_channel()

    async def abandon(self) -> None:
        """Stop at once without talking to the broker (the connection is about to close)."""
        self._closed = True
        self._ready.set()
        await _cancel(self._recovery)

    @property
    def acked_already(self) -> bool:
        """Whether deliveries were acked on arrival (or need no ack): settling does nothing."""
        return self._transport.ack_mode != "manual"

    def settled(self, delivery: RabbitMQDelivery) -> None:
        """A delivery was acked or nacked; a closed consumer's channel closes after the last."""
        self._outstanding.discard(delivery)
        if self._closed and not self._outstanding and self._closing is None:
            self._closing = asyncio.create_task(self._close_channel())

    # Subscribing and resubscribing.

    async def _subscribe(self) -> None:
        channel = self._channel
        if channel is None or channel.is_closed:
            channel = await self._open()
        underlay = await channel.get_underlay_channel()
        no_ack = self._transport.ack_mode == "none"
        consuming = await underlay.basic_consume(
            self.queue, partial(self._on_message, channel), no_ack=no_ack
        )
        self._tag = consuming.consumer_tag
        self._underlay = underlay
        self._consuming = True

    async def _open(self) -> AbstractChannel:
        channel = await self._transport.open_channel()
        try:
            await channel.set_qos(prefetch_count=self.prefetch)
            underlay = await channel.get_underlay_channel()
        except BaseException:
            await _close_quietly(channel)
            raise
        underlay.on_consumer_cancel_callbacks.add(self._on_cancel)
        channel.close_callbacks.add(self._on_channel_close)
        self._channel = channel
        return channel

    async def _on_message(self, channel: AbstractChannel, message: DeliveredMessage) -> None:
        if self._closed or channel is not self._channel:
            if self._transport.ack_mode == "manual":
                with contextlib.suppress(Exception):
                    await _nack(message, requeue=True)
            return
        if self._transport.ack_mode == "on_receive":
            await _ack(message)
        self._buffer.append((channel, message))
        self._ready.set()

    def _on_cancel(self, frame: aiormq.spec.Basic.Cancel) -> None:
        if self._closed or frame.consumer_tag != self._tag or not self._consuming:
            return
        log.warning(
            "RabbitMQ cancelled the consumer of %r (was the queue deleted?); "
            "declaring the queue again and consuming again",
            self.queue,
        )
        self._recover()

    def _on_channel_close(self, channel: object, error: BaseException | None) -> None:
        # What arrived on that channel cannot be acked any more: the broker delivers it again.
        self._buffer = deque(item for item in self._buffer if item[0] is not channel)
        if self._closed or channel is not self._channel or not self._consuming:
            return
        log.warning(
            "the channel consuming %r closed (%s); consuming again when connected",
            self.queue,
            error,
        )
        self._recover()

    def _recover(self) -> None:
        self._consuming = False
        if self._recovery is None or self._recovery.done():
            self._recovery = asyncio.create_task(
                self._resubscribe(), name=f"mersal-rabbitmq-resubscribe-{self.queue}"
            )

    async def _resubscribe(self) -> None:
        delays = self._transport.resubscribe_delays
        failures = 0
        while True:
            await self._transport.wait_connected()
            try:
                await self._transport.restore_queue(self.queue)
                await self._subscribe()
            except Exception as error:
                if not self._transport.connected:  # not this consumer's fault: wait for it
                    await asyncio.sleep(0.1)
                    continue
                if failures == len(delays):
                    self._fail(error, failures + 1)
                    return
                log.warning(
                    "consuming %r again failed (%s: %s); retrying in %gs",
                    self.queue,
                    type(error).__name__,
                    error,
                    delays[failures],
                )
                await asyncio.sleep(delays[failures])
                failures += 1
            else:
                log.info("consuming %r again", self.queue)
                return

    def _fail(self, error: Exception, attempts: int) -> None:
        self._failure = (
            f"lost the consumer of {self.queue!r} and could not consume again in {attempts} "
            f"attempts ({type(error).__name__}: {error}); check that the queue exists"
        )
        log.error("%s", self._failure)
        self._ready.set()

    # Closing.

    async def _cancel_consumer(self) -> None:
        underlay, tag, channel = self._underlay, self._tag, self._channel
        self._consuming = False
        if underlay is None or tag is None or channel is None or channel.is_closed:
            return
        try:
            await underlay.basic_cancel(tag)
        except Exception as error:  # closing anyway; the channel's close returns everything
            log.debug("cancelling the consumer of %r failed: %s", self.queue, error)

    async def _return_buffered(self) -> None:
        while self._buffer:
            channel, message = self._buffer.popleft()
            if not channel.is_closed:
                with contextlib.suppress(Exception):
                    await _nack(message, requeue=True)

    async def _close_channel(self) -> None:
        self._transport.forget(self)
        channel, self._channel = self._channel, None
        if channel is not None:
            await _close_quietly(channel)


class RabbitMQDelivery:
    """A message received from RabbitMQ, owed exactly one ack or nack."""

    __slots__ = ("_consumer", "_message", "_settled", "envelope", "queue", "redelivered")

    def __init__(self, consumer: RabbitMQConsumer, message: DeliveredMessage) -> None:
        self._consumer = consumer
        self._message = message
        self._settled = False
        self.envelope = envelope_of(message)
        self.queue = consumer.queue
        self.redelivered = bool(message.redelivered)

    async def ack(self) -> None:
        """Remove the message from its queue; raises if its channel died (it comes back)."""
        await self._settle(partial(_ack, self._message))

    async def nack(self, requeue: bool = True) -> None:
        """Return the message to its queue; `requeue=False` lets the broker drop it."""
        await self._settle(partial(_nack, self._message, requeue=requeue))

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


# The publishing channels.


class _Publisher:
    """One pooled publishing channel and the message ids in flight on it."""

    def __init__(self, channel: AbstractChannel, underlay: aiormq.abc.AbstractChannel) -> None:
        self.channel = channel
        self.underlay = underlay
        self.in_flight: set[str] = set()
        self.retired = False

    @property
    def usable(self) -> bool:
        """Whether new publishes may use this channel."""
        return not self.retired and not self.channel.is_closed

    async def publish(self, exchange: str, routing_key: str, envelope: Envelope) -> bool:
        """Publish and wait for the confirm; False if the broker returned it as unroutable."""
        if self.channel.is_closed:
            raise aiormq.exceptions.ChannelInvalidStateError(f"{self.channel!r} closed")
        properties = amqp_properties(envelope)
        try:
            result = await self.underlay.basic_publish(
                envelope.body,
                exchange=exchange,
                routing_key=routing_key,
                properties=properties,
                mandatory=exchange != EVENTS,
            )
        except aiormq.exceptions.PublishError:
            return False
        except aiormq.exceptions.DeliveryError as error:
            raise MersalError(
                f"RabbitMQ refused {describe(envelope.headers)} ({error}): "
                "it may be short of memory or disk, or the queue is full; send it again later"
            ) from None
        return not isinstance(result, aiormq.abc.DeliveredMessage)


class _PublisherPool:
    """A few confirming channels; a closed or retired one is replaced when next needed."""

    def __init__(self, open_publisher: Callable[[], Awaitable[_Publisher]], size: int) -> None:
        self._open = open_publisher
        self._slots: list[_Publisher | None] = [None] * size
        self._turn = itertools.count()
        self._lock = asyncio.Lock()
        self._released: asyncio.Future[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()

    async def claim(self, ids: set[str]) -> _Publisher:
        """A channel with none of `ids` in flight, now marked as carrying them."""
        for publisher in self._slots:  # the common case: an open channel is free for `ids`
            if publisher is not None and publisher.usable and publisher.in_flight.isdisjoint(ids):
                publisher.in_flight |= ids
                return publisher
        while True:
            async with self._lock:
                publisher = await self._find(ids)
                if publisher is not None:
                    publisher.in_flight |= ids
                    return publisher
                if self._released is None:
                    self._released = asyncio.get_running_loop().create_future()
                released = self._released
            await released

    def release(self, publisher: _Publisher, ids: set[str]) -> None:
        """The publishes of `ids` on `publisher` are over."""
        publisher.in_flight -= ids
        if publisher.retired and not publisher.in_flight:
            task = asyncio.create_task(_close_quietly(publisher.channel))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        released, self._released = self._released, None
        if released is not None and not released.done():
            released.set_result(None)

    async def _find(self, ids: set[str]) -> _Publisher | None:
        size = len(self._slots)
        start = next(self._turn)
        for index in ((start + step) % size for step in range(size)):
            publisher = self._slots[index]
            if publisher is None or not publisher.usable:
                publisher = self._slots[index] = await self._open()
            if publisher.in_flight.isdisjoint(ids):
                return publisher
        return None


# Declarations.


@dataclass(frozen=True)
class QueueShape:
    """How a queue is declared."""

    durable: bool = True
    exclusive: bool = False
    auto_delete: bool = False
    arguments: Mapping[str, Any] = field(default_factory=dict)


def durable_shape(queue_type: str) -> QueueShape:
    """An ordinary queue: durable, of the configured type."""
    return QueueShape(arguments={"x-queue-type": queue_type})


def temporary_shape() -> QueueShape:
    """A queue that goes away with the connection."""
    return QueueShape(durable=False, exclusive=True, auto_delete=True)


def wait_shape(queue_type: str, exchange: str, routing_key: str, milliseconds: int) -> QueueShape:
    """A wait queue: holds each message `milliseconds`, then dead-letters it to its destination."""
    arguments: dict[str, Any] = {
        "x-queue-type": queue_type,
        "x-message-ttl": milliseconds,
        "x-dead-letter-exchange": exchange,
        "x-dead-letter-routing-key": routing_key,
    }
    if queue_type == "quorum":
        arguments["x-dead-letter-strategy"] = "at-least-once"
        arguments["x-overflow"] = "reject-publish"  # at-least-once dead-lettering requires it
    return QueueShape(arguments=arguments)


def wait_queue_name(exchange: str, routing_key: str, milliseconds: int) -> str:
    """`<queue>.wait.<ms>` for a send, `mersal.events.<topic>.wait.<ms>` for a publish."""
    prefix = f"{exchange}.{routing_key}" if exchange else routing_key
    return f"{prefix}.wait.{milliseconds}"


def wait_milliseconds(delay: float) -> int:
    """A delay in milliseconds rounded up to two significant digits: 1234 ms waits 1300."""
    milliseconds = max(1, math.ceil(delay * 1000))
    scale = int(10 ** max(0, len(str(milliseconds)) - 2))
    return -(-milliseconds // scale) * scale


class _Topology:
    """What this transport declared: declared on one channel, and again after a reconnect."""

    def __init__(self, open_channel: OpenChannel, queue_type: str) -> None:
        self._open_channel = open_channel
        self._queue_type = queue_type
        self._channel: AbstractChannel | None = None
        self._lock = asyncio.Lock()
        self.queues: dict[str, QueueShape] = {}
        self.bindings: dict[str, set[str]] = {}

    async def declare_exchange(self) -> None:
        """Declare the durable topic exchange that publishes go through."""
        async with self._lock:
            channel = await self._ready_channel()
            try:
                await channel.declare_exchange(EVENTS, aio_pika.ExchangeType.TOPIC, durable=True)
            except aiormq.exceptions.ChannelPreconditionFailed as error:
                raise ConfigurationError(
                    f"exchange {EVENTS!r} exists with other settings ({_reply(error)}): "
                    "delete it so that it is declared again as a durable topic exchange"
                ) from None

    async def declare(self, name: str, shape: QueueShape) -> None:
        """Declare a queue and remember it."""
        async with self._lock:
            await self._declare(name, shape)
        self.queues[name] = shape

    async def bind(self, queue: str, topic: str) -> None:
        """Bind a queue to the topic exchange and remember it."""
        async with self._lock:
            await self._bind(queue, topic)
        self.bindings.setdefault(queue, set()).add(topic)

    async def wait_queue(self, exchange: str, routing_key: str, milliseconds: int) -> str:
        """The wait queue for a destination and delay, declared on first use."""
        name = wait_queue_name(exchange, routing_key, milliseconds)
        if name in self.queues:
            return name
        async with self._lock:
            if name in self.queues:
                return name
            if not exchange and not await self._exists(routing_key):
                raise Unroutable(
                    f"no queue named {routing_key!r}: start the app that owns it, "
                    "or check the route"
                )
            shape = wait_shape(self._queue_type, exchange, routing_key, milliseconds)
            await self._declare(name, shape)
            self.queues[name] = shape
        return name

    def forget(self, name: str) -> None:
        """Declare `name` again on next use."""
        self.queues.pop(name, None)

    async def restore_queue(self, name: str) -> None:
        """Declare a remembered queue and its bindings again; nothing for others."""
        shape = self.queues.get(name)
        if shape is None:
            return
        async with self._lock:
            await self._declare(name, shape)
            for topic in sorted(self.bindings.get(name, ())):
                await self._bind(name, topic)

    async def restore(self) -> None:
        """Declare everything remembered again (after a reconnect); log what fails."""
        await _logging_failure(EVENTS, self.declare_exchange())
        for name in list(self.queues):
            await _logging_failure(name, self.restore_queue(name))

    async def _ready_channel(self) -> AbstractChannel:
        channel = self._channel
        if channel is None or channel.is_closed:
            channel = self._channel = await self._open_channel()
        return channel

    async def _declare(self, name: str, shape: QueueShape) -> None:
        channel = await self._ready_channel()
        try:
            await channel.declare_queue(
                name,
                durable=shape.durable,
                exclusive=shape.exclusive,
                auto_delete=shape.auto_delete,
                arguments=dict(shape.arguments),
            )
        except aiormq.exceptions.ChannelPreconditionFailed as error:
            raise ConfigurationError(
                f"queue {name!r} already exists with other arguments ({_reply(error)}); this "
                f"app declares it durable={shape.durable} with {dict(shape.arguments)}: delete "
                "the queue (after moving its messages) or configure the transport to match"
            ) from None
        except aiormq.exceptions.ChannelLockedResource:
            raise ConfigurationError(
                f"queue {name!r} is exclusive to another connection: choose another name"
            ) from None
        except aiormq.exceptions.ChannelAccessRefused as error:
            raise ConfigurationError(f"may not declare queue {name!r}: {_reply(error)}") from None

    async def _bind(self, queue: str, topic: str) -> None:
        channel = await self._ready_channel()
        amqp_queue = await channel.get_queue(queue, ensure=False)
        try:
            await amqp_queue.bind(EVENTS, topic)
        except aiormq.exceptions.ChannelNotFoundEntity as error:
            raise Unroutable(
                f"cannot bind queue {queue!r} to {topic!r} ({_reply(error)}): declare it first"
            ) from None

    async def _exists(self, queue: str) -> bool:
        channel = await self._ready_channel()
        try:
            await channel.declare_queue(queue, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return False
        except aiormq.exceptions.ChannelLockedResource:
            return True  # an exclusive queue of another connection: it exists
        return True


# Messages.


def amqp_properties(envelope: Envelope) -> aiormq.spec.Basic.Properties:
    """The AMQP properties: the well-known headers as properties, the others as AMQP headers."""
    headers = envelope.headers
    amqp_headers: dict[str, Any] = {
        key: value
        for key, value in headers.items()
        if key not in IN_PROPERTIES or len(value.encode()) > SHORT_STRING
    }
    return aiormq.spec.Basic.Properties(
        headers=amqp_headers,
        message_id=_short(headers.get(Header.MESSAGE_ID)),
        correlation_id=_short(headers.get(Header.CORRELATION_ID)),
        message_type=_short(headers.get(Header.TYPE)),
        reply_to=_short(headers.get(Header.REPLY_TO)),
        content_type=_short(headers.get(Header.CONTENT_TYPE)),
        timestamp=_timestamp(headers.get(Header.SENT_AT)),
        delivery_mode=PERSISTENT,
    )


def envelope_of(message: DeliveredMessage) -> Envelope:
    """Our envelope for a received message: its headers, else its properties; then its body."""
    properties = message.header.properties
    headers: dict[str, str] = {}
    for key, value in (properties.headers or {}).items():
        text = header_text(value)
        if text is not None and not key.startswith(DEAD_LETTER_HEADERS):
            headers[key] = text
    for name, header in PROPERTY_HEADERS:
        value = getattr(properties, name, None)
        if value and header not in headers:
            headers[header] = str(value)
    timestamp = properties.timestamp
    if Header.SENT_AT not in headers and isinstance(timestamp, datetime):
        headers[Header.SENT_AT] = f"{timestamp.timestamp():.6f}"
    return Envelope(headers, message.body)


async def _ack(message: DeliveredMessage) -> None:
    assert message.delivery_tag is not None
    await message.channel.basic_ack(message.delivery_tag)


async def _nack(message: DeliveredMessage, *, requeue: bool) -> None:
    assert message.delivery_tag is not None
    await message.channel.basic_nack(message.delivery_tag, requeue=requeue)


def header_text(value: object) -> str | None:
    """A header value as a string; None for values that are not scalars (lists, tables)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | Decimal):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, datetime):
        return f"{value.timestamp():.6f}"
    return None


def limits_for(connection: AbstractRobustConnection) -> Limits:
    """What this broker connection carries: headers within one frame of the size agreed on."""
    underlay = getattr(connection, "transport", None)
    tune = getattr(getattr(underlay, "connection", None), "connection_tune", None)
    frame_max = getattr(tune, "frame_max", 0) or DEFAULT_FRAME_MAX
    return Limits(max_header_bytes=frame_max - FRAME_SLACK, max_delay=MAX_WAIT_MS / 1000)


def refused_by_broker(result: BaseException | None) -> bool:
    """Whether a publish failed because the broker closed its channel in answer to a refusal."""
    return isinstance(result, OutcomeUnknown) and isinstance(result.__cause__, BROKER_REFUSALS)


def lost_channel(result: BaseException | None) -> bool:
    """Whether a publish failed because its channel closed under it (a refusal, perhaps not its
    own: several publishes share a channel)."""
    return isinstance(result, OutcomeUnknown) and isinstance(result.__cause__, CHANNEL_ERRORS)


def _result(result: BaseException | None) -> Exception | None:
    if result is None or isinstance(result, Exception):
        return result
    raise result  # a BaseException that is not an Exception: let it through


def distinct_runs(messages: Sequence[Outgoing]) -> Iterator[list[Outgoing]]:
    """Consecutive runs of messages in which no message id repeats (aio-pika #689)."""
    run: list[Outgoing] = []
    seen: set[str] = set()
    for outgoing in messages:
        message_id = outgoing.envelope.message_id
        if message_id and message_id in seen:
            yield run
            run, seen = [], set()
        run.append(outgoing)
        if message_id:
            seen.add(message_id)
    if run:
        yield run


def _short(value: str | None) -> str | None:
    """The value if it fits an AMQP short string (properties); headers carry it regardless."""
    return value if value and len(value.encode()) <= SHORT_STRING else None


def _timestamp(value: str | None) -> datetime | None:
    try:
        return datetime.fromtimestamp(float(value), tz=UTC) if value else None
    except (ValueError, OverflowError, OSError):
        return None


def _reply(error: BaseException) -> str:
    """The broker's reply text without its code prefix."""
    text = str(error)
    return text.partition(" - ")[2] or text


async def _logging_failure(name: str, declaration: Awaitable[None]) -> None:
    try:
        await declaration
    except Exception as error:  # a consumer of the queue declares it again itself
        log.warning("declaring %r again failed: %s: %s", name, type(error).__name__, error)


async def _close_quietly(channel: AbstractChannel) -> None:
    try:
        await channel.close()
    except Exception as error:  # it is going away either way
        log.debug("closing a channel failed: %s", error)


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is not None and not task.done() and task is not asyncio.current_task():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
