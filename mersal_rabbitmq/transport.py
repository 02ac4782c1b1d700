"""The RabbitMQ transport (`amqp://…`): aio-pika underneath, the memory transport's semantics.

It configures and composes the parts, each in a module of its own:

- `connection`: the connection, reconnected across the nodes of a list (failover);
- `channels`: plain channels, and the restored channels (aio-pika's robust ones) of consumers;
- `recovery`: bringing one lost object back, a bounded number of times;
- `topology`: the events exchange, queues, bindings and wait queues, declared and remembered;
- `delays`: how a delay becomes a wait queue;
- `publishing`: confirmed publishes on a pool of channels;
- `consuming`: consumers, their deliveries, and consuming again after a loss;
- `wire`: envelopes to and from AMQP properties and headers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace

from aio_pika.abc import AbstractChannel, AbstractConnection

from mersal.dead_letters import LookingWouldLose
from mersal.errors import ConfigurationError, MersalError
from mersal.inspection import WAIT, QueueReport, QueueStatus
from mersal.messages import check_type_name
from mersal.transport import Outgoing, first_failure, partition_queue
from mersal.transport.limits import Limits
from mersal.urls import mask
from mersal_rabbitmq.channels import close_quietly
from mersal_rabbitmq.connection import Connection
from mersal_rabbitmq.consuming import ACK_MODES, RESUBSCRIBE_DELAYS, Consumers, RabbitMQConsumer
from mersal_rabbitmq.delays import MAX_WAIT_MS, retry_wait_queues, waiting_for
from mersal_rabbitmq.failures import CHANNEL_ERRORS, why
from mersal_rabbitmq.management import ENABLE, Management, ManagementUnavailable, delivery_limit
from mersal_rabbitmq.publishing import Publishing
from mersal_rabbitmq.recovery import Recovery
from mersal_rabbitmq.topology import (
    EVENTS,
    QUEUE_TYPES,
    Topology,
    durable_shape,
    shared_temporary_shape,
    temporary_shape,
)
from mersal_rabbitmq.urls import take_option
from mersal_rabbitmq.wire import broker_version, limits_for

log = logging.getLogger("mersal.rabbitmq")

TO_CLASSIC = (
    "Move it to a classic queue, which has no delivery limit (an error queue is classic by "
    "default; stop the apps that consume it, if any): `mersal queues migrate --queue {queue} "
    "--to classic --transport URL`; or remove the limit"
)
PRUNE_WAIT = 5.0
"""Seconds a start waits for the management API to list its queue's bindings."""


