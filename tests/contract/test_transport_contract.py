"""The contract every transport meets: run unchanged against each kind in `transport_factory`.

Waits for something to happen are bounded with `asyncio.timeout`; the only fixed waits are
short ones that check something does *not* happen.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable
from uuid import uuid4

import pytest

from mersal import Envelope, Header, MersalError, Outgoing, Transport, Unroutable
from mersal.transport import Consumer, Delivery
from tests.support import unique

pytestmark = pytest.mark.timeout(10)

MakeTransport = Callable[[], Awaitable[Transport]]

ARRIVAL = 2.0  # seconds a message that should arrive may take
ABSENCE = 0.3  # seconds we watch for a message that should not arrive


def envelope(body: bytes, headers: dict[str, str] | None = None) -> Envelope:
    """An envelope with a fresh message id and the given extra headers."""
    return Envelope({Header.MESSAGE_ID: uuid4().hex, **(headers or {})}, body)


async def receive(consumer: Consumer, within: float = ARRIVAL) -> Delivery:
    """The next delivery, failing the test if none arrives in time."""
    async with asyncio.timeout(within):
        return await consumer.get()


async def assert_nothing_delivered(consumer: Consumer) -> None:
    """Watch the consumer briefly: no delivery may arrive."""
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(consumer.get(), ABSENCE)


async def declared(transport: Transport, prefix: str = "q") -> str:
    """A new declared queue's name."""
    queue = unique(prefix)
    await transport.declare(queue)
    return queue


# Sending and receiving.


async def test_a_sent_message_arrives_with_the_same_body_and_headers(
    transport: Transport,
) -> None:
    queue = await declared(transport)
    sent = envelope(
        b"\x00\xff binary body \xe2\x9c\x93",
        {
            Header.TYPE: "orders.PlaceOrder.v1",
            Header.CORRELATION_ID: "c-1",
            Header.CONTENT_TYPE: "application/json",
            "x-custom": "caf\u00e9 \u2713",
            "x-empty": "",
        },
    )
    await transport.send([Outgoing(queue, sent)])
    consumer = await transport.consume(queue, prefetch=1)

    delivery = await receive(consumer)

    assert delivery.envelope.body == sent.body
    assert delivery.envelope.headers == sent.headers
    assert delivery.queue == queue
    assert delivery.redelivered is False
    await delivery.ack()


async def test_messages_on_one_queue_arrive_in_the_order_sent(transport: Transport) -> None:
    queue = await declared(transport)
    for i in range(100):
        await transport.send([Outgoing(queue, envelope(f"m-{i}".encode()))])
    consumer = await transport.consume(queue, prefetch=10)

    received = []
    for _ in range(100):
        delivery = await receive(consumer)
        received.append(delivery.envelope.body)
        await delivery.ack()

    assert received == [f"m-{i}".encode() for i in range(100)]


async def test_one_send_of_several_messages_keeps_their_order(transport: Transport) -> None:
    queue = await declared(transport)
    other = await declared(transport)
    batch = [Outgoing(queue, envelope(f"b-{i}".encode())) for i in range(5)]
    batch.insert(2, Outgoing(other, envelope(b"elsewhere")))
    await transport.send(batch)
    consumer = await transport.consume(queue, prefetch=10)

    received = []
    for _ in range(5):
        delivery = await receive(consumer)
        received.append(delivery.envelope.body)
        await delivery.ack()

    assert received == [f"b-{i}".encode() for i in range(5)]
    elsewhere = await receive(await transport.consume(other, prefetch=1))
    assert elsewhere.envelope.body == b"elsewhere"
    await elsewhere.ack()


# Declaring.


async def test_declare_is_idempotent_and_keeps_what_the_queue_holds(
    transport_factory: MakeTransport,
) -> None:
    first, second = await transport_factory(), await transport_factory()
    queue = await declared(first)
    await first.send([Outgoing(queue, envelope(b"kept"))])

    await first.declare(queue)
    await second.declare(queue)

    consumer = await second.consume(queue, prefetch=5)
    delivery = await receive(consumer)
    assert delivery.envelope.body == b"kept"
    await delivery.ack()
    await assert_nothing_delivered(consumer)


