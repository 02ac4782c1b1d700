"""`mersal queues migrate` on RabbitMQ: classic queues become quorum ones, every message kept."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from uuid import uuid4

import aio_pika
import pytest

from mersal import App, MersalError, RetryPolicy, Unsendable
from mersal.transport import partition_queue
from mersal_rabbitmq.migrating import _queues_of, shape_for
from mersal_rabbitmq.topology import EVENTS
from tests.support import Broker, eventually, mersal, queue_types, rabbitmqctl_rows

pytestmark = pytest.mark.integration


async def fill(url: str, queue: str, count: int, *, arguments: dict[str, object]) -> None:
    """Declare `queue` with `arguments` and publish `count` messages m-0.. into it."""
    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel()
        await channel.declare_queue(queue, durable=True, arguments=arguments)
        for n in range(count):
            message = aio_pika.Message(f"{n}".encode(), message_id=f"m-{n}", headers={"n": n})
            await channel.default_exchange.publish(message, queue)


async def drain(url: str, queue: str) -> list[str]:
    """The message ids in `queue`, in order (taken)."""
    ids: list[str] = []
    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel()
        amqp_queue = await channel.get_queue(queue, ensure=False)
        while (message := await amqp_queue.get(no_ack=True, fail=False)) is not None:
            ids.append(str(message.message_id))
    return ids


async def test_a_classic_queue_and_its_wait_queue_become_quorum_with_every_message_and_binding(
    amqp_url: str, vhost: str, broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    queue = f"q{uuid4().hex[:8]}.orders"
    wait = f"{queue}.wait.1000"
    topic = f"t{uuid4().hex[:8]}.Placed"
    broker.to_delete |= {queue, wait, f"{queue}.migrating"}
    await fill(amqp_url, queue, 30, arguments={"x-queue-type": "classic"})
    wait_arguments = {
        "x-message-ttl": 1000,
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": queue,
    }
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(EVENTS, "topic", durable=True)
        amqp_queue = await channel.get_queue(queue, ensure=False)
        await amqp_queue.bind(exchange, topic)

    code = await mersal(
        "queues", "migrate", "--transport", amqp_url, "--queue", queue, "--queue", wait
    )

    assert code == 0
    out = capsys.readouterr().out
    assert f"{queue}: now quorum, 30 message(s) moved" in out
    types = await queue_types(vhost)
    assert types[queue] == "quorum"
    assert f"{queue}.migrating" not in types
    assert wait not in types  # it did not exist: nothing made
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        exchange = await channel.get_exchange(EVENTS)
        await exchange.publish(aio_pika.Message(b"{}", message_id="event"), topic)
    assert await drain(amqp_url, queue) == [*(f"m-{n}" for n in range(30)), "event"]

    await fill(amqp_url, wait, 3, arguments=wait_arguments)
    assert await mersal("queues", "migrate", "--transport", amqp_url, "--queue", wait) == 0
    assert (await queue_types(vhost))[wait] == "quorum"
    assert await mersal("queues", "migrate", "--transport", amqp_url, "--queue", queue) == 0
    assert f"{queue}: already quorum" in capsys.readouterr().out


async def hold(message: aio_pika.abc.AbstractIncomingMessage) -> None:
    """A consumer that keeps what it gets unacked."""


async def test_a_queue_with_consumers_is_left_alone(amqp_url: str, broker: Broker) -> None:
    queue = f"q{uuid4().hex[:8]}.busy"
    broker.to_delete |= {queue, f"{queue}.migrating"}
    await fill(amqp_url, queue, 2, arguments={"x-queue-type": "classic"})
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        amqp_queue = await channel.get_queue(queue, ensure=False)
        await amqp_queue.consume(hold)

        code = await mersal("queues", "migrate", "--transport", amqp_url, "--queue", queue)

    assert code != 0
    assert await broker.count(queue) == 2


async def test_a_queue_with_consumers_stops_the_run_before_its_wait_queue_moves(
    amqp_url: str, vhost: str, broker: Broker
) -> None:
    queue = f"q{uuid4().hex[:8]}.busy"
    wait = f"{queue}.wait.30000"
    broker.to_delete |= {queue, wait, f"{queue}.migrating", f"{wait}.migrating"}
    await fill(amqp_url, queue, 1, arguments={"x-queue-type": "classic"})
    await fill(amqp_url, wait, 1, arguments={"x-queue-type": "classic"})
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        amqp_queue = await channel.get_queue(queue, ensure=False)
        await amqp_queue.consume(hold)

        code = await mersal(
            "queues", "migrate", "--transport", amqp_url, "--queue", wait, "--queue", queue
        )

    assert code != 0
    types = await queue_types(vhost)
    assert types[wait] == "classic"
    assert f"{wait}.migrating" not in types


async def test_an_interrupted_migration_is_finished_by_running_it_again(
    amqp_url: str, vhost: str, broker: Broker
) -> None:
    queue = f"q{uuid4().hex[:8]}.orders"
    holding = f"{queue}.migrating"
    broker.to_delete |= {queue, holding}
    # as a run leaves it when killed after declaring the new queue: messages still held aside
    await fill(amqp_url, queue, 2, arguments={"x-queue-type": "quorum"})
    await fill(amqp_url, holding, 5, arguments={"x-queue-type": "quorum"})

    assert await mersal("queues", "migrate", "--transport", amqp_url, "--queue", queue) == 0

    assert holding not in await queue_types(vhost)
    assert sorted(await drain(amqp_url, queue)) == sorted(
        [*(f"m-{n}" for n in range(2)), *(f"m-{n}" for n in range(5))]
    )


async def test_a_partition_keeps_its_binding_to_the_hash_exchange(
    amqp_url: str, vhost: str, broker: Broker
) -> None:
    base = f"q{uuid4().hex[:8]}.orders"
    partition = f"{base}.partition.0"
    broker.to_delete |= {partition, f"{partition}.migrating"}
    await fill(
        amqp_url,
        partition,
        3,
        arguments={"x-queue-type": "classic", "x-single-active-consumer": True},
    )
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(
            f"{base}.partitions", "x-consistent-hash", durable=True
        )
        amqp_queue = await channel.get_queue(partition, ensure=False)
        await amqp_queue.bind(exchange, "1")

    assert await mersal("queues", "migrate", "--transport", amqp_url, "--queue", partition) == 0

    assert (await queue_types(vhost))[partition] == "quorum"
    rows = await asyncio.to_thread(
        rabbitmqctl_rows, "list_bindings", "-p", vhost, "source_name", "destination_name"
    )
    assert {"source_name": f"{base}.partitions", "destination_name": partition} in rows
    assert await broker.count(partition) == 3  # (basic.get is refused on it now)
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        await channel.exchange_delete(f"{base}.partitions")


async def test_a_run_stopped_after_deleting_the_queue_is_finished_with_its_bindings(
    amqp_url: str, vhost: str, broker: Broker
) -> None:
    queue = f"q{uuid4().hex[:8]}.orders"
    holding = f"{queue}.migrating"
    topic = f"t{uuid4().hex[:8]}.Placed"
    broker.to_delete |= {queue, holding}
    await fill(amqp_url, holding, 4, arguments={"x-queue-type": "quorum"})
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(EVENTS, "topic", durable=True)
        amqp_queue = await channel.get_queue(holding, ensure=False)
        await amqp_queue.bind(exchange, topic)

    assert await mersal("queues", "migrate", "--transport", amqp_url, "--queue", queue) == 0

    types = await queue_types(vhost)
    assert types[queue] == "quorum" and holding not in types
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        exchange = await channel.get_exchange(EVENTS)
        await exchange.publish(aio_pika.Message(b"{}", message_id="event"), topic)
    assert await drain(amqp_url, queue) == [*(f"m-{n}" for n in range(4)), "event"]


@dataclass
class Step:
    """One step of one key's sequence."""

    key: str
    seq: int


