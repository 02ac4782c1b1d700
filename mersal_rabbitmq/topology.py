"""The broker-side topology: the events exchange, queues and their shapes, bindings, wait queues.

A send goes through the default exchange (routing key = queue name) with `mandatory`, so a send
to a missing queue raises `Unroutable`. A publish goes to one durable topic exchange,
`mersal.events`, with the message type name as routing key: an event nobody subscribes to is
fine, but with confirms it is published `mandatory` until the broker first returns one of its
type, which the publisher logs once. `bind(queue, topic)` binds with that exact name. Type names
contain dots, which separate words in topic routing, but a binding key without wildcards still
only matches itself.
Queues are durable with `x-queue-type` = `queue_type` (quorum unless the transport says
classic): replicated on a cluster, and their wait queues dead-letter at least once. Error
queues are classic whatever `queue_type` says (see `declare_error_queue`), and one that exists
as quorum is used as it is. A temporary
queue is an exclusive, auto-delete, non-durable classic queue that goes away with the
connection. A queue that exists with the other type fails the declaration with the command that
migrates it; a wait queue of the other type (left by an earlier version) is used as it is.

A partitioned queue (`declare(queue, partitions=N)`) also has a consistent-hash exchange,
`<queue>.partitions` (plugin rabbitmq_consistent_hash_exchange), and N queues
`<queue>.partition.<i>` bound to it with equal weight, each with a single active consumer: a
send with a partition key goes through the exchange, which hashes the key (the routing key) to
one partition, so that one consumer at a time, whichever instance it is in, takes each key in
order. A sender learns that a queue is partitioned by looking for its exchange (again after
PARTITIONED_RECHECK seconds while it is not, and after the exchange was deleted); while
`mersal queues migrate` moves partitions, its exchange `<queue>.partitions.migrating` exists
and a keyed send fails with `PartitionsMigrating` (the outbox sends it again later). The ring
numbers partitions in the order they were bound, and a deleted queue's binding renumbers the
rest: a partition declared again (deleted while the app runs, or found missing at start) would
be bound last and move keys for good, so the exchange is made again with every partition bound
in order, behind the same marker, by one connection at a time (it holds the exclusive queue
`<queue>.partitions.lock`, as `mersal queues migrate` does while its marker exists). Keyed
sends of this process wait meanwhile; another instance that owns the partitions looks for the
marker before a keyed send, at most every MARKER_RECHECK seconds, and then fails it with
`PartitionsMigrating` (in between, it may send through the half-made ring). A marker whose lock
nobody holds is a rebuild cut short: a starting instance, a restore or such a keyed send takes
the lock and finishes it. A keyed send that meets the exchange missing or without partitions
fails with `OutcomeUnknown`, to be sent again.

Everything is declared on one plain channel, replaced when an error closed it (RabbitMQ closes
it on a 406), and remembered: the transport declares it all again after every reconnect, and a
consumer its own queues before it consumes again. Not aio-pika's robust channel, which would
declare again what it remembers too: it restores one channel all or nothing (a queue that
cannot be declared again, a classic queue whose node is down, keeps everything after it from
coming back) and binds a partition declared again last, which moves keys to other partitions.
Here each declaration that fails to come back is logged on its own, and the ring of partitions
is made again in order.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel

from mersal.errors import ConfigurationError, MersalError, Unreachable, Unroutable
from mersal.inspection import QueueStatus
from mersal.transport import partition_queue
from mersal.urls import mask
from mersal_rabbitmq.channels import close_quietly
from mersal_rabbitmq.connection import Connection
from mersal_rabbitmq.delays import wait_queue_name
from mersal_rabbitmq.failures import closed_under, why

log = logging.getLogger("mersal.rabbitmq")

EVENTS = "mersal.events"
"""The durable topic exchange every publish goes through."""
QUEUE_TYPES = ("classic", "quorum")
"""The values `x-queue-type` may take here."""
LOST = (ConnectionError, aiormq.exceptions.ChannelInvalidStateError)
"""What a declaration raises when the connection or channel closed under it."""
RECONNECT_WAIT = 10.0
"""Seconds a declaration waits for a lost connection to come back."""
RETRY_PAUSE = 0.2
MATCH_ROUNDS = 20
"""Arguments of an existing queue taken over, one a declaration, to tell its type."""
PARTITIONED_RECHECK = 30.0
"""Seconds after which a sender looks again whether a queue it found unpartitioned is now."""
MARKER_RECHECK = 1.0
"""Seconds after which an instance that owns partitions looks again, before a keyed send,
whether their ring is being made again elsewhere (its marker exists)."""
RING_LOCK_WAIT = 30.0
"""Seconds an instance waits for another connection to let go of a ring's lock queue."""


