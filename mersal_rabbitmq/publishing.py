"""Confirmed publishing: a pool of channels, one message id in flight per channel, isolation.

Publishing uses a small pool of plain channels with publisher confirms and `on_return_raises`
(not `aio_pika.pool.Pool`, which keeps closed channels, aio-pika #670); a closed channel is
replaced when next needed. One message id is never in flight twice on one channel (aio-pika
#689): a batch is split into runs without a repeated id, and a channel whose publish timed out
or was cancelled is retired. A message whose channel the broker closed under it (a refusal,
perhaps of another message on that channel) is published again alone, on a channel of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from functools import partial

import aiormq
from aio_pika.abc import AbstractChannel

from mersal.errors import ConfigurationError, MersalError, OutcomeUnknown, Unroutable, Unsendable
from mersal.messages import Envelope, describe
from mersal.transport import Outgoing
from mersal.transport.limits import Limits, problem_of
from mersal.urls import mask
from mersal_rabbitmq.channels import close_quietly
from mersal_rabbitmq.connection import Connection
from mersal_rabbitmq.delays import MAX_WAIT_MS, wait_milliseconds
from mersal_rabbitmq.failures import CHANNEL_ERRORS, closed_under, why
from mersal_rabbitmq.topology import (
    EVENTS,
    PLUGIN_HINT,
    Topology,
    missing_plugin,
    partition_routing_key,
)
from mersal_rabbitmq.wire import amqp_properties

log = logging.getLogger("mersal.rabbitmq")

BROKER_REFUSALS = (
    aiormq.exceptions.ChannelPreconditionFailed,
    aiormq.exceptions.ChannelAccessRefused,
    aiormq.exceptions.ChannelNotFoundEntity,
)
"""Channel closes with which RabbitMQ refuses what a publish carried (406, 403, 404)."""


class Publisher:
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

    async def publish(
        self, exchange: str, routing_key: str, envelope: Envelope, *, mandatory: bool = True
    ) -> bool:
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
                mandatory=mandatory,
            )
        except aiormq.exceptions.PublishError:
            return False
        except aiormq.exceptions.DeliveryError as error:
            # A quorum queue refuses while it elects a leader, and a channel that published
            # then can go on being refused after the election: the next publish takes another.
            self.retired = True
            raise MersalError(
                f"RabbitMQ refused {describe(envelope.headers)} ({error}): "
                "it may be short of memory or disk, the queue may be full, or a quorum queue "
                "electing a leader; send it again later"
            ) from None
        except BaseException as error:
            lost = closed_under(error, self.channel.is_closed, "the channel closed under it")
            if lost is None:
                raise
            raise lost from error
        return not isinstance(result, aiormq.abc.DeliveredMessage)


class PublisherPool:
    """A few confirming channels; a closed or retired one is replaced when next needed."""

    def __init__(self, open_publisher: Callable[[], Awaitable[Publisher]], size: int) -> None:
        self._open = open_publisher
        self._slots: list[Publisher | None] = [None] * size
        self._turn = itertools.count()
        self._lock = asyncio.Lock()
        self._released: asyncio.Future[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()

    def claim_now(self, ids: set[str]) -> Publisher | None:
        """An open channel with none of `ids` in flight, marked as carrying them; else None."""
        for publisher in self._slots:
            if publisher is not None and publisher.usable and publisher.in_flight.isdisjoint(ids):
                publisher.in_flight |= ids
                return publisher
        return None

    async def claim(self, ids: set[str]) -> Publisher:
        """A channel with none of `ids` in flight, now marked as carrying them."""
        publisher = self.claim_now(ids)  # the common case: an open channel is free for `ids`
        if publisher is not None:
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

    def release(self, publisher: Publisher, ids: set[str]) -> None:
        """The publishes of `ids` on `publisher` are over."""
        publisher.in_flight -= ids
        if publisher.retired and not publisher.in_flight:
            task = asyncio.create_task(close_quietly(publisher.channel))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        released, self._released = self._released, None
        if released is not None and not released.done():
            released.set_result(None)

    async def _find(self, ids: set[str]) -> Publisher | None:
        size = len(self._slots)
        start = next(self._turn)
        for index in ((start + step) % size for step in range(size)):
            publisher = self._slots[index]
            if publisher is None or not publisher.usable:
                publisher = self._slots[index] = await self._open()
            if publisher.in_flight.isdisjoint(ids):
                return publisher
        return None


class Publishing:
    """Publishes with confirms on pooled channels and reports each message's own outcome."""

    def __init__(
        self,
        connection: Connection,
        topology: Topology,
        *,
        channels: int,
        publish_timeout: float,
        confirms: bool,
        unheard: set[str] | None = None,
    ) -> None:
        self._connection = connection
        self._topology = topology
        self._publish_timeout = publish_timeout
        self._confirms = confirms
        self._pool = PublisherPool(self._open_publisher, channels)
        self._unheard = unheard if unheard is not None else set()
        """The topics already warned of: events published that no queue took."""

    async def send_each(
        self, messages: Sequence[Outgoing], limits: Limits
    ) -> list[Exception | None]:
        """Publish what fits `limits`, in order; for each, None once confirmed, or why not.

        A message the broker answered by closing the channel (it refused something in it) had
        company on that channel: each such message is published again alone, on a channel of
        its own, so that only the one the broker refuses is reported as refused.
        """
        results: list[Exception | None] = [None] * len(messages)
        carried: list[int] = []
        for index, outgoing in enumerate(messages):
            problem = problem_of(outgoing, limits)
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
        deadline = asyncio.get_running_loop().time() + self._publish_timeout
        for index, result in enumerate(results):
            if result is not None and not isinstance(result, Unsendable):
                results[index] = await self._send_alone(messages[index], deadline)

    async def _send_run(self, run: Sequence[Outgoing]) -> list[Exception | None]:
        """Publish messages with distinct ids on one channel; each one's result."""
        ids = {o.envelope.message_id for o in run if o.envelope.message_id}
        deadline = asyncio.get_running_loop().time() + self._publish_timeout
        try:
            publisher = self._pool.claim_now(ids)
            if publisher is None:
                async with asyncio.timeout_at(deadline):
                    publisher = await self._claim(ids)
        except TimeoutError:
            unknown = OutcomeUnknown(
                f"no channel to publish on within {self._publish_timeout:g}s: "
                f"is RabbitMQ at {mask(self._connection.address)} reachable? Send again"
            )
            return [unknown] * len(run)
        try:
            results = await _each(self._publish(publisher, outgoing, deadline) for outgoing in run)
        except asyncio.CancelledError:
            publisher.retired = True  # confirms may still arrive for what was written
            raise
        finally:
            self._pool.release(publisher, ids)
        return [_result(result) for result in results]

    async def _send_alone(self, outgoing: Outgoing, deadline: float) -> Exception | None:
        """Publish one message on a channel of its own: the broker's refusal is then its own.

        An event refused because the events exchange is gone (deleted) is published again
        once the exchange and this transport's bindings are declared again.
        """
        result = await self._send_alone_once(outgoing, deadline)
        if not (outgoing.publish and missing_exchange(result, EVENTS)):
            return result
        try:
            async with asyncio.timeout_at(deadline):
                await self._topology.restore_events()
        except (TimeoutError, MersalError) as error:
            return OutcomeUnknown(
                f"exchange {EVENTS!r} is gone and declaring it again failed ({why(error)}): "
                "send it again"
            )
        log.warning(
            "exchange %r was gone (deleted?): declared it again, with this app's bindings; the "
            "queues of other apps lost their bindings to it, and the events they subscribe to "
            "reach them again once they restart or reconnect",
            EVENTS,
        )
        return await self._send_alone_once(outgoing, deadline)

    async def _send_alone_once(self, outgoing: Outgoing, deadline: float) -> Exception | None:
        try:
            async with asyncio.timeout_at(deadline):
                publisher = await _until_connected(self._open_publisher)
        except (TimeoutError, *CHANNEL_ERRORS) as error:
            return OutcomeUnknown(
                f"no channel to publish on ({type(error).__name__}: {error}); send again"
            )
        try:
            await self._publish(publisher, outgoing, deadline)
        except OutcomeUnknown as error:
            gone = isinstance(error.__cause__, aiormq.exceptions.ChannelNotFoundEntity)
            if gone and _keyed(outgoing) and self._topology.forget_partitions(outgoing.address):
                return OutcomeUnknown(
                    f"the exchange of the partitions of {outgoing.address!r} is gone (deleted, "
                    "or being made again): send it again"
                )
            if outgoing.publish and missing_exchange(error, EVENTS):
                return error
            return refusal(outgoing, error)
        except MersalError as error:
            return error
        finally:
            await close_quietly(publisher.channel)
        return None

    async def _open_publisher(self) -> Publisher:
        channel = await self._connection.channel(confirms=self._confirms)
        return Publisher(channel, await channel.get_underlay_channel())

    async def _claim(self, ids: set[str]) -> Publisher:
        """A publishing channel for `ids`, trying again while the connection comes back."""
        return await _until_connected(partial(self._pool.claim, ids))

    async def _publish(self, publisher: Publisher, outgoing: Outgoing, deadline: float) -> None:
        try:
            async with asyncio.timeout_at(deadline):
                await self._deliver(publisher, outgoing)
        except TimeoutError:
            publisher.retired = True  # its confirm (or return) may still come on this channel
            raise OutcomeUnknown(
                f"{_what(outgoing)} was not confirmed within {self._publish_timeout:g}s; "
                "send it again (the receiver's inbox drops duplicates)"
            ) from None
        except CHANNEL_ERRORS as error:
            raise OutcomeUnknown(
                f"{_what(outgoing)} lost its channel before a confirm "
                f"({type(error).__name__}: {error}); send it again"
            ) from error

    async def _deliver(self, publisher: Publisher, outgoing: Outgoing) -> None:
        exchange, routing_key, waiting = await self.destination(outgoing)
        mandatory = exchange != EVENTS or self._listening(routing_key)
        if await publisher.publish(exchange, routing_key, outgoing.envelope, mandatory=mandatory):
            return
        if waiting:  # the wait queue was deleted since it was declared: declare it again, once
            self._topology.forget(routing_key)
            exchange, routing_key, _ = await self.destination(outgoing)
            if await publisher.publish(exchange, routing_key, outgoing.envelope):
                return
        elif outgoing.publish:  # an event nobody subscribes to is fine: say so, once
            self._nobody_subscribes(outgoing.address)
            return
        elif exchange != "":  # a partitions' exchange without partitions: being made again
            self._topology.forget_partitions(outgoing.address)
            raise OutcomeUnknown(
                f"no partition of {outgoing.address!r} took {_what(outgoing)} (their exchange "
                "is being made again?): send it again"
            )
        raise Unroutable(
            f"no queue named {outgoing.address!r}: start the app that owns it, or check the route"
        )

    def _listening(self, topic: str) -> bool:
        """Whether to publish an event `mandatory`, to hear that no queue takes it.

        Only with confirms (without, aiormq logs a return as an error), and only until the
        warning for its topic is out: a returned body costs the client time to read.
        """
        return self._confirms and topic not in self._unheard

    def _nobody_subscribes(self, topic: str) -> None:
        if topic not in self._unheard:
            self._unheard.add(topic)
            log.warning(
                "no queue subscribes to %s: nobody receives it (an app receives these events "
                "from the time it calls app.subscribe for them and starts); said once per type",
                topic,
            )

    async def destination(self, outgoing: Outgoing) -> tuple[str, str, bool]:
        """The exchange and routing key to publish to, and whether that is a wait queue."""
        exchange = EVENTS if outgoing.publish else ""
        delay = outgoing.delay
        if delay <= 0:
            key = outgoing.envelope.partition_key
            if key is not None and not outgoing.publish:
                partitions = await self._topology.partitioned(outgoing.address)
                if partitions is not None:
                    return partitions, partition_routing_key(key), False
            return exchange, outgoing.address, False
        milliseconds = wait_milliseconds(delay)
        if milliseconds > MAX_WAIT_MS:
            raise Unsendable(
                f"a delay of {delay:.0f}s is over the {MAX_WAIT_MS // 1000}s RabbitMQ can wait"
            )
        queue = await self._topology.wait_queue(exchange, outgoing.address, milliseconds)
        return "", queue, True


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


