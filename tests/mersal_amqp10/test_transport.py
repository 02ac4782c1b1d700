"""The AMQP 1.0 transport against RabbitMQ 3.10's plugin: outcomes, credit, sends, losses.

Each test reads its outcome back from the broker over 0-9-1 (the `broker` fixture): how many
messages a queue holds once no consumer is left on it (a closed consumer's sessions end, and
the broker puts back what they did not settle), and which ones, in what order.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import aio_pika
import proton
import pytest

from mersal import ConfigurationError, Envelope, Header, MersalError, Outgoing, Unroutable
from mersal_amqp10 import Amqp10Transport
from mersal_amqp10.consuming import Amqp10Consumer, Amqp10Delivery
from mersal_amqp10.wire import UNREADABLE
from tests.mersal_amqp10.support import (
    amqp_decoded,
    count_unconsumed,
    drop_amqp10_connections,
    end_amqp10_sessions,
    raw_send,
)
from tests.mersal_rabbitmq.test_transport import broker_count_is, envelope
from tests.support import Broker, eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

Make = Callable[..., Amqp10Transport]


async def started(make: Make, *queues: str, **options: object) -> Amqp10Transport:
    """A started transport with `queues` declared."""
    transport = make(**options)
    await transport.start()
    for queue in queues:
        await transport.declare(queue)
    return transport


async def receive(consumer: Amqp10Consumer, within: float = 5.0) -> Amqp10Delivery:
    """The next delivery, failing the test if none arrives in time."""
    async with asyncio.timeout(within):
        return await consumer.get()


def numbered(queue: str, count: int) -> list[Outgoing]:
    """`count` messages to `queue`, ids m-0, m-1, ... and bodies b"0", b"1", ..."""
    return [Outgoing(queue, envelope(f"m-{n}", str(n).encode())) for n in range(count)]


# Outcomes: accepted, released, rejected.


async def test_an_acked_delivery_is_accepted_and_gone_from_the_queue(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    await transport.send([Outgoing(queue, envelope("m-1"))])
    consumer = await transport.consume(queue, prefetch=5)

    delivery = await receive(consumer)
    assert delivery.envelope.message_id == "m-1"
    assert delivery.redelivered is False
    await delivery.ack()
    await consumer.close()  # its session ends: the broker takes back what was not settled

    assert await count_unconsumed(broker, queue) == 0


async def test_a_released_delivery_comes_back_marked_redelivered(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    await transport.send([Outgoing(queue, envelope("m-2"))])
    consumer = await transport.consume(queue, prefetch=5)

    first = await receive(consumer)
    assert first.redelivered is False
    await first.nack(requeue=True)
    again = await receive(consumer)
    assert again.envelope.message_id == "m-2"
    assert again.redelivered is True
    await again.ack()
    with pytest.raises(MersalError, match="already"):
        await again.nack()
    await consumer.close()

    assert await count_unconsumed(broker, queue) == 0


async def test_a_rejected_delivery_goes_to_the_queues_dead_letter_exchange(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue, dead = f"{prefix}.in", f"{prefix}.dead"
    await broker.declare(dead, durable=True)
    dead_lettering = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dead}
    await broker.declare(queue, durable=True, arguments=dead_lettering)
    transport = await started(make_transport)
    await transport.send([Outgoing(queue, envelope("m-3", b"rejected"))])
    consumer = await transport.consume(queue, prefetch=5)

    await (await receive(consumer)).nack(requeue=False)
    dead_letter = await broker.get(dead)
    await consumer.close()

    assert dead_letter.message_id == "m-3"
    assert dead_letter.body == b"rejected"
    assert await count_unconsumed(broker, queue) == 0
    assert await broker.count(dead) == 0


async def test_a_rejected_delivery_without_a_dead_letter_exchange_is_dropped(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    await transport.send(numbered(queue, 2))
    consumer = await transport.consume(queue, prefetch=1)

    rejected = await receive(consumer)
    await rejected.nack(requeue=False)
    kept = await receive(consumer)  # the credit of the rejected one, used
    await consumer.close()
    await kept.nack()  # left to the end of the session, which puts it back

    assert (rejected.envelope.message_id, kept.envelope.message_id) == ("m-0", "m-1")
    assert await count_unconsumed(broker, queue) == 1
    assert (await broker.get(queue)).message_id == "m-1"


# Credit and sending.


async def test_a_backlog_arrives_exactly_once_with_no_more_unsettled_than_the_prefetch(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue, backlog, prefetch = f"{prefix}.backlog", 500, 10
    transport = await started(make_transport, queue)
    await transport.send(numbered(queue, backlog))
    consumer = await transport.consume(queue, prefetch=prefetch)
    receiver = consumer._receivers[0]

    held = [await receive(consumer) for _ in range(prefetch)]
    await eventually(lambda: broker_count_is(broker, queue, backlog - prefetch), "ten taken")
    with pytest.raises(TimeoutError):  # with all its credit used, the broker sends no more
        await asyncio.wait_for(consumer.get(), 0.3)
    assert receiver.unsettled == prefetch
    assert await broker.count(queue) == backlog - prefetch

    seen = Counter(delivery.envelope.message_id for delivery in held)
    most = receiver.unsettled
    bursts = itertools.cycle([1, 3, 10, 2, 7, 5])
    while held:
        for delivery in held[: next(bursts)]:  # acked a few at a time, while transfers arrive
            await delivery.ack()
            held.remove(delivery)
            await asyncio.sleep(0)
            most = max(most, receiver.unsettled)
        while len(held) < prefetch and sum(seen.values()) < backlog:
            delivery = await receive(consumer)
            assert delivery.redelivered is False, delivery.envelope.message_id
            seen[delivery.envelope.message_id] += 1
            held.append(delivery)
            most = max(most, receiver.unsettled)
    await consumer.close()

    assert most <= prefetch
    assert consumer._receivers[0] is receiver  # never ended for overrunning its credit
    assert seen == Counter(f"m-{n}" for n in range(backlog))
    assert await count_unconsumed(broker, queue) == 0


async def test_one_send_of_two_thousand_messages_puts_them_all_in_the_queue_in_order(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue, count = f"{prefix}.many", 2_000
    transport = await started(make_transport, queue)

    async with asyncio.timeout(20):
        await transport.send(numbered(queue, count))

    assert await count_unconsumed(broker, queue) == count
    recorder = await broker.record(queue)
    await eventually(lambda: len(recorder.bodies) == count, f"all {count} read", timeout=10)
    assert recorder.bodies == [str(n).encode() for n in range(count)]
    assert recorder.duplicates() == {}


async def test_a_send_to_a_missing_queue_raises_unroutable_and_creates_nothing(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue, missing = f"{prefix}.in", f"{prefix}.missing"
    transport = await started(make_transport, queue)

    with pytest.raises(Unroutable, match=missing):
        await transport.send([Outgoing(missing, envelope("m-4"))])
    results = await transport.send_each(
        [Outgoing(missing, envelope("m-5")), Outgoing(queue, envelope("m-6"))]
    )

    assert isinstance(results[0], Unroutable)
    assert results[1] is None
    assert await broker.exists(missing) is False
    assert (await broker.get(queue)).message_id == "m-6"
    assert await count_unconsumed(broker, queue) == 0


async def test_a_send_to_a_queue_deleted_since_the_last_send_raises_unroutable(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    await transport.send([Outgoing(queue, envelope("m-7"))])  # its sender link is attached
    await broker.delete([queue])

    with pytest.raises(Unroutable, match=queue):
        await transport.send([Outgoing(queue, envelope("m-8"))])
    assert await broker.exists(queue) is False

    await transport.declare(queue)
    await transport.send([Outgoing(queue, envelope("m-9"))])
    assert (await broker.get(queue)).message_id == "m-9"
    assert await count_unconsumed(broker, queue) == 0


async def test_a_queue_name_with_a_slash_is_refused_as_no_address_can_carry_it(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    transport = await started(make_transport)

    with pytest.raises(ConfigurationError, match="'/'"):
        await transport.declare(f"{prefix}/in")
    with pytest.raises(ConfigurationError, match="'/'"):
        await transport.send([Outgoing(f"{prefix}/in", envelope("m-10"))])
    assert await broker.exists(f"{prefix}/in") is False


# Losses.


@pytest.mark.parametrize(
    "fault", [end_amqp10_sessions, drop_amqp10_connections], ids=["sessions", "connection"]
)
async def test_after_the_broker_ends_the_sessions_or_the_connection_consuming_and_sending_carry_on(
    fault: Callable[..., Awaitable[int]],
    make_transport: Make,
    broker: Broker,
    vhost: str,
    prefix: str,
) -> None:
    queue = f"{prefix}.in"
    since = time.time()
    transport = await started(make_transport, queue)
    await broker.publish(aio_pika.Message(b"0", message_id="m-0"), queue)  # no sender session
    consumer = await transport.consume(queue, prefetch=5)  # its receiver: the one session
    before = await receive(consumer)
    pending = asyncio.create_task(consumer.get())

    assert await fault(vhost, since=since) == 1
    again = await asyncio.wait_for(pending, 15)  # on the same connection, or the next
    assert (again.envelope.message_id, again.redelivered) == ("m-0", True)
    await eventually(lambda: transport.connected, "connected again", timeout=10)
    with pytest.raises(MersalError, match="link is gone"):
        await before.ack()
    await transport.send([Outgoing(queue, envelope("m-1"))])
    after = await receive(consumer)
    assert (after.envelope.message_id, after.redelivered) == ("m-1", False)
    await again.ack()
    await after.ack()
    await consumer.close()

    assert await count_unconsumed(broker, queue) == 0


# What a message carries.


async def test_unicode_and_empty_header_values_survive_a_round_trip(
    make_transport: Make, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    sent = envelope("m-h", "tëxt ✓".encode()).copy(
        **{"x-unicode": "ünïcødé ✓ 日本語 🚀", "x-empty": "", "ключ": "значение"}
    )
    await transport.send([Outgoing(queue, sent)])
    consumer = await transport.consume(queue, prefetch=1)

    delivery = await receive(consumer)
    await delivery.ack()

    assert delivery.envelope.headers == sent.headers
    assert delivery.envelope.body == sent.body


async def test_a_header_value_of_200_kb_survives_a_round_trip(
    make_transport: Make, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue, publish_timeout=3.0)
    sent = envelope("m-big").copy(**{"x-big": "é" * 100_000})  # 200,000 bytes of UTF-8
    await transport.send([Outgoing(queue, sent)])
    consumer = await transport.consume(queue, prefetch=1)

    delivery = await receive(consumer)
    await delivery.ack()

    assert delivery.envelope.headers == sent.headers


async def test_a_body_spanning_many_frames_arrives_whole(make_transport: Make, prefix: str) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue, publish_timeout=3.0)
    body = bytes(range(256)) * 4_096  # 1 MiB, some 64 frames
    await transport.send([Outgoing(queue, envelope("m-large", body))])
    consumer = await transport.consume(queue, prefetch=2)

    delivery = await receive(consumer)
    await delivery.ack()

    assert delivery.envelope.body == body


async def test_a_body_spanning_many_frames_is_received_whole(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    body = bytes(range(256)) * 4_096  # 1 MiB, published over 0-9-1
    await broker.publish(aio_pika.Message(body, message_id="m-large"), queue)
    consumer = await transport.consume(queue, prefetch=2)

    delivery = await receive(consumer)
    await delivery.ack()
    await consumer.close()

    assert delivery.envelope.message_id == "m-large"
    assert delivery.envelope.body == body
    assert await count_unconsumed(broker, queue) == 0


async def test_amqp_value_bodies_from_another_client_arrive_marked_or_as_their_text(
    make_transport: Make, vhost: str, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    await asyncio.to_thread(
        raw_send,
        vhost,
        f"/amq/queue/{queue}",
        [
            proton.Message(body={"order_id": "o-1"}, id="raw-map", subject="t.Order"),
            proton.Message(body="héllo", id="raw-text", subject="t.Greeting"),
        ],
    )
    consumer = await transport.consume(queue, prefetch=2)

    mapped, text = await receive(consumer), await receive(consumer)
    await mapped.ack()
    await text.ack()

    assert mapped.envelope.message_id == "raw-map"
    assert mapped.envelope.type_name == "t.Order"
    assert mapped.envelope.headers[Header.CONTENT_TYPE].startswith(UNREADABLE)
    assert amqp_decoded(mapped.envelope.body) == {"order_id": "o-1"}
    assert text.envelope.message_id == "raw-text"
    assert text.envelope.body == "héllo".encode()
    assert Header.CONTENT_TYPE not in text.envelope.headers


# Stopping.


async def test_closing_returns_the_buffered_deliveries_in_order_once_those_handed_out_are_acked(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.in"  # quorum: a released message would go to the tail
    transport = await started(make_transport, queue)
    await transport.send(numbered(queue, 20))
    consumer = await transport.consume(queue, prefetch=20)
    handed_out = [await receive(consumer) for _ in range(2)]
    await eventually(lambda: len(consumer._receivers[0].arrived) == 18, "the other 18 buffered")

    await consumer.close()
    with pytest.raises(MersalError, match="closed"):
        await consumer.get()
    for delivery in handed_out:
        await delivery.ack()  # the last one settled: the session ends

    assert await count_unconsumed(broker, queue) == 18
    await transport.stop()
    assert await count_unconsumed(broker, queue) == 18
    returned = [(await broker.get(queue)).message_id for _ in range(18)]
    assert returned == [f"m-{n}" for n in range(2, 20)]


async def test_what_a_closed_consumer_still_receives_goes_back_once_its_deliveries_are_settled(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    await transport.send(numbered(queue, 2))
    consumer = await transport.consume(queue, prefetch=20)
    handed_out = [await receive(consumer), await receive(consumer)]

    await consumer.close()  # its worker drains: the two are still being handled
    await transport.send([Outgoing(queue, envelope(f"later-{n}")) for n in range(5)])
    with pytest.raises(MersalError, match="closed"):
        await consumer.get()  # what the credit left let in is not handed out
    for delivery in handed_out:
        await delivery.ack()  # the last one settled: the session ends, the rest goes back

    assert await count_unconsumed(broker, queue) == 5
    await transport.stop()
    later = sorted([(await broker.get(queue)).message_id for _ in range(5)])
    assert later == [f"later-{n}" for n in range(5)]


async def test_a_delivery_acked_right_before_stop_stays_acked(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    returned = []
    for attempt in range(20):  # a race: about one stop in three loses the ack
        queue = f"{prefix}.in-{attempt}"  # quorum, as an app's queues are
        transport = await started(make_transport, queue)
        await transport.send([Outgoing(queue, envelope(f"m-{attempt}"))])
        consumer = await transport.consume(queue, prefetch=1)
        await (await receive(consumer)).ack()
        await transport.stop()
        returned.append(await count_unconsumed(broker, queue))

    assert returned == [0] * 20


async def test_a_delivery_given_back_while_its_consumer_closes_keeps_its_place(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    await transport.send(numbered(queue, 6))
    consumer = await transport.consume(queue, prefetch=6)
    first, second = await receive(consumer), await receive(consumer)
    await eventually(lambda: len(consumer._receivers[0].arrived) == 4, "the other 4 buffered")

    await consumer.close()
    await first.ack()
    await second.nack(requeue=True)  # what the worker does with what it did not get to

    assert await count_unconsumed(broker, queue) == 5
    await transport.stop()
    returned = [(await broker.get(queue)).message_id for _ in range(5)]
    assert returned == [f"m-{n}" for n in range(1, 6)]
    assert await count_unconsumed(broker, queue) == 0


async def test_a_message_sent_over_amqp10_is_durable_and_keeps_its_id_over_0_9_1(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    sent: Envelope = envelope("m-091", b'{"a":1}')
    await transport.send([Outgoing(queue, sent)])

    read = await broker.get(queue)

    assert read.message_id == "m-091"
    assert read.correlation_id == sent.headers[Header.CORRELATION_ID]
    assert read.content_type == "application/json"
    assert read.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert read.body == b'{"a":1}'
