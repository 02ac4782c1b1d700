"""What aio-pika's robust objects restore on their own, as Mersal relies on it and works around it.

Mersal keeps each consumer's channel an aio-pika robust channel on a plain connection that it
reconnects itself (see mersal_rabbitmq.connection and .channels). These tests use aio-pika
alone, so that an upgrade that changes what it does shows here first:

- a robust channel, restored after its connection is connected again, consumes again with its
  tags and its prefetch (relied on);
- it leaves a consumer that the broker cancelled cancelled (Mersal consumes it again; aio-pika
  10.2 does so only under its robust connection, retrying with no bound);
- aio-pika's robust connection stays down for good when one declaration it restores is refused,
  however long the broker has been back, and it binds a partition of a consistent-hash
  exchange that it declares again last, which moves keys to other partitions (so the topology,
  and reconnecting, are Mersal's).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage

from tests.mersal_rabbitmq.support import consumers_of, rabbitmqctl, relay
from tests.support import Broker, eventually

pytestmark = pytest.mark.integration


@pytest.fixture
async def connection(url: str) -> AsyncIterator[aio_pika.Connection]:
    """A plain aio-pika connection to the test vhost, as Mersal keeps one; closed afterwards."""
    opened = aio_pika.Connection(aio_pika.connection.make_url(url))
    await opened.connect(timeout=10)
    yield opened
    await opened.close()


Consuming = tuple[aio_pika.RobustChannel, asyncio.Queue[AbstractIncomingMessage], dict[str, Any]]


async def consuming(
    connection: aio_pika.Connection, broker: Broker, queue: str, vhost: str
) -> Consuming:
    """A new durable `queue`, consumed on a robust channel with prefetch 2: the channel, what
    it receives, and its consumer as the broker lists it."""
    await broker.declare(queue, durable=True)
    channel = aio_pika.RobustChannel(connection, publisher_confirms=False)
    await channel.initialize()
    await channel.set_qos(prefetch_count=2)
    received: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
    amqp_queue = await channel.declare_queue(queue, passive=True)
    await amqp_queue.consume(received.put)
    rows = await eventually(lambda: consumers_of(vhost, queue), "the consumer")
    return channel, received, rows[0]


async def test_a_robust_channel_restored_after_a_reconnect_consumes_with_its_tag_and_prefetch(
    connection: aio_pika.Connection, broker: Broker, prefix: str, vhost: str
) -> None:
    queue = f"{prefix}.in"
    channel, received, before = await consuming(connection, broker, queue, vhost)

    await asyncio.to_thread(rabbitmqctl, "close_all_connections", "-p", vhost, "test")
    await eventually(lambda: not connection.connected.is_set(), "the connection lost")
    await connection.connect(timeout=10)
    await channel.restore()

    after = await eventually(lambda: consumers_of(vhost, queue), "the consumer again")
    assert [(row["consumer_tag"], row["prefetch_count"]) for row in after] == [
        (before["consumer_tag"], 2)
    ]
    assert after[0]["channel_pid"] != before["channel_pid"]
    publishing = await connection.channel()  # the broker fixture's connection was closed too
    await publishing.default_exchange.publish(aio_pika.Message(b"after"), queue)
    assert (await asyncio.wait_for(received.get(), 10)).body == b"after"


async def test_a_robust_channel_leaves_a_consumer_the_broker_cancelled_cancelled(
    connection: aio_pika.Connection, broker: Broker, prefix: str, vhost: str
) -> None:
    queue = f"{prefix}.in"
    channel, received, _ = await consuming(connection, broker, queue, vhost)
    cancelled = asyncio.Event()
    underlay = await channel.get_underlay_channel()
    underlay.on_consumer_cancel_callbacks.add(lambda frame: cancelled.set())

    await broker.delete([queue])
    await asyncio.wait_for(cancelled.wait(), 10)
    await broker.declare(queue, durable=True)
    await channel.restore()  # the channel is open: nothing to restore, as far as it knows
    await broker.publish(aio_pika.Message(b"after"), queue)

    assert await broker.count(queue) == 1
    assert await consumers_of(vhost, queue) == []
    assert received.empty() and not channel.is_closed


async def test_a_robust_connection_stays_down_while_a_declaration_it_restores_is_refused(
    url: str, vhost: str, broker: Broker, prefix: str
) -> None:
    kept, changed = f"{prefix}.kept", f"{prefix}.changed"
    async with relay(url) as node:
        robust = await aio_pika.connect_robust(node.url(vhost), reconnect_interval=0.1)
        broker.to_delete.update((kept, changed))
        try:
            attempts: list[BaseException | None] = []
            robust.close_callbacks.add(lambda _, error: attempts.append(error))
            reconnected: list[bool] = []  # aio-pika says so once every channel is restored
            robust.reconnect_callbacks.add(lambda _: reconnected.append(True))
            channel = await robust.channel()
            await channel.declare_queue(kept, durable=True)
            await channel.declare_queue(changed, durable=True, arguments={"x-queue-type": "quorum"})

            await node.die()
            await broker.delete([changed])
            await broker.declare(changed, durable=True, arguments={"x-queue-type": "classic"})
            await node.start()

            refused = "inequivalent arg 'x-queue-type'"
            await eventually(
                lambda: sum(refused in str(error) for error in attempts) >= 5,
                "five reconnects refused",
                timeout=20,
            )
            assert reconnected == []
            assert await broker.exists(kept)  # the broker answers: only the restore is refused
        finally:
            await robust.close()


async def test_a_robust_connection_binds_a_partition_it_declares_again_last_and_keys_move(
    url: str, vhost: str, broker: Broker, prefix: str
) -> None:
    exchange = f"{prefix}.partitions"
    partitions = [f"{prefix}.partition.{n}" for n in range(3)]
    broker.to_delete.update(partitions)
    keys = [f"k{n}" for n in range(24)]
    async with relay(url) as node:
        robust = await aio_pika.connect_robust(node.url(vhost), reconnect_interval=0.1)
        try:
            channel = await robust.channel()
            ring = await channel.declare_exchange(exchange, "x-consistent-hash", durable=True)
            for name in partitions:  # in order, each with the same weight
                await (await channel.declare_queue(name, durable=True)).bind(ring, "1")
            before = await partitions_of(ring, broker, partitions, keys)

            await node.die()
            await broker.delete(partitions[:1])
            await node.start()
            await eventually(lambda: broker.exists(partitions[0]), "declared again", timeout=15)
            after = await partitions_of(ring, broker, partitions, keys)
        finally:
            await robust.close()
            await broker.channel.exchange_delete(exchange)
    assert len(set(before.values())) == 3
    assert [key for key in keys if before[key] != after[key]] == keys


async def partitions_of(
    ring: aio_pika.abc.AbstractExchange, broker: Broker, partitions: list[str], keys: list[str]
) -> dict[str, str]:
    """The partition each key lands in: one message per key through `ring`, then taken."""
    for key in keys:
        await ring.publish(aio_pika.Message(key.encode()), key)
    found: dict[str, str] = {}

    async def taken() -> bool:
        for name in partitions:
            queue = await broker.channel.get_queue(name, ensure=False)
            while (message := await queue.get(no_ack=True, fail=False)) is not None:
                found[message.body.decode()] = name
        return len(found) == len(keys)

    await eventually(taken, "every key taken from its partition", interval=0.05)
    return found