async def ignore(message: Step) -> None:
    """A handler that does nothing."""


async def taken(url: str, queue: str) -> list[tuple[str, int]]:
    """The steps in `queue`, in order (taken by a consumer: a quorum partition refuses get)."""
    steps: list[tuple[str, int]] = []

    async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        body = json.loads(message.body)
        steps.append((body["key"], body["seq"]))

    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel()
        amqp_queue = await channel.declare_queue(queue, passive=True)
        count = int(amqp_queue.declaration_result.message_count or 0)
        await amqp_queue.consume(take, no_ack=True)
        await eventually(lambda: len(steps) >= count, f"the {count} steps in {queue}")
    return steps


async def test_a_partition_moves_while_keyed_sends_go_on_each_key_in_its_partition_in_order(
    amqp_url: str, broker: Broker
) -> None:
    base = f"q{uuid4().hex[:8]}.orders"
    partitions = [partition_queue(base, index) for index in range(4)]
    broker.to_delete |= {
        base,
        f"{base}.error",
        *partitions,
        *(f"{p}.migrating" for p in partitions),
    }
    consumer = App(
        base,
        transport=f"{amqp_url}?queue_type=classic",
        partitions=4,
        retry=RetryPolicy(error_queue=f"{base}.error"),
    )
    consumer.register(Step, ignore)
    async with consumer:  # the classic partitions and their exchange, as an earlier app left them
        pass
    sender = App(f"{base}.sender", transport=amqp_url, consume=False)
    sender.route(Step, base)
    keys = [f"k{n}" for n in range(12)]
    sent: list[tuple[str, int]] = []
    waits = 0
    migrated = asyncio.Event()

    async def send(step: Step) -> None:
        nonlocal waits
        while True:
            try:
                await sender.send(step, partition_key=step.key)
                sent.append((step.key, step.seq))
                return
            except Unsendable:
                raise
            except MersalError:  # the partitions are being migrated: again, as the outbox does
                waits += 1
                await asyncio.sleep(0.02)

    async def keep_sending() -> None:
        seq = 0
        while not migrated.is_set() or seq % 10:
            for key in keys:
                await send(Step(key, seq))
            seq += 1

    try:
        async with sender:
            sending = asyncio.create_task(keep_sending())
            await eventually(lambda: len(sent) >= 10 * len(keys), "steps sent before")
            code = await mersal(
                "queues", "migrate", "--transport", amqp_url, "--queue", partitions[1]
            )
            migrated.set()
            await asyncio.wait_for(sending, 30)

        assert code == 0
        assert waits > 0  # the sender did send during the migration
        where: dict[str, set[str]] = {}
        found: set[tuple[str, int]] = set()
        for partition in partitions:
            steps = await taken(amqp_url, partition)
            for key in keys:
                firsts = list(dict.fromkeys(seq for k, seq in steps if k == key))
                if firsts:
                    where.setdefault(key, set()).add(partition)
                    assert firsts == sorted(firsts), f"{key} out of order in {partition}"
            found.update(steps)
        assert found == set(sent)  # nothing lost
        assert all(len(places) == 1 for places in where.values()), where  # the ring is the same
        assert partitions[1] in set().union(*where.values())
    finally:
        async with await aio_pika.connect(amqp_url) as connection:
            channel = await connection.channel()
            await channel.exchange_delete(f"{base}.partitions")
            await channel.exchange_delete(f"{base}.partitions.migrating")