def refusal(outgoing: Outgoing, error: OutcomeUnknown) -> Exception:
    """What a publish sent alone failed with: the broker's refusal of it, if it was one.

    A node without the consistent-hash plugin refuses what goes through a partitions' exchange
    (declared from a node that has it): a setting of the broker, so the message is kept to be
    sent again once the plugin is on, not refused for good.
    """
    if not refused_by_broker(error):
        return error
    if missing_plugin(error.__cause__):
        return ConfigurationError(
            f"RabbitMQ cannot route {describe(outgoing.envelope.headers)} to the partitions of "
            f"{outgoing.address!r} ({error.__cause__}): the node lacks the consistent-hash "
            f"exchange plugin; {PLUGIN_HINT}"
        )
    return Unsendable(
        f"RabbitMQ refused {describe(outgoing.envelope.headers)} to "
        f"{outgoing.address!r} and closed the channel: {error.__cause__}"
    )


def missing_exchange(result: BaseException | None, exchange: str) -> bool:
    """Whether a publish failed because the broker has no exchange named `exchange`."""
    cause = result.__cause__ if isinstance(result, OutcomeUnknown) else None
    return isinstance(
        cause, aiormq.exceptions.ChannelNotFoundEntity
    ) and f"exchange '{exchange}'" in str(cause)