async def test_sending_to_an_undeclared_queue_raises_unroutable(transport: Transport) -> None:
    with pytest.raises(Unroutable):
        await transport.send([Outgoing(unique("missing"), envelope(b"lost"))])


async def test_consuming_an_undeclared_queue_raises(transport: Transport) -> None:
    with pytest.raises(MersalError):
        await transport.consume(unique("missing"), prefetch=1)


# Acknowledgement.


async def test_an_acked_message_is_gone(transport: Transport) -> None:
    queue = await declared(transport)
    await transport.send([Outgoing(queue, envelope(b"once"))])
    consumer = await transport.consume(queue, prefetch=1)
    delivery = await receive(consumer)
    await delivery.ack()
    await consumer.close()

    fresh = await transport.consume(queue, prefetch=1)

    await assert_nothing_delivered(fresh)


async def test_a_nacked_message_comes_back_marked_redelivered(
    transport: Transport,
) -> None:
    queue = await declared(transport)
    sent = envelope(b"again", {Header.TYPE: "t.Again", Header.ATTEMPT: "1"})
    await transport.send([Outgoing(queue, sent), Outgoing(queue, envelope(b"behind"))])
    consumer = await transport.consume(queue, prefetch=1)
    delivery = await receive(consumer)
    assert delivery.redelivered is False

    await delivery.nack(requeue=True)

    # first again on the memory transport and classic queues; behind the rest on quorum queues
    both = []
    for _ in range(2):
        both.append(await receive(consumer))
        await both[-1].ack()
    again = next(one for one in both if one.envelope.body == sent.body)
    behind = next(one for one in both if one.envelope.body == b"behind")
    assert again.redelivered is True
    assert again.envelope.headers == sent.headers
    assert behind.redelivered is False


async def test_a_message_nacked_without_requeue_is_not_delivered_again(
    transport: Transport,
) -> None:
    queue = await declared(transport)
    await transport.send([Outgoing(queue, envelope(b"rejected"))])
    consumer = await transport.consume(queue, prefetch=1)
    delivery = await receive(consumer)

    await delivery.nack(requeue=False)

    await assert_nothing_delivered(consumer)


async def test_prefetch_caps_the_unacked_deliveries_of_a_consumer(transport: Transport) -> None:
    queue = await declared(transport)
    await transport.send([Outgoing(queue, envelope(f"p-{i}".encode())) for i in range(3)])
    consumer = await transport.consume(queue, prefetch=2)
    first = await receive(consumer)
    second = await receive(consumer)

    third = asyncio.create_task(consumer.get())
    done, _ = await asyncio.wait({third}, timeout=ABSENCE)
    assert not done, "a third delivery arrived while two were unacked with prefetch=2"

    await first.ack()
    async with asyncio.timeout(ARRIVAL):
        delivery = await third
    assert [d.envelope.body for d in (first, second, delivery)] == [b"p-0", b"p-1", b"p-2"]
    await second.ack()
    await delivery.ack()


async def test_competing_consumers_each_get_some_and_every_message_exactly_once(
    transport_factory: MakeTransport,
) -> None:
    one, two = await transport_factory(), await transport_factory()
    queue = await declared(one)
    total = 200
    seen: dict[str, list[bytes]] = {"one": [], "two": []}
    all_in = asyncio.Event()

    async def work(name: str, consumer: Consumer) -> None:
        while True:
            delivery = await consumer.get()
            seen[name].append(delivery.envelope.body)
            await delivery.ack()
            if sum(map(len, seen.values())) >= total:
                all_in.set()
            await asyncio.sleep(0)  # the handler's work: let the other consumer run too

    consumers = [await one.consume(queue, prefetch=10), await two.consume(queue, prefetch=10)]
    tasks = [
        asyncio.create_task(work(name, consumer))
        for name, consumer in zip(seen, consumers, strict=True)
    ]
    try:
        await one.send([Outgoing(queue, envelope(f"w-{i}".encode())) for i in range(total)])
        async with asyncio.timeout(5):
            await all_in.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    everything = seen["one"] + seen["two"]
    assert len(everything) == total
    assert sorted(everything) == sorted(f"w-{i}".encode() for i in range(total))
    assert seen["one"], "the first consumer got nothing"
    assert seen["two"], "the second consumer got nothing"
    await assert_nothing_delivered(await one.consume(queue, prefetch=1))


