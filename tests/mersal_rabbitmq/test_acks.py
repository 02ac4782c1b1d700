"""Acks sent together never settle a delivery that was not acked, and none is left unsent."""

from __future__ import annotations

import asyncio
import random

from mersal.transport import Outgoing
from mersal_rabbitmq.acks import Acks
from mersal_rabbitmq.consuming import RabbitMQConsumer, RabbitMQDelivery
from tests.mersal_rabbitmq.test_transport import Make, envelope, started
from tests.support import Broker, eventually


async def holding(
    make_transport: Make, prefix: str, count: int
) -> tuple[str, RabbitMQConsumer, list[RabbitMQDelivery]]:
    """A queue with `count` messages m-00, m-01, ..., all delivered and held unsettled."""
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    await transport.send([Outgoing(queue, envelope(f"m-{n:02d}")) for n in range(count)])
    consumer = await transport.consume(queue, prefetch=count)
    return queue, consumer, [await asyncio.wait_for(consumer.get(), 5) for _ in range(count)]


async def test_out_of_order_acks_and_nacks_settle_exactly_the_ones_asked(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    """Acked ones leave; nacked ones (between acked ones) come back, as soon as asked."""
    queue, consumer, deliveries = await holding(make_transport, prefix, 40)
    returned = {delivery.envelope.message_id for delivery in deliveries[3::4]}

    shuffled = random.Random(7).sample(deliveries, len(deliveries))
    for delivery in shuffled:
        if delivery.envelope.message_id in returned:
            await delivery.nack(requeue=True)
        else:
            await delivery.ack()
        await asyncio.sleep(0)

    again = [await asyncio.wait_for(consumer.get(), 5) for _ in returned]
    assert {delivery.envelope.message_id for delivery in again} == returned
    assert all(delivery.redelivered for delivery in again)
    for delivery in again:
        await delivery.ack()
    await consumer.close()
    assert await broker.count(queue) == 0


async def test_an_ack_behind_a_delivery_still_in_hand_goes_alone_after_the_linger(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue, consumer, (first, second) = await holding(make_transport, prefix, 2)

    await second.ack()  # the first is still being handled: no multiple ack may cover it
    await asyncio.sleep(0.1)  # past the linger: the second's ack has gone alone by now

    await first.nack(requeue=True)  # a multiple ack had settled it: the channel would close
    back = await asyncio.wait_for(consumer.get(), 5)
    assert back.envelope.message_id == "m-00"
    await back.ack()
    await consumer.close()
    assert await broker.count(queue) == 0


async def test_acks_noted_just_before_close_are_sent_before_the_channel_closes(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue, consumer, deliveries = await holding(make_transport, prefix, 25)
    await consumer.close()
    for delivery in reversed(deliveries):
        await delivery.ack()  # the last settle closes the channel: after the acks are written
    await eventually(lambda: consumer._channel is None, "the consumer's channel closed")
    assert await broker.count(queue) == 0


def test_acks_unit_prefix_is_one_multiple_ack() -> None:
    """Without a broker: which frames a run of acks becomes."""
    sent: list[tuple[int, bool]] = []

    class Channel:
        async def basic_ack(self, tag: int, multiple: bool = False, wait: bool = True) -> None:
            sent.append((tag, multiple))

    async def scenario() -> None:
        acks = Acks(Channel(), delay=0.001, linger=0.01)  # type: ignore[arg-type]
        for tag in range(1, 7):
            acks.received(tag)
        for tag in (2, 1, 3, 5):  # 4 is still in hand
            acks.ack(tag)
        await eventually(lambda: sent == [(3, True)], "the head acked at once")
        await eventually(lambda: sent == [(3, True), (5, False)], "5 alone after the linger")
        acks.ack(6)
        acks.nacked(4)
        await acks.drain()

    asyncio.run(scenario())
    assert sent == [(3, True), (5, False), (6, True)]


def test_acks_reach_the_channel_in_the_order_they_were_decided() -> None:
    """Without a broker: a write that waits (aiormq's write queue full) is not overtaken.

    Otherwise an ack of one tag may land after the multiple ack that covered it, and RabbitMQ
    closes the channel ("unknown delivery tag").
    """
    written: list[tuple[int, bool]] = []
    slow = random.Random(3)

    class Channel:
        async def basic_ack(self, tag: int, multiple: bool = False, wait: bool = True) -> None:
            await asyncio.sleep(slow.choice((0, 0, 0, 0.005)))  # a full write queue, now and then
            written.append((tag, multiple))

    async def scenario() -> None:
        acks = Acks(Channel(), delay=0.001, linger=0.002)  # type: ignore[arg-type]
        for tag in range(1, 201):
            acks.received(tag)
        in_hand: list[int] = []
        for start in range(1, 201, 8):  # settled nearly in order: singles, multiples past them
            window = list(range(start, start + 8))
            slow.shuffle(window)
            in_hand += window
        for tag in in_hand:
            acks.ack(tag)
            await asyncio.sleep(slow.choice((0, 0, 0, 0.001, 0.003)))
        await acks.drain()

    asyncio.run(scenario())
    acked: set[int] = set()
    for tag, multiple in written:
        assert tag not in acked, f"{tag} acked again by {(tag, multiple)} after it was covered"
        acked |= set(range(1, tag + 1)) if multiple else {tag}
    assert acked == set(range(1, 201))