def refused_by_broker(result: BaseException | None) -> bool:
    """Whether a publish failed because the broker closed its channel in answer to a refusal."""
    return isinstance(result, OutcomeUnknown) and isinstance(result.__cause__, BROKER_REFUSALS)


def lost_channel(result: BaseException | None) -> bool:
    """Whether a publish failed because its channel closed under it (perhaps at another refusal)."""
    return isinstance(result, OutcomeUnknown) and isinstance(result.__cause__, CHANNEL_ERRORS)


async def _until_connected(opening: Callable[[], Awaitable[Publisher]]) -> Publisher:
    """A publishing channel, trying again while the connection comes back (callers time out)."""
    while True:
        try:
            return await opening()
        except CHANNEL_ERRORS as error:
            log.debug("no publishing channel yet (%s)", why(error))
            await asyncio.sleep(0.1)


def _keyed(outgoing: Outgoing) -> bool:
    """Whether `outgoing` went through a partitions' exchange, if its queue has one."""
    return outgoing.envelope.partition_key is not None and not outgoing.publish


def _what(outgoing: Outgoing) -> str:
    return f"{describe(outgoing.envelope.headers)} to {outgoing.address!r}"


def _result(result: BaseException | None) -> Exception | None:
    if result is None or isinstance(result, Exception):
        return result
    raise result  # a BaseException that is not an Exception: let it through


async def _each(publishes: Iterable[Awaitable[None]]) -> list[BaseException | None]:
    """Await the publishes concurrently; each one's exception, or None. One needs no task."""
    pending = list(publishes)
    if len(pending) != 1:
        return await asyncio.gather(*pending, return_exceptions=True)
    try:
        await pending[0]
    except Exception as error:
        return [error]
    return [None]