class RabbitMQTransport:
    """The `amqp://` transport: queues, topics, confirmed publishes and wait queues on RabbitMQ.

    `url` is one broker's URL, or several nodes' URLs separated by `;` for failover: the
    transport connects to the first that answers and moves on to the next when it goes down.
    URL query parameters go to aio-pika (`heartbeat`, `name`, TLS options), except
    `queue_type` and `reconnect_interval` (the first pause between rounds of reconnect attempts,
    1 second by default, doubled after each round up to 30 s).

    Queues are quorum queues (`queue_type="quorum"`, the default; RabbitMQ 3.10 or later):
    replicated across a cluster's nodes, with wait queues that dead-letter at least once.
    `queue_type="classic"` (or `?queue_type=classic` in the URL) keeps classic queues.

    `ack_mode="manual"` (the default) acks a delivery after it was handled. `"on_receive"` acks
    it as it arrives and `"none"` consumes without acks: faster, but a crash (or a stop) loses
    what was received and not yet handled. `fire_and_forget=True` publishes without confirms:
    faster, but a lost or unroutable message goes unnoticed. With confirms, an event published
    that no queue receives is logged as a WARNING, once per type, and is not an error.

    `shared_temporaries=S` declares temporary queues that other connections may consume (the
    AMQP 1.0 transport's consumers): not exclusive, deleted when this transport stops, or by
    the broker S seconds after they were last used if it never does.
    """

    resubscribe_delays: Sequence[float] = RESUBSCRIBE_DELAYS
    """The pauses between a lost consumer's attempts to consume again; then `get()` raises."""

    def __init__(
        self,
        url: str,
        *,
        queue_type: str | None = None,
        heartbeat: int | None = None,
        publish_timeout: float = 10.0,
        channels: int = 4,
        ack_mode: str = "manual",
        fire_and_forget: bool = False,
        shared_temporaries: float | None = None,
    ) -> None:
        url, from_url = take_option(url, "queue_type")
        if queue_type is None:
            queue_type = from_url or "quorum"
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
        self.shared_temporaries = shared_temporaries
        self.fire_and_forget = fire_and_forget
        self.address = url
        self.queue_type = queue_type
        self.heartbeat = heartbeat
        self.publish_timeout = publish_timeout
        self.channels = channels
        self.limits = Limits(max_delay=MAX_WAIT_MS / 1000)
        self._unheard: set[str] = set()  # event types published to no queue, warned of once
        self._compose()

    def _compose(self) -> None:
        """Fresh parts: no connection, nothing declared, no channels, no consumers."""
        self._link = Connection(self.address)
        self._topology = Topology(self._link, self.queue_type)
        self._publishing = Publishing(
            self._link,
            self._topology,
            channels=self.channels,
            publish_timeout=self.publish_timeout,
            confirms=not self.fire_and_forget,
            unheard=self._unheard,
        )
        self._consumers = Consumers(self._link, self._topology, self.ack_mode)
        self._redeclaring = Recovery(self._link, "declaring the topology", self._topology.restore)
        self._link.on_reconnect = self._redeclaring.ask

    def __repr__(self) -> str:
        return f"<RabbitMQTransport {mask(self.address)}>"

    @property
    def queues(self) -> list[str]:
        """The queues this transport declared, wait queues included."""
        return list(self._topology.queues)

    @property
    def connected(self) -> bool:
        """Whether the connection to RabbitMQ is up right now."""
        return self._link.connected

    @property
    def node(self) -> str:
        """The node connected to (URL, password masked): one of the `;`-separated list."""
        return self._link.node

    @property
    def _connection(self) -> AbstractConnection | None:  # read by tests/soak/
        return self._link.current

    # The Transport protocol.

    async def start(self) -> None:
        """Connect, and declare the topic exchange that publishes go through."""
        if self._link.current is not None:
            return
        self._compose()
        connection = await self._link.open(self.heartbeat)
        self.limits = limits_for(connection)
        try:
            await self._topology.start()
        except BaseException:
            await self.stop()
            raise
        log.info("connected to RabbitMQ at %s", self._link.node)

    async def stop(self) -> None:
        """Disconnect: unacknowledged deliveries return to their queues."""
        await self._consumers.abandon()
        await self._redeclaring.cancel()
        if self.shared_temporaries is not None and self._link.connected:
            await self._delete_temporaries()
        await self._link.close()

    async def _delete_temporaries(self) -> None:
        """Delete the shared temporary queues declared here (exclusive ones go by themselves)."""
        names = [name for name, shape in self._topology.queues.items() if not shape.durable]
        if not names:
            return
        try:
            channel = await self._link.channel()
            try:
                for name in names:
                    await channel.queue_delete(name)
            finally:
                await close_quietly(channel)
        except CHANNEL_ERRORS as error:
            log.warning("could not delete temporary queues %s: %s", ", ".join(names), why(error))

    async def declare(self, queue: str, *, temporary: bool = False, partitions: int = 0) -> None:
        """Make sure `queue` exists; a temporary one goes away with the connection.

        With `partitions`, sends with a partition key to `queue` are split over that many
        ordered partitions (see `mersal_rabbitmq.topology`), which `consume(queue)` takes too.
        """
        self._link.require()
        if not temporary:
            shape = durable_shape(self.queue_type)
        elif self.shared_temporaries is not None:
            shape = shared_temporary_shape(self.shared_temporaries)
        else:
            shape = temporary_shape()
        await self._topology.declare(queue, shape)
        if partitions:
            if temporary:
                raise ConfigurationError(f"temporary queue {queue!r} cannot have partitions")
            await self._topology.partition(queue, partitions)

    async def declare_error_queue(self, queue: str) -> None:
        """Make sure the error queue `queue` exists: a durable classic queue, whatever queue_type.

        Operators look at dead letters by taking them and giving them back; a quorum queue
        counts each return as a delivery and drops the message past its delivery limit, a
        classic one has none (but is not replicated on a cluster). An error queue that exists
        as a quorum queue is used as it is, with a warning.
        """
        self._link.require()
        await self._topology.declare_error_queue(queue)

    async def check_give_back(self, queue: str, management: str | None = None) -> None:
        """Raise LookingWouldLose if messages of `queue` given back could be dropped.

        A quorum queue counts every return as a delivery, and drops or dead-letters a message
        past its delivery limit (a policy's `delivery-limit` or `x-delivery-limit`; 20 by
        default on RabbitMQ 4). The management API (`management`, default
        http://<host>:15672) tells the queue's type and limit; without it, only a queue that
        is classic passes (and a queue the API does not list yet). A missing queue passes:
        consuming it says so.
        """
        self._link.require()
        api = self.management_api(management)
        try:
            info = await api.queue(queue)
        except ManagementUnavailable as error:
            if await self._topology.of_type(queue, "classic") is not False:
                return
            raise LookingWouldLose(
                queue,
                f"it is not a classic queue, and without the management API ({error}) there "
                "is no telling whether a delivery limit drops the messages given back after "
                f"a look. {TO_CLASSIC.format(queue=queue)}",
            ) from None
        if info is None:  # missing, or too new for the API's statistics (every 5 s)
            if await self._topology.of_type(queue, "classic") is not False:
                return
            raise LookingWouldLose(
                queue,
                "it is not a classic queue, and the management API does not list it yet, so "
                "there is no telling whether a delivery limit drops the messages given back "
                f"after a look: run this again in a few seconds. {TO_CLASSIC.format(queue=queue)}",
            )
        if info.get("type") != "quorum":
            return
        limit = delivery_limit(info, broker_version(self._link.current))
        if limit is None:
            return
        raise LookingWouldLose(
            queue,
            f"it is a quorum queue with a delivery limit of {limit} (a policy's delivery-limit "
            "or its x-delivery-limit argument; RabbitMQ 4 sets 20 when none is set), and "
            "RabbitMQ counts every message given back after a look as a delivery, dropping it "
            f"past the limit. {TO_CLASSIC.format(queue=queue)}",
        )

    async def bind(self, queue: str, topic: str) -> None:
        """Deliver messages published on `topic` to `queue` too."""
        self._link.require()
        if wildcard(topic):
            raise ConfigurationError(f"topic {topic!r} has a wildcard word ('*' or '#')")
        await self._topology.bind(queue, topic)

    async def prune_bindings(self, queue: str, topics: Collection[str]) -> None:
        """Unbind `queue` from the events exchange's topics not in `topics` (each logged).

        A binding from an earlier start outlives a dropped subscription. The management API
        lists them; when it cannot, a WARNING says what to do. Only a binding that Mersal could
        have made is removed: from the events exchange, keyed with a type name (no wildcard
        word), without arguments. Others (partitions, the user's own) are left alone.
        """
        self._link.require()
        api = self.management_api()
        try:
            async with asyncio.timeout(PRUNE_WAIT):
                bound = await api.plain_bindings(queue)
        except (ManagementUnavailable, TimeoutError) as error:
            _warn_unpruned(queue, topics, api, str(error) or f"no answer within {PRUNE_WAIT:g}s")
            return
        for exchange, topic in bound:
            if exchange == EVENTS and topic not in topics and subscribable(topic):
                await self._topology.unbind(queue, topic)
                log.info(
                    "unbound queue %r from %s %r: nothing there subscribes to it any more",
                    queue,
                    EVENTS,
                    topic,
                )

    async def send(self, messages: Sequence[Outgoing]) -> None:
        """Publish all messages, in order, each confirmed by the broker within publish_timeout."""
        first_failure(await self.send_each(messages))

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        """Publish every message it can carry, in order; for each, None once confirmed, or why."""
        self._link.require()
        return await self._publishing.send_each(messages, self.limits)

    async def consume(self, queue: str, *, prefetch: int) -> RabbitMQConsumer:
        """Start receiving from an existing `queue`, at most `prefetch` unacknowledged.

        A queue declared with partitions is consumed with them; one that has partitions
        declared elsewhere is refused: keyed sends would go to partitions nobody consumes.
        """
        await self.consumed_queues(queue)
        return await self._consumers.consume(queue, prefetch, self.resubscribe_delays)

    def management_api(self, management: str | None = None) -> Management:
        """The management API: `management`, or that of the node connected to (then the others)."""
        node = self._link.nodes[self._link.index] if self._link.connected else None
        return Management.of(self.address, management, node=node)

    # Parts for callers that work below the Transport protocol (the AMQP 1.0 transport too).

    async def consumed_queues(self, queue: str) -> list[str]:
        """The queues that consuming `queue` takes from: `queue`, then its partitions.

        A queue that has partitions declared elsewhere is refused: keyed sends would go to
        partitions nobody consumes.
        """
        self._link.require()
        shape = self._topology.queues.get(queue)
        temporary = shape is not None and not shape.durable
        if queue not in self._topology.partitions and not temporary:
            exchange = await self._topology.partitioned(queue)
            if exchange is not None:
                raise ConfigurationError(
                    f"queue {queue!r} has partitions (exchange {exchange!r}), and this app "
                    "declares none: keyed sends would wait in partitions nobody consumes. Keep "
                    "App(partitions=N) as it was, or stop every instance, move the messages of "
                    f"{queue}.partition.* into {queue!r} and delete them and the exchange"
                )
        count = self._topology.partitions.get(queue, 0)
        return [queue, *(partition_queue(queue, index) for index in range(count))]

    async def route(self, outgoing: Outgoing) -> tuple[str, str]:
        """The exchange ('' for the default one) and routing key that `outgoing` goes to.

        A delayed message goes to its wait queue (declared here if need be), a keyed one to
        its queue's partitions, an event to the events exchange.
        """
        self._link.require()
        exchange, routing_key, _ = await self._publishing.destination(outgoing)
        return exchange, routing_key

    async def exists(self, queue: str) -> bool:
        """Whether `queue` exists on the broker (nothing is made)."""
        self._link.require()
        return await self._topology.exists(queue)

    def forget(self, consumer: RabbitMQConsumer) -> None:
        """A consumer is done (closed, every delivery settled): stop tracking it."""
        self._consumers.forget(consumer)

    async def wait_connected(self) -> None:
        """Wait until the connection is up (it reconnects by itself)."""
        await self._link.ready()

    async def open_channel(self, *, confirms: bool = False) -> AbstractChannel:
        """A new plain channel (not restored: its owner replaces it), once connected."""
        return await self._link.channel(confirms=confirms)

    async def restore_queue(self, queue: str) -> None:
        """Declare `queue` and its bindings again, if this transport declared it."""
        await self._topology.restore_queue(queue)

    # For `mersal status`.

    async def queue_status(
        self,
        names: Sequence[str],
        *,
        waits_of: Sequence[str] = (),
        delays: Sequence[float] = (),
        management: str | None = None,
    ) -> QueueReport:
        """Ready, unacked and consumer counts of `names`, then of the wait queues of `waits_of`.

        It only looks: passive declarations for ready messages and consumers, the management
        API (`management`, default http://<host>:15672) for unacked ones, None when it does not
        answer. A transport never started looks over a connection of its own.
        """
        api = self.management_api(management)
        async with self._looking() as topology:
            view = await api.look(names, waits_of)
            waits = _wait_queues(waits_of, delays, view.waits, set(names))
            try:
                counted = await topology.count([*names, *waits])
            except CHANNEL_ERRORS as error:
                raise MersalError(
                    f"lost the connection to RabbitMQ at {mask(self.address)}: {why(error)}"
                ) from None
        queues = [replace(counted[name], unacked=view.unacked.get(name)) for name in names]
        queues += [
            replace(counted[name], unacked=view.unacked.get(name), role=WAIT, wait_of=queue)
            for name in waits
            if counted[name].exists and (queue := name.rpartition(".wait.")[0])
        ]
        return QueueReport(queues, view.note or _uncounted(queues))

    @asynccontextmanager
    async def _looking(self) -> AsyncIterator[Topology]:
        """The topology; while not started, one on a connection of its own, closed after."""
        if self._link.current is not None:
            yield self._topology
            return
        link = Connection(self.address)
        await link.open(self.heartbeat)
        try:
            yield Topology(link, self.queue_type)
        finally:
            await link.close()