def test_migration_shapes_follow_the_queue_name() -> None:
    wait = shape_for("orders.wait.1000", "quorum").arguments
    assert wait["x-message-ttl"] == 1000
    assert wait["x-dead-letter-routing-key"] == "orders"
    assert wait["x-dead-letter-strategy"] == "at-least-once"
    event_wait = shape_for("mersal.events.shop.Placed.wait.200", "classic").arguments
    assert event_wait["x-dead-letter-exchange"] == "mersal.events"
    assert event_wait["x-dead-letter-routing-key"] == "shop.Placed"
    assert "x-dead-letter-strategy" not in event_wait
    partition = shape_for(partition_queue("orders", 3), "quorum").arguments
    assert partition["x-single-active-consumer"] is True
    assert shape_for("orders.partition.x", "quorum").arguments == {"x-queue-type": "quorum"}


def test_migrate_moves_an_apps_wait_queues_before_the_queues_they_feed() -> None:
    app = App(
        "orders",
        transport="memory://",
        partitions=2,
        retry=RetryPolicy(delayed=[1.0], error_queue="orders.error"),
    )

    names = _queues_of(app)

    assert names == [
        "orders.wait.1000",
        "orders.partition.0.wait.1000",
        "orders.partition.1.wait.1000",
        "orders.partition.0",
        "orders.partition.1",
        "orders",
        "orders.error",
    ]
