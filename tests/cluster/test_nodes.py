"""The local cluster works: three nodes, a quorum queue with a leader, failover and rejoin.

Run with -s to see the figures it measures (boot, memory, the stall after a leader dies, rejoin).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from uuid import uuid4

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractConnection
from aio_pika.exceptions import AMQPError, ChannelInvalidStateError

from tests.cluster.nodes import NODES, Cluster, rss_kib
from tests.support import eventually

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

FAILOVER_TIMEOUT = 30.0


def report(line: str) -> None:
    """One measured figure, shown with `pytest -s`."""
    print(f"[cluster] {line}")


async def leader_of(
    cluster: Cluster, queue: str, vhost: str, other_than: str | None = None
) -> str | None:
    """The node leading `queue`, or None while it has none (or only `other_than` leads it)."""
    try:
        leader = await asyncio.to_thread(cluster.leader, queue, vhost)
    except LookupError:
        return None
    return None if leader == other_than else leader


async def publish_confirmed(channel: AbstractChannel, queue: str, body: bytes) -> None:
    """Publish `body` to `queue` and wait for the broker's confirm."""
    message = aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
    await channel.default_exchange.publish(message, routing_key=queue, timeout=5)


async def publish_until_confirmed(
    connection: AbstractConnection, queue: str, body: bytes
) -> list[str]:
    """Publish `body` until one attempt is confirmed (new channel after a failure).

    Returns what each failed attempt raised.
    """
    deadline = time.monotonic() + FAILOVER_TIMEOUT
    failures: list[str] = []
    while True:
        channel = await connection.channel()
        try:
            await publish_confirmed(channel, queue, body)
            return failures
        except (AMQPError, ChannelInvalidStateError, TimeoutError) as error:
            failures.append(f"{type(error).__name__}: {error}"[:200])
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
        finally:
            with contextlib.suppress(AMQPError, ChannelInvalidStateError, TimeoutError):
                await channel.close()


async def get_body(connection: AbstractConnection, queue: str) -> bytes:
    """Take one message from `queue` (acked), polling until there is one."""
    channel = await connection.channel()
    source = await channel.get_queue(queue, ensure=False)
    message = await eventually(
        lambda: source.get(fail=False), f"a message on {queue}", timeout=10, interval=0.05
    )
    assert message is not None
    await message.ack()
    await channel.close()
    return bytes(message.body)


async def close_quietly(connection: AbstractConnection) -> None:
    """Close a connection whose node may be dead."""
    with contextlib.suppress(AMQPError, ConnectionError, TimeoutError, ChannelInvalidStateError):
        await asyncio.wait_for(connection.close(), 5)


async def test_a_quorum_queue_fails_over_and_its_leader_rejoins(
    cluster: Cluster, cluster_vhost: str
) -> None:
    assert await asyncio.to_thread(cluster.running) == list(NODES)
    if cluster.boot_seconds is not None:
        phases = ", ".join(f"{name} {value:.1f} s" for name, value in cluster.phases.items())
        report(f"boot+join {cluster.boot_seconds:.1f} s ({phases})")
    for node in NODES:
        pid = cluster.pid(node)
        assert pid is not None
        report(f"{node} pid {pid} VmRSS {rss_kib(pid) / 1024:.0f} MiB")

    connections = {node: await aio_pika.connect(cluster.url(node, cluster_vhost)) for node in NODES}
    try:
        queue = f"cluster-{uuid4().hex[:8]}"
        declaring = await connections["c1"].channel()
        await declaring.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})
        leader = await eventually(
            lambda: leader_of(cluster, queue, cluster_vhost), "a leader", timeout=15, interval=0.2
        )
        assert leader is not None
        report(f"quorum queue {queue} leader {leader}")

        await publish_confirmed(await connections["c2"].channel(), queue, b"via c2")
        assert await get_body(connections["c3"], queue) == b"via c2"

        survivor = next(node for node in NODES if node != leader)
        killed_at = time.monotonic()
        await asyncio.to_thread(cluster.kill, leader)
        failures = await publish_until_confirmed(connections[survivor], queue, b"after the kill")
        report(
            f"killed leader {leader}: a publish via {survivor} confirmed "
            f"{time.monotonic() - killed_at:.2f} s after SIGKILL, {len(failures)} failed before"
        )
        for failure in sorted(set(failures)):
            report(f"  failed attempt: {failure}")
        successor = await eventually(
            lambda: leader_of(cluster, queue, cluster_vhost, other_than=leader),
            f"a leader other than {leader}",
            timeout=15,
            interval=0.2,
        )
        report(f"new leader {successor}")
        assert await get_body(connections[survivor], queue) == b"after the kill"

        restarted_at = time.monotonic()
        await asyncio.to_thread(cluster.start_node, leader)
        report(f"{leader} started again and rejoined in {time.monotonic() - restarted_at:.1f} s")
        assert await asyncio.to_thread(cluster.running) == list(NODES)
    finally:
        for connection in connections.values():
            await close_quietly(connection)
