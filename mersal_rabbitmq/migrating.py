"""`mersal queues migrate`: move queues to the other type (classic <-> quorum), keeping messages.

RabbitMQ cannot change a queue's type in place. Each queue moves through a holding queue,
`<queue>.migrating`, of the new type: it is bound like the queue (so events keep arriving), the
queue's messages are moved into it (each published with a confirm, then acked), the queue is
deleted (only if empty when it is classic; a quorum queue cannot be deleted that way) and
declared again with the new type and its bindings, the messages move back, and the holding
queue goes. A message is in one of the two queues, for a moment in both (the receiver's inbox
drops the copy). Run again after a crash or an interruption, it picks up where it was.

The apps that consume the queue must be stopped first: a consumer would take messages mid-way
and keep the queue in use. Each round of moving moves the messages counted at its start;
messages that keep arriving for ROUNDS rounds stop the run (stop the apps that send straight
to the queue). The holding queue is unbound before its last round and deleted once empty.
A partitioned queue's senders may go on: its hash exchange is deleted for the migration (its
ring would change as partitions are declared again) behind a marker exchange that makes keyed
sends wait, and made again after with the partitions bound in order, the ring as it was. The
run holds the ring's lock queue, `<queue>.partitions.lock`, while the marker exists: a marker
left without it (the run was killed) is taken by the apps for a rebuild cut short, which they
finish by binding the partitions in order; run this again to finish the migration.
A queue's wait queues are moved before it (quorum ones dead-letter at least once, so they
wait for it to be back). Moving a quorum queue to classic, stop the apps that send to it too
and let its wait queues empty first.
A wait queue's messages start their wait again in the new wait queue: later, never earlier.
With `--app`, the app's error queue moves to classic whatever `--to` says: an error queue is
a classic queue, which operators can read without the broker counting deliveries.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel

from mersal.app import App
from mersal.cli import load_app
from mersal.errors import ConfigurationError, MersalError
from mersal.transport import partition_queue
from mersal.urls import mask
from mersal_rabbitmq.delays import retry_wait_queues, waiting_for
from mersal_rabbitmq.management import Management, ManagementUnavailable
from mersal_rabbitmq.topology import (
    EVENTS,
    PLUGIN_HINT,
    QUEUE_TYPES,
    RETRY_PAUSE,
    RING_LOCK_WAIT,
    QueueShape,
    RingLocked,
    durable_shape,
    migrating_exchange,
    partition_exchange,
    partition_shape,
    ring_lock,
    wait_shape,
)
from mersal_rabbitmq.transport import RabbitMQTransport

log = logging.getLogger("mersal.rabbitmq")

BATCH = 200
"""Messages moved per round: received, published with confirms, then acked at once."""
IDLE = 0.2
"""Seconds without a message that end a round of moving early (a wait queue's message expired)."""
ROUNDS = 50
"""Rounds of moving (each of the messages counted at its start) before messages that keep
arriving stop the run."""
HOLDING = ".migrating"
"""The suffix of the holding queue a queue's messages wait in while it is declared again."""


@dataclass
class Migration:
    """One queue to migrate: its new shape and its bindings (exchange, routing key)."""

    name: str
    shape: QueueShape
    bindings: list[tuple[str, str]]


def add_queue_commands(commands: argparse._SubParsersAction[Any]) -> None:
    """`mersal queues migrate`."""
    queues = commands.add_parser("queues", help="change RabbitMQ queues (their type)")
    actions = queues.add_subparsers(dest="queues_command", required=True)
    migrate = actions.add_parser(
        "migrate",
        help="move queues to the other type (classic <-> quorum), keeping their messages",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    migrate.add_argument(
        "--app",
        metavar="MODULE:APP",
        help="migrate the app's queue, its partitions, wait queues and error queue (to classic)",
    )
    migrate.add_argument(
        "--queue", action="append", default=[], metavar="NAME", help="a queue to migrate"
    )
    migrate.add_argument(
        "--transport", help="the broker URL (default: the --app's, else $MERSAL_TRANSPORT)"
    )
    migrate.add_argument(
        "--to", choices=QUEUE_TYPES, help="the new type (default: the app's transport's, quorum)"
    )
    migrate.add_argument(
        "--management", help="the management API, for bindings (default: http://<host>:15672)"
    )
    migrate.set_defaults(handler=run_migrate)


def run_migrate(args: argparse.Namespace) -> int:
    """Migrate the queues named on the command line; 0 when every one is of the new type."""
    app = load_app(args.app) if args.app else None
    if app is None and not args.queue:
        raise ConfigurationError("name the queues: --app module:app and/or --queue NAME")
    url = args.transport or (app.transport.address if app is not None else None)
    url = url or os.environ.get("MERSAL_TRANSPORT")
    if not url or not url.lower().startswith("amqp"):
        raise ConfigurationError(
            "mersal queues migrate needs a RabbitMQ URL: --transport amqp://user:password@host/"
            "vhost, MERSAL_TRANSPORT, or --app module:app on RabbitMQ"
        )
    transport = RabbitMQTransport(url)
    target = args.to or _app_queue_type(app) or transport.queue_type
    return asyncio.run(migrate_all(transport, app, args.queue, target, args.management))


async def migrate_all(
    transport: RabbitMQTransport,
    app: App | None,
    queues: Sequence[str],
    target: str,
    management: str | None,
) -> int:
    """Migrate the app's queues and `queues` to `target`; 0 when every one is of that type."""
    await transport.start()
    try:
        api = transport.management_api(management)
        names = [*_queues_of(app), *await _with_waits(api, queues)]
        await _refuse_consumed(transport, names)
        paused = await _pause_partitions(transport, names, target)
        migrated = 0
        for name in dict.fromkeys(names):
            if not await _exists(transport, name) and not await _exists(transport, name + HOLDING):
                continue
            kind = "classic" if app is not None and name == _error_queue_of(app) else target
            bindings = _unpaused(name, await _bindings(transport, api, app, name), paused)
            moved = await migrate(transport, Migration(name, shape_for(name, kind), bindings))
            if moved is None:
                print(f"{name}: already {kind}")
            else:
                migrated += 1
                print(f"{name}: now {kind}, {moved} message(s) moved")
        for base in paused:
            await _resume_partitions(transport, base)
    finally:
        await transport.stop()
    print(f"migrated {migrated} queue(s) on {mask(transport.address)} to {target}")
    return 0


async def _refuse_consumed(transport: RabbitMQTransport, names: Sequence[str]) -> None:
    """A MersalError, before anything moves, when one of the queues has a consumer."""
    for name in names:
        looked = await _look(transport, name)
        if looked is not None and looked.consumers:
            raise MersalError(
                f"queue {name!r} has consumers: stop the apps that consume it, then run this "
                "again (nothing was moved)"
            )


async def _pause_partitions(
    transport: RabbitMQTransport, names: Sequence[str], target: str
) -> list[str]:
    """Stop keyed sends to each partitioned queue whose partitions move; those queues.

    RabbitMQ's consistent-hash exchange numbers its ring by the order its queues were bound,
    and a deleted queue's binding renumbers the rest: while a partition is declared again,
    keys would land in other partitions, and after, stay there. So the exchange goes for the
    migration: `migrating_exchange` is declared first, which tells senders to wait (and send
    again), then the partitions' exchange is deleted; `_resume_partitions` makes it again.
    """
    paused: list[str] = []
    for base in dict.fromkeys(filter(None, map(partitioned_base, names))):
        marker, exchange = migrating_exchange(base), partition_exchange(base)
        if await _exchange_exists(transport, marker):  # an interrupted run's, or a rebuild's
            await _hold_ring_lock(transport, base)
        else:
            if not await _exchange_exists(transport, exchange):
                continue  # not partitioned: only named like a partition
            partitions = [name for name in names if partitioned_base(name) == base]
            if not await _any_moves(transport, partitions, target):
                continue
            await _hold_ring_lock(transport, base)
            async with _channel(transport) as channel:
                await channel.declare_exchange(marker, aio_pika.ExchangeType.FANOUT, durable=True)
        async with _channel(transport) as channel:
            await channel.exchange_delete(exchange)
        paused.append(base)
    return paused


async def _resume_partitions(transport: RabbitMQTransport, base: str) -> None:
    """Make the partitions' exchange again, every partition bound in order; let sends go."""
    exchange = partition_exchange(base)
    count = 0
    while await _exists(transport, partition_queue(base, count)):
        count += 1
    before = await _ready_in(transport, base, count)
    async with _channel(transport) as channel:
        try:
            declared = await channel.declare_exchange(exchange, "x-consistent-hash", durable=True)
        except aiormq.exceptions.ConnectionCommandInvalid as error:
            raise MersalError(
                f"RabbitMQ cannot make exchange {exchange!r} again ({error}): {PLUGIN_HINT}; "
                "then run this again (keyed sends to its queue wait until then)"
            ) from None
        for index in range(count):  # in order: the ring as the app made it
            queue = await channel.get_queue(partition_queue(base, index), ensure=False)
            await queue.bind(declared, "1")
        arrived = await _ready_in(transport, base, count) - before
        await channel.exchange_delete(migrating_exchange(base))
        await channel.queue_delete(ring_lock(base))
    if arrived > 0:  # a sender that sent nothing since the pause, while the ring was made
        log.warning(
            "%d message(s) reached the partitions of %r while their exchange was made again: "
            "their keys may be in another partition than their earlier messages",
            arrived,
            base,
        )


async def _hold_ring_lock(transport: RabbitMQTransport, base: str) -> None:
    """Hold the lock queue of `base`'s ring until done (or the connection goes).

    While the marker exists, its lock held tells the apps that a migration runs; a marker
    without it is a rebuild cut short, which the apps finish. An instance binding the
    partitions again holds it for a moment: waited for, up to RING_LOCK_WAIT seconds.
    """
    deadline = asyncio.get_running_loop().time() + RING_LOCK_WAIT
    while True:
        try:
            async with _channel(transport) as channel:
                await channel.declare_queue(
                    ring_lock(base), exclusive=True, auto_delete=True, durable=False
                )
            return
        except aiormq.exceptions.ChannelLockedResource:
            if asyncio.get_running_loop().time() >= deadline:
                raise RingLocked(base) from None
            await asyncio.sleep(RETRY_PAUSE)


async def _any_moves(transport: RabbitMQTransport, names: Sequence[str], target: str) -> bool:
    """Whether one of the queues is to move: it exists as another type, or half-moved."""
    for name in names:
        if await _exists(transport, name + HOLDING):
            return True
        if await _exists(transport, name) and not await _declares(
            transport, name, shape_for(name, target)
        ):
            return True
    return False


async def _ready_in(transport: RabbitMQTransport, base: str, count: int) -> int:
    """The messages ready in the first `count` partitions of `base`."""
    total = 0
    for index in range(count):
        looked = await _look(transport, partition_queue(base, index))
        total += looked.ready if looked is not None else 0
    return total


def _unpaused(
    name: str, bindings: list[tuple[str, str]], paused: Sequence[str]
) -> list[tuple[str, str]]:
    """A queue's bindings but those of a paused partitions' exchange (made again after)."""
    base = partitioned_base(name)
    if base is None or base not in paused:
        return bindings
    return [b for b in bindings if b[0] not in (partition_exchange(base), migrating_exchange(base))]


def partitioned_base(name: str) -> str | None:
    """The queue that `name` is a partition of, if it is named like one."""
    base, separator, index = name.rpartition(".partition.")
    if separator and index.isdigit() and partition_queue(base, int(index)) == name:
        return base
    return None


def shape_for(name: str, queue_type: str) -> QueueShape:
    """How the queue `name` is declared as `queue_type`: a wait queue, a partition, or plain."""
    waiting = waiting_for(name)
    if waiting is not None:
        destination, milliseconds = waiting
        if destination.startswith(f"{EVENTS}."):
            return wait_shape(queue_type, EVENTS, destination[len(EVENTS) + 1 :], milliseconds)
        return wait_shape(queue_type, "", destination, milliseconds)
    if partitioned_base(name) is not None:
        return partition_shape(queue_type)
    return durable_shape(queue_type)


async def migrate(transport: RabbitMQTransport, migration: Migration) -> int | None:
    """Move one queue to its new shape; the messages it got back, or None if it had it."""
    holding = migration.name + HOLDING
    resuming = await _exists(transport, holding)
    if not resuming and await _declares(transport, migration.name, migration.shape):
        return None
    looked = await _look(transport, migration.name)  # None: deleted by a run that stopped halfway
    if looked is not None and looked.consumers:
        raise MersalError(
            f"queue {migration.name!r} has consumers: stop the apps that consume it, then run "
            "this again"
        )
    await _declare(transport, holding, durable_shape(migration.shape.arguments["x-queue-type"]))
    for exchange, key in migration.bindings:
        await _bind(transport, holding, exchange, key)
    if not await _declares(transport, migration.name, migration.shape):
        await _drain_and_delete(transport, migration.name, holding, migration.shape)
        await _declare(transport, migration.name, migration.shape)
    for exchange, key in migration.bindings:  # again after a run that stopped before binding it
        await _bind(transport, migration.name, exchange, key)
    return await _delete_holding(transport, holding, migration)


async def _drain_and_delete(
    transport: RabbitMQTransport, name: str, holding: str, new: QueueShape
) -> int:
    """Move everything out of `name` and delete it; classic: only while it is empty."""
    moved = 0
    classic = new.arguments["x-queue-type"] == "quorum"  # the old one is the other type
    for _ in range(ROUNDS):
        moved += await _empty(transport, name, holding)
        try:
            async with _channel(transport) as channel:
                underlay = await channel.get_underlay_channel()
                await underlay.queue_delete(name, if_empty=classic)
            return moved
        except aiormq.exceptions.ChannelPreconditionFailed:  # a message came meanwhile
            continue
    raise _still_arriving(name, holding)


async def _delete_holding(transport: RabbitMQTransport, holding: str, migration: Migration) -> int:
    """Unbind the holding queue, move what it holds to the queue, and delete it once empty.

    Unbound, nothing reaches it any more: the count the broker gives is final.
    """
    for exchange, key in migration.bindings:
        await _unbind(transport, holding, exchange, key)
    classic = migration.shape.arguments["x-queue-type"] == "classic"
    moved = 0
    for _ in range(ROUNDS):
        moved += await _empty(transport, holding, migration.name)
        try:
            async with _channel(transport) as channel:
                looked = await _look(transport, holding)
                if looked is None:
                    return moved
                if looked.ready == 0:  # quorum queues cannot be deleted "only if empty"
                    underlay = await channel.get_underlay_channel()
                    await underlay.queue_delete(holding, if_empty=classic)
                    return moved
        except aiormq.exceptions.ChannelPreconditionFailed:
            continue
    raise _still_arriving(holding, migration.name)


async def _empty(transport: RabbitMQTransport, source: str, target: str) -> int:
    """Move messages from `source` to `target` until the broker counts none ready in it.

    Each round moves the messages counted at its start, so that one ends while more arrive.
    """
    moved = 0
    for _ in range(ROUNDS):
        looked = await _look(transport, source)
        if looked is None or looked.ready == 0:
            return moved
        moved += await _move(transport, source, target, looked.ready)
    raise _still_arriving(source, target)


def _still_arriving(source: str, target: str) -> MersalError:
    return MersalError(
        f"messages keep arriving at {source!r} ({ROUNDS} rounds of moving did not empty it): "
        f"stop the apps that send to it, then run this again (what moved is in {target!r}, "
        "where the next run finds it)"
    )


async def _move(transport: RabbitMQTransport, source: str, target: str, count: int) -> int:
    """Move up to `count` messages of `source` to `target`: published with confirms, then acked.

    A consumer, not `basic.get`, which quorum queues with a single active consumer refuse.
    It ends after `count`, or when nothing arrived for IDLE seconds.
    """
    moved = 0
    async with _channel(transport, confirms=True) as channel:  # its close returns the unacked
        await channel.set_qos(prefetch_count=min(BATCH, count))
        underlay = await channel.get_underlay_channel()
        arrived: asyncio.Queue[aiormq.abc.DeliveredMessage] = asyncio.Queue()

        async def take(message: aiormq.abc.DeliveredMessage) -> None:
            arrived.put_nowait(message)

        await underlay.basic_consume(source, take)
        while moved < count and (batch := await _batch(arrived, count - moved)):
            await _publish_all(underlay, batch, source, target)
            last = batch[-1].delivery_tag
            assert last is not None
            await underlay.basic_ack(last, multiple=True)
            moved += len(batch)
    return moved


async def _batch(
    arrived: asyncio.Queue[aiormq.abc.DeliveredMessage], most: int
) -> list[aiormq.abc.DeliveredMessage]:
    """Up to BATCH (and `most`) messages, as many as arrive before IDLE seconds without one."""
    batch: list[aiormq.abc.DeliveredMessage] = []
    while len(batch) < min(BATCH, most):
        try:
            batch.append(await asyncio.wait_for(arrived.get(), IDLE))
        except TimeoutError:
            break
    return batch


async def _publish_all(
    underlay: aiormq.abc.AbstractChannel,
    batch: Sequence[aiormq.abc.DeliveredMessage],
    source: str,
    target: str,
) -> None:
    """Publish copies of `batch` to `target`, each confirmed; a MersalError if one was not."""
    confirms = await asyncio.gather(
        *(
            underlay.basic_publish(
                message.body,
                routing_key=target,
                properties=message.header.properties,
                mandatory=True,
            )
            for message in batch
        )
    )
    if not all(isinstance(confirm, aiormq.spec.Basic.Ack) for confirm in confirms):
        raise MersalError(
            f"RabbitMQ did not take the messages moved from {source!r} to {target!r} "
            f"(returned or refused); they are still in {source!r}: run this again"
        )


@asynccontextmanager
async def _channel(
    transport: RabbitMQTransport, *, confirms: bool = False
) -> AsyncIterator[AbstractChannel]:
    """A channel of its own (a refusal closes it), closed after."""
    channel = await transport.open_channel(confirms=confirms)
    try:
        yield channel
    finally:
        if not channel.is_closed:
            await channel.close()


@dataclass(frozen=True)
class Looked:
    """A queue's ready messages and consumers, as a passive declaration tells them."""

    ready: int
    consumers: int


async def _look(transport: RabbitMQTransport, name: str) -> Looked | None:
    """What the broker counts in `name`; None when it does not exist."""
    async with _channel(transport) as channel:
        try:
            declared = await channel.declare_queue(name, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return None
        counts = declared.declaration_result
        return Looked(int(counts.message_count or 0), int(counts.consumer_count or 0))


async def _exists(transport: RabbitMQTransport, name: str) -> bool:
    return await _look(transport, name) is not None


async def _declares(transport: RabbitMQTransport, name: str, shape: QueueShape) -> bool:
    """Whether `name` can be declared as `shape`: it is of that shape (or was missing)."""
    async with _channel(transport) as channel:
        try:
            await channel.declare_queue(name, durable=True, arguments=dict(shape.arguments))
        except aiormq.exceptions.ChannelPreconditionFailed:
            return False
        return True


async def _declare(transport: RabbitMQTransport, name: str, shape: QueueShape) -> None:
    if not await _declares(transport, name, shape):
        raise MersalError(
            f"queue {name!r} exists with other arguments than {dict(shape.arguments)}: "
            "delete it (after moving its messages) and run this again"
        )


async def _bind(transport: RabbitMQTransport, name: str, exchange: str, key: str) -> None:
    async with _channel(transport) as channel:
        queue = await channel.get_queue(name, ensure=False)
        await queue.bind(exchange, key)


async def _unbind(transport: RabbitMQTransport, name: str, exchange: str, key: str) -> None:
    async with _channel(transport) as channel:
        queue = await channel.get_queue(name, ensure=False)
        with suppress(aiormq.exceptions.ChannelNotFoundEntity):  # no exchange, no binding
            await queue.unbind(exchange, key)


async def _exchange_exists(transport: RabbitMQTransport, name: str) -> bool:
    async with _channel(transport) as channel:
        try:
            await channel.declare_exchange(name, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return False
        return True


async def _bindings(
    transport: RabbitMQTransport, api: Management, app: App | None, name: str
) -> list[tuple[str, str]]:
    """The bindings of `name` (and of its holding queue, after a run that stopped halfway).

    From the management API; without it, what the app declares: its subscriptions and its
    partitions' bindings.
    """
    found: set[tuple[str, str]] = set()
    try:
        for queue in (name, name + HOLDING):
            if await _exists(transport, queue):
                found.update(await api.bindings(queue))
        return sorted(found)
    except ManagementUnavailable as error:
        if app is not None and name == app.name:
            return sorted((EVENTS, app.types.name_of(t)) for t in app.subscriptions)
        if app is not None and name in _queues_of(app):
            partitions = [
                partition_queue(app.name, index) for index in range(app.settings.partitions or 0)
            ]
            return [(f"{app.name}.partitions", "1")] if name in partitions else []
        raise MersalError(
            f"cannot tell what queue {name!r} is bound to ({error}); without its bindings, "
            "messages routed to it during the migration would be lost"
        ) from None


async def _with_waits(api: Management, queues: Sequence[str]) -> list[str]:
    """The queues, each after its wait queues (which dead-letter into it: they go first)."""
    if not queues:
        return []
    view = await api.look([], list(queues))
    ordered: list[str] = []
    for queue in queues:
        ordered += sorted(w for w in view.waits if w.rpartition(".wait.")[0] == queue)
        ordered.append(queue)
    return ordered


def _queues_of(app: App | None) -> list[str]:
    """The app's retry wait queues, its partitions, its queue and its error queue, in order."""
    if app is None or not app.settings.consume:
        return []
    partitions = [partition_queue(app.name, index) for index in range(app.settings.partitions or 0)]
    waits = [
        name
        for queue in (app.name, *partitions)
        for name in retry_wait_queues(queue, app.retry.delayed)
    ]
    # Wait queues first: once of the new (quorum) type they dead-letter at least once, so a
    # message whose wait ends while its queue is declared again waits for it.
    return [*waits, *partitions, app.name, app.retry.error_queue]


def _error_queue_of(app: App) -> str | None:
    """The app's error queue, which is classic whatever the others are (see declare_error_queue)."""
    return app.retry.error_queue if app.settings.consume else None


def _app_queue_type(app: App | None) -> str | None:
    transport = app.transport if app is not None else None
    return transport.queue_type if isinstance(transport, RabbitMQTransport) else None