def wildcard(topic: str) -> bool:
    """Whether `topic` has a word that matches others in topic routing ('*' or '#')."""
    return any(word in ("*", "#") for word in topic.split("."))


def subscribable(topic: str) -> bool:
    """Whether `topic` could be a type name that an app subscribed to (what `bind` binds)."""
    try:
        check_type_name(topic)
    except ConfigurationError:
        return False
    return not wildcard(topic)


def _warn_unpruned(queue: str, topics: Collection[str], api: Management, reason: str) -> None:
    """Say that bindings of dropped subscriptions may remain, and how to find and remove them."""
    kept = ", ".join(sorted(topics)) or "(none)"
    log.warning(
        "cannot list the bindings of queue %r (%s), so any binding of an event type it no "
        "longer subscribes to stays, and those events keep arriving and are dead-lettered as "
        "an unknown type. Enable the management API at %s (rabbitmq-plugins enable "
        "rabbitmq_management, and a management or monitoring tag for user %r) and each start "
        "removes them; or list them (rabbitmqctl list_bindings -p %s source_name "
        "destination_name routing_key) and unbind those from %s to %r whose routing key is "
        "not one of: %s",
        queue,
        reason.removesuffix(f": {ENABLE}"),
        api.base,
        api.user,
        api.vhost,
        EVENTS,
        queue,
        kept,
    )


def _wait_queues(
    waits_of: Sequence[str], delays: Sequence[float], listed: Sequence[str], names: set[str]
) -> list[str]:
    """The wait queues to count: those delayed retries use, those the broker lists; by delay."""
    found = {name for queue in waits_of for name in retry_wait_queues(queue, delays)}
    found.update(name for name in listed if waiting_for(name) is not None)
    return sorted(found - names, key=lambda name: waiting_for(name) or (name, 0))


def _uncounted(queues: Sequence[QueueStatus]) -> str | None:
    """A word when the management API has not counted some queue yet."""
    if any(queue.exists and queue.unacked is None for queue in queues):
        return "the management API has not counted every queue yet (it does every 5 s): run again"
    return None