# Publish and subscribe.


async def test_a_published_message_reaches_each_bound_queue_once(transport: Transport) -> None:
    topic, other_topic = unique("t.x"), unique("t.y")
    first, second, unrelated = [await declared(transport, name) for name in "abc"]
    await transport.bind(first, topic)
    await transport.bind(second, topic)
    await transport.bind(second, topic)  # binding twice still delivers one copy
    await transport.bind(unrelated, other_topic)
    sent = envelope(b"event", {Header.TYPE: "orders.OrderPlaced"})

    await transport.send([Outgoing(topic, sent, publish=True)])

    for queue in (first, second):
        consumer = await transport.consume(queue, prefetch=5)
        delivery = await receive(consumer)
        assert delivery.envelope.body == sent.body
        assert delivery.envelope.headers == sent.headers
        assert delivery.queue == queue
        await delivery.ack()
        await assert_nothing_delivered(consumer)
    await assert_nothing_delivered(await transport.consume(unrelated, prefetch=5))


async def test_publishing_on_a_topic_nobody_binds_does_not_raise(transport: Transport) -> None:
    await transport.send([Outgoing(unique("t.nobody"), envelope(b"void"), publish=True)])

    queue = await declared(transport)
    await transport.send([Outgoing(queue, envelope(b"after"))])
    delivery = await receive(await transport.consume(queue, prefetch=1))
    assert delivery.envelope.body == b"after"  # the transport goes on as before


async def test_binding_an_undeclared_queue_fails_at_bind_time(transport: Transport) -> None:
    topic = unique("t.x")

    with pytest.raises(MersalError):
        await transport.bind(unique("missing"), topic)
    await transport.send([Outgoing(topic, envelope(b"event"), publish=True)])


# Delayed delivery.


async def test_a_message_with_deliver_at_waits_for_its_time(transport: Transport) -> None:
    queue = await declared(transport)
    consumer = await transport.consume(queue, prefetch=5)
    start = time.monotonic()
    later = envelope(b"later", {Header.DELIVER_AT: f"{time.time() + 0.3:.6f}"})
    await transport.send([Outgoing(queue, later)])
    await transport.send([Outgoing(queue, envelope(b"now"))])

    first = await receive(consumer)
    assert first.envelope.body == b"now"
    await first.ack()
    second = await receive(consumer)
    waited = time.monotonic() - start

    assert second.envelope.body == b"later"
    assert second.envelope.message_id == later.message_id
    assert waited >= 0.25, f"delivered after {waited:.3f}s, before its deliver-at time"
    await second.ack()


# Stopping and closing.


async def test_stopping_returns_unacked_deliveries_to_the_queue(
    transport_factory: MakeTransport,
) -> None:
    first = await transport_factory()
    queue = await declared(first)
    sent = envelope(b"unfinished", {Header.TYPE: "t.Work"})
    await first.send([Outgoing(queue, sent)])
    taken = await receive(await first.consume(queue, prefetch=1))
    assert taken.redelivered is False

    await first.stop()

    second = await transport_factory()
    delivery = await receive(await second.consume(queue, prefetch=1))
    assert delivery.redelivered is True
    assert delivery.envelope.body == sent.body
    assert delivery.envelope.headers == sent.headers
    await delivery.ack()


async def test_stopping_returns_unacked_deliveries_in_their_original_order(
    transport_factory: MakeTransport,
) -> None:
    first = await transport_factory()
    queue = await declared(first)
    await first.send([Outgoing(queue, envelope(f"o-{i}".encode())) for i in range(5)])
    consumer = await first.consume(queue, prefetch=10)
    for _ in range(5):
        await receive(consumer)

    await first.stop()

    second = await transport_factory()
    again = await second.consume(queue, prefetch=10)
    bodies = [(await receive(again)).envelope.body for _ in range(5)]
    assert bodies == [f"o-{i}".encode() for i in range(5)]