PLUGIN_HINT = (
    "enable the plugin on every node (rabbitmq-plugins enable rabbitmq_consistent_hash_exchange)"
)
"""What to do when a node cannot make or route through a consistent-hash exchange."""


def missing_plugin(error: BaseException | None) -> bool:
    """Whether RabbitMQ refused a publish because its node lacks the consistent-hash plugin.

    A node without it answers a publish to such an exchange (declared from a node with it)
    with a 406: "Cannot route message through exchange ...: exchange type x-consistent-hash
    not found".
    """
    text = str(error)
    return "x-consistent-hash" in text and "not found" in text


def partition_exchange(queue: str) -> str:
    """The consistent-hash exchange that splits `queue`'s keyed sends over its partitions."""
    return f"{queue}.partitions"


def migrating_exchange(queue: str) -> str:
    """The exchange that says `queue`'s partitions are being migrated while it exists.

    `mersal queues migrate` declares it, then deletes the partitions' exchange (so that no
    keyed send lands while the ring of partitions changes), and deletes it last, once the
    exchange is back with every partition bound in order.
    """
    return f"{queue}.partitions.migrating"


def ring_lock(queue: str) -> str:
    """The exclusive queue an instance holds while it binds `queue`'s partitions again."""
    return f"{queue}.partitions.lock"


class RingLocked(MersalError):
    """Another connection held a ring's lock queue for RING_LOCK_WAIT seconds."""

    def __init__(self, queue: str) -> None:
        super().__init__(
            f"the partitions of {queue!r} are being migrated or their exchange made again: "
            f"another connection has held {ring_lock(queue)!r} for {RING_LOCK_WAIT:g}s "
            "(`mersal queues migrate`, or an instance binding the partitions again): let it "
            "finish, or close that connection (`rabbitmqctl list_queues name owner_pid`), "
            "then start again"
        )


class PartitionsMigrating(MersalError):
    """A keyed send waits: the queue's partitions are being migrated (nothing was sent)."""

    def __init__(self, queue: str) -> None:
        super().__init__(
            f"the partitions of {queue!r} are being migrated (`mersal queues migrate`; its "
            f"exchange {migrating_exchange(queue)!r} exists until it is done): nothing was "
            "sent; send it again in a moment (the outbox does)"
        )


def partition_routing_key(key: str) -> str:
    """The routing key the exchange hashes: the key, or its digest when it is too long for one."""
    if len(key.encode()) <= 255:
        return key
    return hashlib.sha256(key.encode()).hexdigest()


class QueueTypeMismatch(ConfigurationError):
    """A queue exists as classic where quorum is declared, or the other way round."""

    def __init__(self, name: str, shape: QueueShape) -> None:
        wanted = _type_of(shape)
        super().__init__(
            f"queue {name!r} exists as a {other_type(wanted)} queue, and this app declares "
            f"{wanted} queues: stop the apps that consume it, then run `mersal queues migrate "
            f"--to {wanted} --app module:app` (all of the app's queues; or `--queue {name} "
            f"--transport URL`), which moves the messages into new {wanted} queues; or keep "
            f"them {other_type(wanted)} with "
            f"RabbitMQTransport(url, queue_type={other_type(wanted)!r}) or "
            f"?queue_type={other_type(wanted)} in the transport URL"
        )
        self.queue = name


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


