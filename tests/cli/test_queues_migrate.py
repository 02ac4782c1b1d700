"""`mersal queues migrate` on RabbitMQ: classic queues become quorum ones, every message kept."""

from __future__ import annotations

import asyncio
from uuid import uuid4

import aio_pika
import pytest

from mersal_rabbitmq.topology import EVENTS
from tests.cli.conftest import Queues, mersal
from tests.support import rabbitmqctl_rows

pytestmark = pytest.mark.integration


async def queue_types(vhost: str) -> dict[str, str]:
    """Each queue's type in the vhost."""
    rows = await asyncio.to_thread(rabbitmqctl_rows, "list_queues", "-p", vhost, "name", "type")
    return {row["name"]: row["type"] for row in rows}


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
    amqp_url: str, vhost: str, queues: Queues, capsys: pytest.CaptureFixture[str]
) -> None:
    queue = f"q{uuid4().hex[:8]}.orders"
    wait = f"{queue}.wait.1000"
    topic = f"t{uuid4().hex[:8]}.Placed"
    queues.names |= {queue, wait, f"{queue}.migrating"}
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


async def test_a_queue_with_consumers_is_left_alone(amqp_url: str, queues: Queues) -> None:
    queue = f"q{uuid4().hex[:8]}.busy"
    queues.names |= {queue, f"{queue}.migrating"}
    await fill(amqp_url, queue, 2, arguments={"x-queue-type": "classic"})
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        amqp_queue = await channel.get_queue(queue, ensure=False)
        await amqp_queue.consume(hold)

        code = await mersal("queues", "migrate", "--transport", amqp_url, "--queue", queue)

    assert code != 0
    assert await queues.count(queue) == 2


async def test_a_queue_with_consumers_stops_the_run_before_its_wait_queue_moves(
    amqp_url: str, vhost: str, queues: Queues
) -> None:
    queue = f"q{uuid4().hex[:8]}.busy"
    wait = f"{queue}.wait.30000"
    queues.names |= {queue, wait, f"{queue}.migrating", f"{wait}.migrating"}
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
    amqp_url: str, vhost: str, queues: Queues
) -> None:
    queue = f"q{uuid4().hex[:8]}.orders"
    holding = f"{queue}.migrating"
    queues.names |= {queue, holding}
    # as a run leaves it when killed after declaring the new queue: messages still held aside
    await fill(amqp_url, queue, 2, arguments={"x-queue-type": "quorum"})
    await fill(amqp_url, holding, 5, arguments={"x-queue-type": "quorum"})

    assert await mersal("queues", "migrate", "--transport", amqp_url, "--queue", queue) == 0

    assert holding not in await queue_types(vhost)
    assert sorted(await drain(amqp_url, queue)) == sorted(
        [*(f"m-{n}" for n in range(2)), *(f"m-{n}" for n in range(5))]
    )


async def test_a_partition_keeps_its_binding_to_the_hash_exchange(
    amqp_url: str, vhost: str, queues: Queues
) -> None:
    base = f"q{uuid4().hex[:8]}.orders"
    partition = f"{base}.partition.0"
    queues.names |= {partition, f"{partition}.migrating"}
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
    assert await queues.count(partition) == 3  # (basic.get is refused on it now)
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        await channel.exchange_delete(f"{base}.partitions")


async def test_a_run_stopped_after_deleting_the_queue_is_finished_with_its_bindings(
    amqp_url: str, vhost: str, queues: Queues
) -> None:
    queue = f"q{uuid4().hex[:8]}.orders"
    holding = f"{queue}.migrating"
    topic = f"t{uuid4().hex[:8]}.Placed"
    queues.names |= {queue, holding}
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