async def test_a_temporary_queue_is_gone_once_its_transport_stops(
    transport_factory: MakeTransport,
) -> None:
    owner, other = await transport_factory(), await transport_factory()
    queue = unique("replies")
    await owner.declare(queue, temporary=True)
    consumer = await owner.consume(queue, prefetch=1)
    await other.send([Outgoing(queue, envelope(b"reply"))])
    delivery = await receive(consumer)
    assert delivery.envelope.body == b"reply"
    await delivery.ack()

    await owner.stop()

    with pytest.raises(Unroutable):
        await other.send([Outgoing(queue, envelope(b"too late"))])


async def test_closing_a_consumer_ends_a_pending_get(transport: Transport) -> None:
    queue = await declared(transport)
    consumer = await transport.consume(queue, prefetch=1)
    pending = asyncio.create_task(consumer.get())
    done, _ = await asyncio.wait({pending}, timeout=0.05)
    assert not done, "get() returned from an empty queue"

    await consumer.close()

    async with asyncio.timeout(ARRIVAL):
        (outcome,) = await asyncio.gather(pending, return_exceptions=True)
    assert isinstance(outcome, Exception), f"get() after close gave {outcome!r}"


async def test_a_delivery_taken_before_close_can_still_be_acked(transport: Transport) -> None:
    queue = await declared(transport)
    await transport.send([Outgoing(queue, envelope(b"owed"))])
    consumer = await transport.consume(queue, prefetch=1)
    delivery = await receive(consumer)

    await consumer.close()
    await delivery.ack()

    await assert_nothing_delivered(await transport.consume(queue, prefetch=1))


async def test_a_cancelled_get_loses_no_message(transport: Transport) -> None:
    queue = await declared(transport)
    consumer = await transport.consume(queue, prefetch=1)
    await assert_nothing_delivered(consumer)  # a get() cancelled by its timeout

    await transport.send([Outgoing(queue, envelope(b"after"))])

    delivery = await receive(consumer)
    assert delivery.envelope.body == b"after"
    await delivery.ack()


# Error queues and isolation.


async def test_an_error_queue_is_just_a_queue(transport: Transport) -> None:
    queue = await declared(transport, "error")
    failed = envelope(
        b'{"order_id": "o-1"}',
        {
            Header.TYPE: "orders.PlaceOrder.v1",
            Header.ERROR_TYPE: "builtins.ValueError",
            Header.ERROR_MESSAGE: "amount must be positive: \u20ac-1",
            Header.ERROR_TRACEBACK: 'Traceback (most recent call last):\n  File "x.py"\nValueError',
            Header.ERROR_ATTEMPTS: "3",
            Header.ERROR_QUEUE: "orders",
            Header.FAILED_AT: f"{time.time():.6f}",
        },
    )

    await transport.send([Outgoing(queue, failed)])

    delivery = await receive(await transport.consume(queue, prefetch=1))
    assert delivery.envelope.headers == failed.headers
    assert delivery.envelope.body == failed.body
    await delivery.ack()


async def test_changing_an_envelope_after_sending_it_does_not_change_the_delivery(
    transport: Transport,
) -> None:
    queue = await declared(transport)
    sent = envelope(b"body", {"x-state": "as sent"})
    await transport.send([Outgoing(queue, sent)])

    sent.headers["x-state"] = "changed by the sender"

    delivery = await receive(await transport.consume(queue, prefetch=1))
    assert delivery.envelope.headers["x-state"] == "as sent"


async def test_a_redelivery_carries_the_headers_as_sent_not_as_a_consumer_changed_them(
    transport: Transport,
) -> None:
    queue = await declared(transport)
    sent = envelope(b"body", {"x-state": "as sent"})
    await transport.send([Outgoing(queue, sent)])
    consumer = await transport.consume(queue, prefetch=1)
    delivery = await receive(consumer)
    delivery.envelope.headers["x-state"] = "changed while handling"
    delivery.envelope.headers["x-added"] = "by a step"

    await delivery.nack(requeue=True)

    again = await receive(consumer)
    assert (
        again.envelope.headers
        == sent.headers
        == {
            Header.MESSAGE_ID: sent.message_id,
            "x-state": "as sent",
        }
    )