def partition_shape(queue_type: str) -> QueueShape:
    """A partition: durable, of the configured type, one consumer active at a time."""
    return QueueShape(arguments={"x-queue-type": queue_type, "x-single-active-consumer": True})


def temporary_shape() -> QueueShape:
    """A queue that goes away with the connection."""
    return QueueShape(durable=False, exclusive=True, auto_delete=True)


def shared_temporary_shape(expires: float) -> QueueShape:
    """A temporary queue that other connections may consume: gone `expires` seconds unused."""
    arguments = {"x-queue-type": "classic", "x-expires": max(1, round(expires * 1000))}
    return QueueShape(durable=False, arguments=arguments)


def other_type(queue_type: str) -> str:
    """Classic for quorum, quorum for classic."""
    return "classic" if queue_type == "quorum" else "quorum"


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


class Topology:
    """What this transport declared: declared on one channel, and again after a reconnect."""

    def __init__(self, connection: Connection, queue_type: str) -> None:
        self._connection = connection
        self._queue_type = queue_type
        self._channel: AbstractChannel | None = None
        self._lock = asyncio.Lock()
        self.queues: dict[str, QueueShape] = {}
        self.bindings: dict[str, set[str]] = {}
        self.partitions: dict[str, int] = {}
        """The partitioned queues declared here, and how many partitions each has."""
        self._partitioned: dict[str, tuple[bool, float]] = {}  # looked up: whether, and when
        self._rebuilding: dict[str, asyncio.Event] = {}  # set once the ring is made again
        self._marker_looked: dict[str, float] = {}  # when this process last looked for a marker

    async def start(self) -> None:
        """Declare the topic exchange that publishes go through."""
        await self.through_reconnects(f"declare exchange {EVENTS!r}", self.declare_exchange)

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

    async def restore_events(self) -> None:
        """Declare the events exchange again, and the bindings to it made here (it was deleted)."""
        await self.through_reconnects(f"declare exchange {EVENTS!r}", self.declare_exchange)
        for queue, topics in list(self.bindings.items()):
            for topic in sorted(topics):
                await self.bind(queue, topic)

    async def declare(self, name: str, shape: QueueShape) -> None:
        """Declare a queue and remember it (again, if the connection was lost meanwhile)."""

        async def declaring() -> None:
            async with self._lock:
                await self._declare(name, shape)

        await self.through_reconnects(f"declare queue {name!r}", declaring)
        self.queues[name] = shape

    async def declare_error_queue(self, name: str) -> str:
        """Declare an error queue classic; one that exists as quorum is used as it is. Its type.

        An error queue is a parking lot that operators read without consuming: every message
        they look at goes back, which a quorum queue counts against its delivery limit.
        """
        try:
            await self.declare(name, durable_shape("classic"))
            return "classic"
        except QueueTypeMismatch:
            await self.declare(name, durable_shape("quorum"))
        log.warning(
            "error queue %r is a quorum queue: `mersal dlq` refuses to look at it while a "
            "delivery limit applies (every look counts as a delivery); `mersal queues migrate "
            "--queue %s --to classic` moves it",
            name,
            name,
        )
        return "quorum"

    async def of_type(self, name: str, queue_type: str) -> bool | None:
        """Whether the durable queue `name` is of `queue_type`; None if there is none.

        It declares the queue as it would be of that type: an equal declaration changes nothing.
        RabbitMQ names one inequivalent argument at a time, so each other argument it names
        (`x-max-length`, `x-queue-mode`, ...) is taken as the queue has it, and the queue is
        declared again: only a different `x-queue-type` makes it another type.
        """
        async with self._lock:
            if not await self._exists(name):
                return None
            arguments: dict[str, Any] = {"x-queue-type": queue_type}
            for _ in range(MATCH_ROUNDS):
                channel = await self._ready_channel()
                try:
                    await channel.declare_queue(name, durable=True, arguments=arguments)
                except aiormq.exceptions.ChannelPreconditionFailed as error:
                    found = inequivalent(error)
                    if found is None or found[0] == "x-queue-type" or found[0] in arguments:
                        return False
                    argument, value = found
                    arguments[argument] = value
                    continue
                return True
            return False

    async def bind(self, queue: str, topic: str) -> None:
        """Bind a queue to the topic exchange and remember it (again, as `declare`)."""

        async def binding() -> None:
            async with self._lock:
                await self._bind(queue, topic)

        await self.through_reconnects(f"bind queue {queue!r} to {topic!r}", binding)
        self.bindings.setdefault(queue, set()).add(topic)

    async def unbind(self, queue: str, topic: str) -> None:
        """Stop delivering `topic` to `queue`, and forget the binding (not restored again)."""
        self.bindings.get(queue, set()).discard(topic)

        async def unbinding() -> None:
            async with self._lock:
                amqp_queue = await (await self._ready_channel()).get_queue(queue, ensure=False)
                await amqp_queue.unbind(EVENTS, topic)

        await self.through_reconnects(f"unbind queue {queue!r} from {topic!r}", unbinding)

    async def partition(self, queue: str, count: int) -> list[str]:
        """Split keyed sends to `queue` over `count` partitions; the partitions' names."""
        await self._declare_partitions(queue, count)
        self.partitions[queue] = count
        return [partition_queue(queue, index) for index in range(count)]

    async def partitioned(self, queue: str) -> str | None:
        """The exchange of `queue`'s partitions if it has any, else None (looked up, cached)."""
        if queue in self.partitions:
            await self._ring_ready(queue)
            return partition_exchange(queue)
        loop = asyncio.get_running_loop()
        known = self._partitioned.get(queue)
        if known is None or (not known[0] and loop.time() - known[1] > PARTITIONED_RECHECK):
            exists = migrating = False

            async def looking() -> None:
                nonlocal exists, migrating
                async with self._lock:
                    exists = await self._exchange_exists(partition_exchange(queue))
                    migrating = await self._exchange_exists(migrating_exchange(queue))

            await self.through_reconnects(f"look for the partitions of {queue!r}", looking)
            if migrating:  # looked up after the exchange: a missing one may be migrating
                self._partitioned.pop(queue, None)
                raise PartitionsMigrating(queue)
            known = self._partitioned[queue] = (exists, loop.time())
            self._marker_looked[queue] = loop.time()
        elif known[0] and await self._marked(queue):  # its ring is being made: may be half-bound
            raise PartitionsMigrating(queue)
        return partition_exchange(queue) if known[0] else None

    def forget_partitions(self, queue: str) -> bool:
        """Look again whether `queue` has partitions; whether it was thought to have them.

        Partitions declared here are not forgotten: their exchange is made again here.
        """
        known = self._partitioned.pop(queue, None)
        return queue in self.partitions or (known is not None and known[0])

    async def _ring_ready(self, queue: str) -> None:
        """Wait while this process makes the ring of `queue` again; finish one cut short.

        The marker is looked for at most every MARKER_RECHECK seconds. Met without its lock
        queue held, it is a rebuild whose instance died or stopped: this one finishes it. Met
        held, another instance or `mersal queues migrate` is at it: `PartitionsMigrating`.
        """
        rebuilding = self._rebuilding.get(queue)
        if rebuilding is not None:
            await rebuilding.wait()
            return
        if not await self._marked(queue):
            return
        if not await self._rebuild_ring(queue, self.partitions[queue], wait=0.0, marked=True):
            raise PartitionsMigrating(queue)

    async def _marked(self, queue: str) -> bool:
        """Whether the marker of `queue`'s ring exists: looked up at most every MARKER_RECHECK
        seconds while it is absent, at every call while it is there."""
        loop = asyncio.get_running_loop()
        looked = self._marker_looked.get(queue)
        if looked is not None and loop.time() - looked < MARKER_RECHECK:
            return False
        self._marker_looked[queue] = loop.time()
        marked = False

        async def looking() -> None:
            nonlocal marked
            async with self._lock:
                marked = await self._exchange_exists(migrating_exchange(queue))

        await self.through_reconnects(f"look for the marker of {queue!r}", looking)
        if marked:
            self._marker_looked.pop(queue, None)
        return marked

    async def _declare_partitions(self, queue: str, count: int) -> None:
        """Declare the partitions and bind them; make the ring again if it must be."""
        rebuild: str | None = None

        async def partitioning() -> None:
            nonlocal rebuild
            async with self._lock:
                rebuild = await self._partition(queue, count)

        # Under the ring's lock: two instances declaring the partitions at once would see each
        # other's new queues as moved ones and make the ring again under the other's binds.
        if not await self._take_ring_lock(queue, RING_LOCK_WAIT):
            raise RingLocked(queue)
        try:
            await self.through_reconnects(f"partition queue {queue!r}", partitioning)
            if rebuild is not None:
                marked = rebuild == "marked"
                await self._rebuild_ring(queue, count, wait=0.0, marked=marked, locked=True)
        finally:
            await self._release_ring_lock(queue)

    async def _partition(self, queue: str, count: int) -> str | None:
        """Declare the exchange and partitions; why the ring is to be made again, if it is.

        "marked": a rebuild or migration is under way, or was cut short (its marker exists);
        "moved": a partition came back before others, and would be bound out of order.
        """
        exchange = partition_exchange(queue)
        marked = await self._exchange_exists(migrating_exchange(queue))
        existed = await self._exchange_exists(exchange)
        channel = await self._ready_channel()
        try:
            await channel.declare_exchange(exchange, "x-consistent-hash", durable=True)
        except aiormq.exceptions.ChannelPreconditionFailed as error:
            raise ConfigurationError(
                f"exchange {exchange!r} exists with other settings ({_reply(error)}): delete "
                "it so that it is declared again as a durable x-consistent-hash exchange"
            ) from None
        except aiormq.exceptions.ConnectionCommandInvalid as error:
            raise ConfigurationError(
                f"RabbitMQ cannot make exchange {exchange!r} for the partitions of {queue!r} "
                f"({_reply(error)}): {PLUGIN_HINT}"
            ) from None
        created: list[int] = []
        for index in range(count):
            name = partition_queue(queue, index)
            shape = partition_shape(self._queue_type)
            if not await self._exists(name):
                created.append(index)
            await self._declare(name, shape)
            self.queues[name] = shape
        extra = partition_queue(queue, count)
        if await self._exists(extra):
            raise ConfigurationError(
                f"queue {queue!r} has more than {count} partitions ({extra} exists): fewer "
                "partitions would strand the keys hashed to the others; keep the number, or "
                "stop every instance, move the messages of the extra partitions into "
                f"{queue!r} and delete those queues"
            )
        if marked:
            return "marked"
        if existed and created and len(created) + created[0] < count:
            return "moved"
        for index in range(count):  # in order, as every instance binds: the ring stays so
            await self._bind_partition(partition_queue(queue, index), exchange)
        return None

    async def _rebuild_ring(
        self, queue: str, count: int, *, wait: float, marked: bool, locked: bool = False
    ) -> bool:
        """Make the partitions' exchange again with every partition bound in index order.

        RabbitMQ's consistent-hash exchange numbers its ring in the order queues were bound, and
        a deleted queue's binding renumbers the rest: a partition declared again would be bound
        last, and keys would move for good. As `mersal queues migrate` does, the marker exchange
        makes keyed sends wait (here and elsewhere) while the exchange is deleted and made
        again, bound in order. An exclusive queue, the lock, lets one connection at a time do
        it; a marker found once the lock is taken is a rebuild cut short, finished here. With
        `marked`, nothing is made again when the marker went meanwhile. False when another
        connection held the lock for `wait` seconds. `locked`: the caller holds the lock.
        """
        while (earlier := self._rebuilding.get(queue)) is not None:
            await earlier.wait()
        done = self._rebuilding[queue] = asyncio.Event()
        try:
            if not locked and not await self._take_ring_lock(queue, wait):
                return False
            try:
                remaking = partial(self._remake_ring, queue, count, marked)
                await self.through_reconnects(f"make the ring of {queue!r} again", remaking)
            finally:
                if not locked:
                    await self._release_ring_lock(queue)
            return True
        finally:
            del self._rebuilding[queue]
            done.set()

    async def _remake_ring(self, queue: str, count: int, marked: bool) -> None:
        async with self._lock:
            exchange = partition_exchange(queue)
            if marked and not await self._exchange_exists(migrating_exchange(queue)):
                if await self._exchange_exists(exchange):  # made by another: bind ours too
                    for index in range(count):
                        await self._bind_partition(partition_queue(queue, index), exchange)
                return
            await _finished_once_begun(self._remake(queue, count))
        log.warning(
            "the partitions of %r were declared again, or their exchange left half-made: made "
            "it again with every partition bound in order, so that each key keeps its partition",
            queue,
        )

    async def _remake(self, queue: str, count: int) -> None:
        channel = await self._ready_channel()
        marker = migrating_exchange(queue)
        await channel.declare_exchange(marker, aio_pika.ExchangeType.FANOUT, durable=True)
        await channel.exchange_delete(partition_exchange(queue))
        await channel.declare_exchange(partition_exchange(queue), "x-consistent-hash", durable=True)
        for index in range(count):
            await self._bind_partition(partition_queue(queue, index), partition_exchange(queue))
        await channel.exchange_delete(marker)

    async def _take_ring_lock(self, queue: str, wait: float) -> bool:
        """Declare the exclusive queue that one connection at a time holds while it rebuilds.

        Each try on a channel of its own (a refusal closes it), so that declarations go on
        meanwhile. False when another connection held it for `wait` seconds.
        """
        deadline = asyncio.get_running_loop().time() + wait
        taken = False

        async def taking() -> None:
            nonlocal taken
            channel = await self._connection.channel()
            try:
                await channel.declare_queue(
                    ring_lock(queue), exclusive=True, auto_delete=True, durable=False
                )
                taken = True
            except aiormq.exceptions.ChannelLockedResource:  # another connection holds it
                taken = False
            finally:
                await close_quietly(channel)

        while True:
            await self.through_reconnects(f"take the lock of {queue!r}'s ring", taking)
            if taken:
                return True
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(RETRY_PAUSE)

    async def _release_ring_lock(self, queue: str) -> None:
        """Delete the lock queue (it goes with the connection anyway)."""
        with suppress(Exception):
            channel = await self._connection.channel()
            try:
                await channel.queue_delete(ring_lock(queue))
            finally:
                await close_quietly(channel)

    async def _bind_partition(self, name: str, exchange: str) -> None:
        amqp_queue = await (await self._ready_channel()).get_queue(name, ensure=False)
        await amqp_queue.bind(exchange, "1")  # equal weights

    async def _exchange_exists(self, exchange: str) -> bool:
        channel = await self._ready_channel()
        try:
            await channel.declare_exchange(exchange, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return False
        return True

    async def through_reconnects(
        self, what: str, declaration: Callable[[], Awaitable[None]]
    ) -> None:
        """Run a declaration; if the connection closes under it, again once reconnected.

        Declarations are idempotent. Up to RECONNECT_WAIT seconds; then `Unreachable`.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RECONNECT_WAIT
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    await declaration()
                return
            except TimeoutError as error:
                raise Unreachable(
                    f"could not {what}: the connection to RabbitMQ did not come back within "
                    f"{RECONNECT_WAIT:g}s; is RabbitMQ at {mask(self._connection.address)} up?"
                ) from error
            except LOST as error:
                failure: BaseException = error
            except MersalError:
                raise
            except BaseException as error:  # what aiormq raises for a close, or not ours
                channel = self._channel
                closed = channel is None or channel.is_closed or not self._connection.connected
                if closed_under(error, closed, what) is None:
                    raise
                failure = error
            log.info("could not %s (%s); again once reconnected", what, why(failure))
            await asyncio.sleep(RETRY_PAUSE)

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
            try:
                await self._declare(name, shape)
            except QueueTypeMismatch:
                existing = other_type(self._queue_type)
                shape = wait_shape(existing, exchange, routing_key, milliseconds)
                await self._declare(name, shape)
                log.warning(
                    "wait queue %r is a %s queue, not %s; using it as it is (`mersal queues "
                    "migrate` moves it)",
                    name,
                    existing,
                    self._queue_type,
                )
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
        base = self._partitioned_by(name)
        async with self._lock:
            missing = base is not None and not await self._exists(name)
        if base is not None and missing:
            await self._declare_partitions(base, self.partitions[base])  # the ring, in order
        async with self._lock:
            if not missing:
                await self._declare(name, shape)
            for topic in sorted(self.bindings.get(name, ())):
                await self._bind(name, topic)

    def _partitioned_by(self, name: str) -> str | None:
        """The queue whose partition `name` is, if it is one declared here."""
        for queue, count in self.partitions.items():
            if name in (partition_queue(queue, index) for index in range(count)):
                return queue
        return None

    async def restore(self) -> None:
        """Declare everything remembered again (after a reconnect); log what fails."""
        await _logging_failure(EVENTS, self.declare_exchange())
        for queue, count in list(self.partitions.items()):
            declaring = self._declare_partitions(queue, count)
            await _logging_failure(partition_exchange(queue), declaring)
        for name in list(self.queues):
            await _logging_failure(name, self.restore_queue(name))

    async def _ready_channel(self) -> AbstractChannel:
        channel = self._channel
        if channel is None or channel.is_closed:
            channel = self._channel = await self._connection.channel()
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
            if await self._exists_as(name, shape, other_type(_type_of(shape))):
                raise QueueTypeMismatch(name, shape) from None
            refused = quorum_refused(name, error)
            if refused is not None:
                raise refused from None
            raise ConfigurationError(
                f"queue {name!r} already exists with other arguments ({_reply(error)}); this "
                f"app declares it durable={shape.durable} with {dict(shape.arguments)}: delete "
                "the queue (after moving its messages) or configure the transport to match"
            ) from None
        except aiormq.exceptions.ChannelLockedResource:
            raise ConfigurationError(
                f"queue {name!r} is exclusive to another connection: choose another name"
            ) from None
        except (aiormq.exceptions.ConnectionInternalError, asyncio.CancelledError) as error:
            # a 541 closes the connection; the call in flight ends cancelled, with its text
            task = asyncio.current_task()
            refused = quorum_refused(name, error)
            if refused is None or (task is not None and task.cancelling()):
                raise
            raise refused from None
        except aiormq.exceptions.ChannelAccessRefused as error:
            raise ConfigurationError(f"may not declare queue {name!r}: {_reply(error)}") from None

    async def _exists_as(self, name: str, shape: QueueShape, queue_type: str) -> bool:
        """Whether `name` exists as `shape` would be with the other queue type."""
        if shape.exclusive or not shape.durable:
            return False
        arguments = dict(shape.arguments)
        arguments["x-queue-type"] = queue_type
        if queue_type == "classic":  # what only quorum wait queues carry
            arguments.pop("x-dead-letter-strategy", None)
            arguments.pop("x-overflow", None)
        elif "x-dead-letter-exchange" in arguments:
            arguments.update({"x-dead-letter-strategy": "at-least-once"})
            arguments.update({"x-overflow": "reject-publish"})
        channel = await self._ready_channel()
        try:
            await channel.declare_queue(name, durable=True, arguments=arguments)
        except aiormq.exceptions.ChannelPreconditionFailed:
            return False
        return True

    async def _bind(self, queue: str, topic: str) -> None:
        channel = await self._ready_channel()
        amqp_queue = await channel.get_queue(queue, ensure=False)
        try:
            await amqp_queue.bind(EVENTS, topic)
        except aiormq.exceptions.ChannelNotFoundEntity as error:
            raise Unroutable(
                f"cannot bind queue {queue!r} to {topic!r} ({_reply(error)}): declare it first"
            ) from None

    async def count(self, names: Sequence[str]) -> dict[str, QueueStatus]:
        """Each queue's ready messages and consumers, by passive declaration: nothing is made."""
        async with self._lock:
            return {name: await self._count(name) for name in names}

    async def _count(self, name: str) -> QueueStatus:
        channel = await self._ready_channel()
        try:
            queue = await channel.declare_queue(name, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return QueueStatus(name, exists=False)
        except aiormq.exceptions.ChannelLockedResource:
            return QueueStatus(name)  # an exclusive queue of another connection: not counted
        except aiormq.exceptions.ChannelAccessRefused as error:
            raise ConfigurationError(f"may not look at queue {name!r}: {_reply(error)}") from None
        except ValueError as error:  # pamqp refuses some names RabbitMQ itself allows
            raise ConfigurationError(
                f"cannot ask RabbitMQ about queue {name!r} over AMQP ({error}): its name uses "
                "characters the AMQP client refuses"
            ) from None
        counts = queue.declaration_result
        return QueueStatus(name, ready=counts.message_count, consumers=counts.consumer_count)

    async def exists(self, queue: str) -> bool:
        """Whether `queue` exists, by passive declaration: nothing is made."""
        async with self._lock:
            return await self._exists(queue)

    async def _exists(self, queue: str) -> bool:
        channel = await self._ready_channel()
        try:
            await channel.declare_queue(queue, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return False
        except aiormq.exceptions.ChannelLockedResource:
            return True  # an exclusive queue of another connection: it exists
        return True


def quorum_refused(name: str, error: BaseException) -> ConfigurationError | None:
    """The error for a broker that cannot make quorum queues, if that is what `error` says.

    RabbitMQ before 3.10, or one whose quorum_queue feature flag is off (seen on nodes that
    clustered while booting), answers a quorum declaration with a 406 or a 541 that closes
    the whole connection.
    """
    text = str(error).lower()
    if "quorum" not in text:
        return None
    return ConfigurationError(
        f"RabbitMQ cannot make quorum queue {name!r} ({_reply(error)}): quorum queues need "
        "RabbitMQ 3.10 or later with the quorum_queue feature flag enabled (rabbitmqctl "
        "enable_feature_flag all); or use classic queues: RabbitMQTransport(url, "
        "queue_type='classic') or ?queue_type=classic in the transport URL"
    )


_INEQUIVALENT = re.compile(
    r"inequivalent arg '(?P<name>x-[^']+)' for queue .*: received .* but current is "
    r"the value '(?P<value>.*)' of type '(?P<type>\w+)'$"
)
_INTEGERS = ("byte", "short", "signedint", "long", "unsignedbyte", "unsignedshort", "unsignedint")


def inequivalent(error: BaseException) -> tuple[str, Any] | None:
    """The argument a 406 says the queue has otherwise, and its value there; None if unread."""
    match = _INEQUIVALENT.search(str(error))
    if match is None:
        return None
    kind, value = match["type"], match["value"]
    if kind == "longstr":
        return match["name"], value
    if kind == "bool" and value in ("true", "false"):
        return match["name"], value == "true"
    if kind in _INTEGERS and value.lstrip("-").isdigit():
        return match["name"], int(value)
    return None


def _type_of(shape: QueueShape) -> str:
    return str(shape.arguments.get("x-queue-type", "classic"))


def _reply(error: BaseException) -> str:
    """The broker's reply text without its code prefix."""
    text = str(error)
    return text.partition(" - ")[2] or text


async def _finished_once_begun(work: Awaitable[None]) -> None:
    """Run `work` to its end even if cancelled meanwhile (for up to RECONNECT_WAIT), then stop.

    A ring whose exchange was deleted must be bound again before a `stop()` goes on.
    """
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait((task,), timeout=RECONNECT_WAIT)
        raise


async def _logging_failure(name: str, declaration: Awaitable[None]) -> None:
    try:
        await declaration
    except Exception as error:  # a consumer of the queue declares it again itself
        log.warning("declaring %r again failed: %s: %s", name, type(error).__name__, error)
