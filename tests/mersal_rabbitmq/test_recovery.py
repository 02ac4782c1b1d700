"""Coming back after a loss: each consumer's channel as aio-pika restores it, and what Mersal adds.

aio-pika's robust channel reopens with its QoS and its consumers, tags and arguments kept.
Mersal declares the topology again after a reconnect, a consumer's queues before it consumes
again, consumes again what the broker cancelled, and gives a consumer that cannot come back up
after a bounded number of attempts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable

import pytest

from mersal import App, OutcomeUnknown, Outgoing, RetryPolicy, Unroutable
from mersal_rabbitmq import ConsumerLost, RabbitMQTransport
from mersal_rabbitmq.connection import Connection
from mersal_rabbitmq.recovery import Recovery
from mersal_rabbitmq.topology import EVENTS
from tests.mersal_rabbitmq.support import bindings_of, consumers_of, rabbitmqctl, relay
from tests.mersal_rabbitmq.test_transport import Make, envelope, started
from tests.support import Broker, eventually

pytestmark = pytest.mark.integration


@pytest.fixture
async def connection(url: str) -> AsyncIterator[Connection]:
    """An open connection to the test vhost; closed afterwards."""
    opened = Connection(url)
    await opened.open(heartbeat=None)
    yield opened
    await opened.close()


async def test_a_restore_that_keeps_failing_is_tried_after_each_delay_then_reported_lost(
    connection: Connection,
) -> None:
    attempts = 0
    lost: list[tuple[str, int]] = []

    async def restore() -> None:
        nonlocal attempts
        attempts += 1
        raise RuntimeError(f"attempt {attempts}")

    def hear(error: Exception, count: int) -> None:
        lost.append((str(error), count))

    recovery = Recovery(connection, "restoring", restore, delays=(0.01, 0.01), lost=hear)
    recovery.ask()
    await eventually(lambda: lost, "reported lost", timeout=10)
    assert lost == [("attempt 3", 3)]
    assert recovery.ended

    recovery.ask()  # given up: asks are not taken any more
    later: list[bool] = []

    async def restore_later() -> None:
        later.append(True)

    Recovery(connection, "restoring later", restore_later).ask()
    await eventually(lambda: later, "another recovery asked later ran", timeout=10)
    assert attempts == 3


async def test_a_restore_asked_for_while_one_runs_follows_it_once_and_never_overlaps(
    connection: Connection,
) -> None:
    running = peak = 0
    asked = "at first"
    runs: list[str] = []  # when each run was asked for
    gate = asyncio.Event()

    async def restore() -> None:
        nonlocal running, peak
        running += 1
        runs.append(asked)
        peak = max(peak, running)
        await gate.wait()
        running -= 1

    recovery = Recovery(connection, "restoring", restore)
    recovery.ask()
    await eventually(lambda: runs == ["at first"], "the first restore under way", timeout=10)
    asked = "twice while it ran"
    recovery.ask()
    recovery.ask()
    gate.set()
    await eventually(lambda: len(runs) == 2 and running == 0, "one more restore", timeout=10)
    # A restore asked for after those runs too: a run more of theirs would show before it.
    asked = "after them"
    recovery.ask()
    await eventually(lambda: len(runs) == 3 and running == 0, "a later restore", timeout=10)
    assert (runs, peak) == (["at first", "twice while it ran", "after them"], 1)


async def test_a_restore_failing_as_the_connection_goes_waits_for_it_and_is_not_counted(
    url: str, vhost: str
) -> None:
    states: list[bool] = []  # whether connected, as each attempt begins
    lost: list[int] = []

    def hear(error: Exception, count: int) -> None:
        lost.append(count)

    async with relay(url) as node:
        connection = Connection(node.url(vhost, "?reconnect_interval=0.1"))
        await connection.open(heartbeat=None)

        async def restore() -> None:
            states.append(connection.connected)
            if len(states) == 1:
                await node.die()
                await eventually(lambda: not connection.connected, "the connection lost")
                failed.set()  # the recovery hears the error in the same step: still down
                raise ConnectionError("the connection closed under it")

        failed = asyncio.Event()
        try:
            Recovery(connection, "restoring", restore, lost=hear).ask()  # no retry if its fault
            await asyncio.wait_for(failed.wait(), 10)
            await node.start()
            await eventually(lambda: len(states) == 2, "restored once reconnected", timeout=10)
        finally:
            await connection.close()
    assert (states, lost) == ([True, True], [])


async def test_a_consumer_consumes_again_after_a_connection_loss_with_its_tag_and_prefetch(
    make_transport: Make, prefix: str, vhost: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    consumer = await transport.consume(queue, prefetch=3)
    before = await eventually(lambda: consumers_of(vhost, queue), "the consumer on the broker")

    for n in range(2):  # each reconnect restores it once: never two consumers
        channel = before[0]["channel_pid"]
        await asyncio.to_thread(rabbitmqctl, "close_all_connections", "-p", vhost, "test")

        async def again(channel: str = channel) -> list[dict[str, object]]:
            rows = await consumers_of(vhost, queue)
            return rows if rows and rows[0]["channel_pid"] != channel else []

        after = await eventually(again, "the consumer on a new channel", timeout=15)
        assert [(row["consumer_tag"], row["prefetch_count"]) for row in after] == [
            (before[0]["consumer_tag"], 3)
        ]
        await transport.send([Outgoing(queue, envelope(f"m-{n}"))])
        delivery = await asyncio.wait_for(consumer.get(), 10)
        assert delivery.envelope.message_id == f"m-{n}"
        await delivery.ack()
        before = after


async def test_a_closed_consumer_does_not_consume_again_after_a_reconnect(
    make_transport: Make, prefix: str, vhost: str
) -> None:
    kept, closed = f"{prefix}.kept", f"{prefix}.closed"
    transport = await started(make_transport, kept, closed)
    consumer = await transport.consume(kept, prefetch=1)
    await (await transport.consume(closed, prefetch=1)).close()
    assert await eventually(lambda: consumers_of(vhost, kept), "the kept consumer")
    assert await consumers_of(vhost, closed) == []
    channel = (await consumers_of(vhost, kept))[0]["channel_pid"]

    async def back() -> bool:
        channels = [row["channel_pid"] for row in await consumers_of(vhost, kept)]
        return channels not in ([], [channel])

    await asyncio.to_thread(rabbitmqctl, "close_all_connections", "-p", vhost, "test")
    await eventually(back, "the kept consumer back", timeout=15)
    await transport.send([Outgoing(closed, envelope("m-1")), Outgoing(kept, envelope("m-2"))])
    assert (await asyncio.wait_for(consumer.get(), 10)).envelope.message_id == "m-2"
    assert await consumers_of(vhost, closed) == []


async def test_a_queue_and_a_binding_deleted_while_disconnected_come_back(
    url: str, vhost: str, broker: Broker, prefix: str
) -> None:
    consumed, bound = f"{prefix}.consumed", f"{prefix}.bound"
    topic = f"{prefix}.Event"
    async with relay(url) as node:
        transport = RabbitMQTransport(node.url(vhost, "?reconnect_interval=0.1"))
        broker.watch(transport)
        await transport.start()
        try:
            for queue in (consumed, bound):
                await transport.declare(queue)
                await transport.bind(queue, topic)
            consumer = await transport.consume(consumed, prefetch=1)

            await node.die()
            await eventually(lambda: not transport.connected, "disconnected")
            await broker.delete([consumed])
            await (await broker.channel.get_queue(bound, ensure=False)).unbind(EVENTS, topic)
            await node.start()
            await eventually(lambda: transport.connected, "reconnected", timeout=15)

            await eventually(lambda: broker.exists(consumed), "the queue declared again")
            await eventually(lambda: consumers_of(vhost, consumed), "consuming it again")
            restored = [(EVENTS, topic)]
            await eventually(lambda: _is(bindings_of(vhost, bound), restored), "bound again")
            assert await bindings_of(vhost, consumed) == restored
            await transport.send([Outgoing(topic, envelope("m-1"), publish=True)])
            assert (await asyncio.wait_for(consumer.get(), 10)).envelope.message_id == "m-1"
            assert (await broker.get(bound)).message_id == "m-1"  # the binding is back too
        finally:
            await transport.stop()


async def test_a_queue_that_cannot_be_declared_again_does_not_keep_the_rest_from_coming_back(
    url: str, vhost: str, broker: Broker, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    changed, deleted = f"{prefix}.changed", f"{prefix}.deleted"
    async with relay(url) as node:
        transport = RabbitMQTransport(node.url(vhost, "?reconnect_interval=0.1"))
        broker.watch(transport)
        await transport.start()
        try:
            await transport.declare(changed)  # a quorum queue
            await transport.declare(deleted)
            await node.die()
            await eventually(lambda: not transport.connected, "disconnected")
            await broker.delete([changed, deleted])
            await broker.declare(changed, durable=True, arguments={"x-queue-type": "classic"})
            await node.start()

            await eventually(lambda: broker.exists(deleted), "the other queue back", timeout=15)
            refused = f"declaring {changed!r} again failed"
            await eventually(lambda: refused in caplog.text, "the refusal logged")
            assert transport.connected
            await transport.send([Outgoing(deleted, envelope("m-1"))])
            assert (await broker.get(deleted)).message_id == "m-1"
        finally:
            await transport.stop()


async def test_a_consumer_whose_queue_was_deleted_declares_it_again_and_goes_on(
    make_transport: Make, broker: Broker, prefix: str, vhost: str, caplog: pytest.LogCaptureFixture
) -> None:
    queue = f"{prefix}.in"
    topic = f"{prefix}.Event"
    transport = await started(make_transport, queue)
    await transport.bind(queue, topic)
    consumer = await transport.consume(queue, prefetch=2)
    tags = await eventually(lambda: consumers_of(vhost, queue), "the consumer on the broker")

    caplog.set_level(logging.INFO, logger="mersal.rabbitmq")
    await broker.delete([queue])
    await eventually(
        lambda: f"consuming {queue!r} again" in caplog.text, "resubscribed", timeout=10
    )
    assert any(
        r.levelno == logging.WARNING and "cancelled the consumer" in r.getMessage()
        for r in caplog.records
    )
    again = await consumers_of(vhost, queue)
    assert [row["consumer_tag"] for row in again] == [tags[0]["consumer_tag"]]
    assert [row["channel_pid"] for row in again] == [tags[0]["channel_pid"]]  # the same channel
    await transport.send([Outgoing(topic, envelope("m-15"), publish=True)])
    delivery = await asyncio.wait_for(consumer.get(), 5)
    assert delivery.envelope.message_id == "m-15"
    await delivery.ack()


async def test_a_consumer_that_cannot_consume_again_makes_get_raise(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.foreign"  # declared by someone else: the transport cannot restore it
    await broker.declare(queue, durable=True)
    transport = await started(make_transport)
    transport.resubscribe_delays = (0.05, 0.05)
    consumer = await transport.consume(queue, prefetch=1)

    await broker.delete([queue])
    with pytest.raises(ConsumerLost, match="could not consume again in 3 attempts"):
        await asyncio.wait_for(consumer.get(), 10)


async def test_an_app_whose_queue_cannot_come_back_is_not_live_and_still_sends(
    url: str, vhost: str, broker: Broker, prefix: str
) -> None:
    async with relay(url) as node:
        transport = RabbitMQTransport(node.url(vhost, "?reconnect_interval=0.1"))
        transport.resubscribe_delays = (0.05, 0.05)
        app = App(
            f"{prefix}.orders", transport=transport, retry=RetryPolicy(error_queue=f"{prefix}.err")
        )
        broker.watch(transport)
        async with app:
            await node.die()
            await eventually(lambda: not transport.connected, "disconnected")
            await broker.delete([app.name])  # made again as classic: the app declares quorum
            await broker.declare(app.name, durable=True, arguments={"x-queue-type": "classic"})
            await node.start()

            await eventually(lambda: not app.health().live, "the app not live", timeout=15)
            assert "could not consume again in 3 attempts" in app.health().checks["worker"]
            assert transport.connected
            await transport.send([Outgoing(app.name, envelope("m-1"))])
            assert (await broker.get(app.name)).message_id == "m-1"


async def test_a_consumer_whose_channel_closed_consumes_again_on_a_new_one(
    make_transport: Make, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    consumer = await transport.consume(queue, prefetch=2)
    await transport.send([Outgoing(queue, envelope("m-16"))])
    first = await asyncio.wait_for(consumer.get(), 5)
    caplog.set_level(logging.INFO, logger="mersal.rabbitmq")

    # acking a delivery tag the channel never had makes RabbitMQ close that channel (406)
    channel = first.message.channel
    await channel.basic_ack(delivery_tag=first.message.delivery_tag + 1000)
    await eventually(
        lambda: f"consuming {queue!r} again" in caplog.text, "resubscribed", timeout=10
    )
    with pytest.raises(Exception, match="RabbitMQ will deliver it again"):
        await first.ack()
    again = await asyncio.wait_for(consumer.get(), 5)
    assert again.envelope.message_id == "m-16"
    assert again.redelivered is True
    await again.ack()


async def test_temporary_queues_and_their_consumers_come_back_after_a_reconnect(
    make_transport: Make, prefix: str, vhost: str
) -> None:
    temporary = f"{prefix}.replies"
    transport = await started(make_transport)
    await transport.declare(temporary, temporary=True)
    consumer = await transport.consume(temporary, prefetch=1)

    await asyncio.to_thread(rabbitmqctl, "close_all_connections", "-p", vhost, "test")
    await eventually(lambda: transport.connected, "reconnected", timeout=10)

    async def sent() -> bool:
        try:
            await transport.send([Outgoing(temporary, envelope("m-18"))])
        except (Unroutable, OutcomeUnknown):
            return False
        return True

    # the consumer declares its queue again after the reconnect
    await eventually(
        sent, "a send to the temporary queue, declared again", timeout=10, interval=0.1
    )
    delivery = await asyncio.wait_for(consumer.get(), 10)
    assert delivery.envelope.message_id == "m-18"
    await delivery.ack()


async def _is(looking: Awaitable[object], expected: object) -> bool:
    """Whether what `looking` finds is `expected`."""
    return await looking == expected
