"""The RabbitMQ transport against a real broker: the memory transport's semantics, on AMQP."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal

import aio_pika
import aiormq
import pytest

from mersal import (
    ConfigurationError,
    Envelope,
    Header,
    MersalError,
    OutcomeUnknown,
    Outgoing,
    Unroutable,
    Unsendable,
)
from mersal.dead_letters import LookingWouldLose
from mersal_rabbitmq import RabbitMQTransport
from mersal_rabbitmq.delays import wait_milliseconds, wait_queue_name
from mersal_rabbitmq.publishing import Publisher, distinct_runs
from tests.mersal_rabbitmq.support import rabbitmqctl
from tests.support import Broker, eventually, rabbitmqctl_rows

pytestmark = pytest.mark.integration

Make = Callable[..., RabbitMQTransport]


def envelope(message_id: str, body: bytes = b"{}", **headers: str) -> Envelope:
    """An envelope as the core's outgoing steps would build it."""
    now = f"{time.time():.6f}"
    base = {
        Header.MESSAGE_ID: message_id,
        Header.TYPE: "tests.Thing",
        Header.CORRELATION_ID: f"c-{message_id}",
        Header.SENT_AT: now,
        Header.CONTENT_TYPE: "application/json",
        Header.REPLY_TO: "replies",
    }
    base.update(headers)
    return Envelope(base, body)


async def started(make: Make, *queues: str, **options: object) -> RabbitMQTransport:
    """A started transport with `queues` declared."""
    transport = make(**options)
    await transport.start()
    for queue in queues:
        await transport.declare(queue)
    return transport


async def test_a_plain_json_message_from_another_producer_becomes_an_envelope(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    await broker.publish(
        aio_pika.Message(b'{"order_id": "o-1"}', type="orders.PlaceOrder.v1", message_id="m-1"),
        queue,
    )
    consumer = await transport.consume(queue, prefetch=4)
    delivery = await asyncio.wait_for(consumer.get(), 5)

    assert delivery.envelope.headers == {
        Header.MESSAGE_ID: "m-1",
        Header.TYPE: "orders.PlaceOrder.v1",
    }
    assert delivery.envelope.body == b'{"order_id": "o-1"}'
    assert delivery.queue == queue
    assert delivery.redelivered is False
    await delivery.ack()
    await consumer.close()
    assert await broker.count(queue) == 0


async def test_a_sent_message_carries_amqp_properties_and_string_headers(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    sent = envelope("m-2", b'{"x": 1}', **{Header.CAUSATION_ID: "m-0"})
    await transport.send([Outgoing(queue, sent)])

    message = await broker.get(queue)
    assert message.message_id == "m-2"
    assert message.correlation_id == "c-m-2"
    assert message.type == "tests.Thing"
    assert message.reply_to == "replies"
    assert message.content_type == "application/json"
    assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert message.timestamp is not None
    assert abs(message.timestamp.timestamp() - float(sent.headers[Header.SENT_AT])) < 1.0
    in_properties = {
        Header.MESSAGE_ID,
        Header.CORRELATION_ID,
        Header.TYPE,
        Header.REPLY_TO,
        Header.CONTENT_TYPE,
    }
    carried = {k: v for k, v in message.headers.items() if k != "x-delivery-count"}  # quorum's
    assert carried == {k: v for k, v in sent.headers.items() if k not in in_properties}
    assert json.loads(message.body) == {"x": 1}

    consumer = await transport.consume(queue, prefetch=1)
    await transport.send([Outgoing(queue, sent)])
    delivery = await asyncio.wait_for(consumer.get(), 5)
    assert delivery.envelope.headers == sent.headers  # restored from the properties
    await delivery.ack()
    await consumer.close()


async def test_header_values_of_other_types_become_strings_and_lists_are_dropped(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    headers = {
        "count": 3,
        "ratio": 0.5,
        "flag": True,
        "raw": bytearray(b"bytes"),
        "price": Decimal("9.50"),
        "when": datetime(2025, 1, 2, tzinfo=UTC),
        "none": None,
        "list": [1, 2],
        "table": {"a": 1},
        "s": "x",
    }
    await broker.publish(aio_pika.Message(b"{}", headers=headers, message_id="m-3"), queue)
    consumer = await transport.consume(queue, prefetch=1)
    delivery = await asyncio.wait_for(consumer.get(), 5)

    assert delivery.envelope.headers == {
        "count": "3",
        "ratio": "0.5",
        "flag": "true",
        "raw": "bytes",
        "price": "9.50",
        "when": f"{datetime(2025, 1, 2, tzinfo=UTC).timestamp():.6f}",
        "s": "x",
        Header.MESSAGE_ID: "m-3",
    }
    await delivery.ack()


async def test_sending_to_a_missing_queue_raises_unroutable(
    make_transport: Make, prefix: str
) -> None:
    transport = await started(make_transport)
    with pytest.raises(Unroutable, match=f"{prefix}.missing"):
        await transport.send([Outgoing(f"{prefix}.missing", envelope("m-4"))])
    with pytest.raises(Unroutable, match=f"{prefix}.missing"):
        delayed = envelope("m-5", **{Header.DELIVER_AT: f"{time.time() + 5:.6f}"})
        await transport.send([Outgoing(f"{prefix}.missing", delayed)])
    with pytest.raises(Unroutable, match=f"{prefix}.missing"):
        await transport.consume(f"{prefix}.missing", prefetch=1)


async def test_a_publish_reaches_every_bound_queue_and_no_other(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    first, second, other = f"{prefix}.a", f"{prefix}.b", f"{prefix}.c"
    topic = f"{prefix}.orders.OrderPlaced.v1"
    transport = await started(make_transport, first, second, other)
    await transport.bind(first, topic)
    await transport.bind(second, topic)
    await transport.bind(other, f"{prefix}.orders.OrderPlaced")

    await transport.send([Outgoing(topic, envelope("m-6"), publish=True)])
    await transport.send([Outgoing(f"{prefix}.nobody.listens", envelope("m-7"), publish=True)])

    assert (await broker.get(first)).message_id == "m-6"
    assert (await broker.get(second)).message_id == "m-6"
    assert await broker.count(other) == 0


async def test_a_delayed_send_waits_in_its_wait_queue_then_arrives(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    sent_at = time.time()
    delayed = envelope("m-8", **{Header.DELIVER_AT: f"{sent_at + 0.3:.6f}"})
    await transport.send([Outgoing(queue, delayed), Outgoing(queue, envelope("m-9"))])

    assert (await broker.get(queue)).message_id == "m-9"
    (waiting,) = [name for name in transport.queues if name.startswith(f"{queue}.wait.")]
    assert int(waiting.rsplit(".", 1)[1]) <= 300  # the time left when it was sent, in ms
    assert await broker.count(waiting) == 1
    assert (await broker.get(queue)).message_id == "m-8"
    assert time.time() - sent_at >= 0.3


async def test_a_deliver_at_in_the_past_is_sent_at_once(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    await transport.send([Outgoing(queue, envelope("m-10", **{Header.DELIVER_AT: "0"}))])
    assert (await broker.get(queue, timeout=1)).message_id == "m-10"
    assert transport.queues == [queue]


async def test_a_dead_lettered_message_arrives_without_the_brokers_death_headers(
    make_transport: Make, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    delayed = envelope("m-11", **{Header.DELIVER_AT: f"{time.time() + 0.05:.6f}"})
    await transport.send([Outgoing(queue, delayed)])
    consumer = await transport.consume(queue, prefetch=1)
    delivery = await asyncio.wait_for(consumer.get(), 5)

    assert delivery.envelope.message_id == "m-11"
    assert not [key for key in delivery.envelope.headers if "death" in key]
    assert delivery.envelope.headers[Header.DELIVER_AT] == delayed.headers[Header.DELIVER_AT]
    await delivery.ack()


async def test_a_nacked_delivery_comes_back_marked_redelivered(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    await transport.send([Outgoing(queue, envelope("m-12"))])
    consumer = await transport.consume(queue, prefetch=1)

    first = await asyncio.wait_for(consumer.get(), 5)
    assert first.redelivered is False
    await first.nack(requeue=True)
    again = await asyncio.wait_for(consumer.get(), 5)
    assert again.envelope.message_id == "m-12"
    assert again.redelivered is True
    await again.ack()
    with pytest.raises(Exception, match="already"):
        await again.ack()
    await consumer.close()
    assert await broker.count(queue) == 0


async def test_declaring_a_queue_that_exists_with_other_arguments_raises(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.limited"
    await broker.declare(
        queue, durable=True, arguments={"x-queue-type": "quorum", "x-max-length": 5}
    )
    transport = await started(make_transport)

    with pytest.raises(ConfigurationError) as caught:
        await transport.declare(queue)
    assert repr(queue) in str(caught.value)
    assert "x-max-length" in str(caught.value)
    # the 406 closed the declaring channel: the next declaration gets a fresh one
    await transport.declare(f"{prefix}.fine")
    await transport.send([Outgoing(f"{prefix}.fine", envelope("m-13"))])
    assert (await broker.get(f"{prefix}.fine")).message_id == "m-13"


@pytest.mark.parametrize(
    ("arguments", "classic"),
    [
        ({"x-max-length": 100000, "x-queue-type": "classic"}, True),
        ({"x-queue-mode": "lazy", "x-message-ttl": 60000, "x-overflow": "reject-publish"}, True),
        ({"x-single-active-consumer": True, "x-dead-letter-exchange": "it's"}, True),
        ({"x-queue-type": "quorum", "x-max-length": 100000}, False),
    ],
)
async def test_without_the_management_api_a_queues_other_arguments_do_not_hide_its_type(
    make_transport: Make, broker: Broker, prefix: str, arguments: dict[str, object], classic: bool
) -> None:
    queue = f"{prefix}.error"
    await broker.declare(queue, durable=True, arguments=arguments)
    transport = await started(make_transport)
    checking = transport.check_give_back(queue, management="http://127.0.0.1:1")
    if classic:
        await checking
    else:
        with pytest.raises(LookingWouldLose, match="not a classic queue"):
            await checking


async def test_quorum_queues_and_their_wait_queues(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.q"
    transport = await started(make_transport, queue, queue_type="quorum")
    delayed = envelope("m-14", **{Header.DELIVER_AT: f"{time.time() + 0.1:.6f}"})
    await transport.send([Outgoing(queue, delayed)])
    assert (await broker.get(queue)).message_id == "m-14"
    with pytest.raises(ConfigurationError) as caught:
        await (await started(make_transport, queue_type="classic")).declare(queue)
    assert "exists as a quorum queue, and this app declares classic" in str(caught.value)
    assert "mersal queues migrate --to classic --app module:app" in str(caught.value)
    assert f"--queue {queue} --transport URL" in str(caught.value)


async def test_queues_are_quorum_unless_the_transport_or_its_url_says_classic(
    make_transport: Make, prefix: str, url: str, vhost: str
) -> None:
    await started(make_transport, f"{prefix}.default")
    separator = "&" if "?" in url else "?"
    classic = RabbitMQTransport(f"{url}{separator}queue_type=classic")
    await classic.start()
    try:
        assert classic.queue_type == "classic"
        await classic.declare(f"{prefix}.classic")
    finally:
        await classic.stop()
    rows = await asyncio.to_thread(rabbitmqctl_rows, "list_queues", "-p", vhost, "name", "type")
    types = {row["name"]: row["type"] for row in rows}
    assert types[f"{prefix}.default"] == "quorum"
    assert types[f"{prefix}.classic"] == "classic"


async def test_a_wait_queue_left_as_classic_is_used_as_it_is(
    make_transport: Make, broker: Broker, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    queue = f"{prefix}.q"
    transport = await started(make_transport, queue)
    # the wait queue is chosen by the delay left at the send: a classic one for each it may be
    waits = {wait_queue_name("", queue, ms): ms for ms in range(1000, 2100, 100)}
    for waiting, milliseconds in waits.items():
        await broker.declare(
            waiting,
            durable=True,
            arguments={
                "x-message-ttl": milliseconds,
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": queue,
            },
        )
    delayed = envelope("m-15", **{Header.DELIVER_AT: f"{time.time() + 2.0:.6f}"})
    await transport.send([Outgoing(queue, delayed)])
    assert (await broker.get(queue, timeout=10)).message_id == "m-15"
    used = [w for w in waits if f"wait queue {w!r} is a classic queue, not quorum" in caplog.text]
    assert len(used) == 1, caplog.text


async def test_deliveries_returned_by_a_closing_consumer_keep_their_place_in_the_queue(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.ordered"
    transport = await started(make_transport, queue)  # quorum: a nack would go to the tail
    await transport.send([Outgoing(queue, envelope(f"m-{n}", str(n).encode())) for n in range(6)])
    consumer = await transport.consume(queue, prefetch=3)
    held = [await asyncio.wait_for(consumer.get(), 5) for _ in range(3)]
    await held[0].ack()
    await consumer.close()
    for delivery in held[1:]:  # what the worker does with deliveries it did not get to
        await delivery.nack(requeue=True)
    # the channel closes after the last one settled; then all five are back, in their places
    await eventually(lambda: broker_count_is(broker, queue, 5), "the channel closed")

    again = await transport.consume(queue, prefetch=10)
    bodies = []
    for _ in range(5):
        delivery = await asyncio.wait_for(again.get(), 5)
        bodies.append(delivery.envelope.body)
        await delivery.ack()
    assert bodies == [b"1", b"2", b"3", b"4", b"5"]


async def test_a_closed_consumer_without_acks_takes_nothing_more(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.noack"
    transport = await started(make_transport, queue, ack_mode="none")
    await transport.send([Outgoing(queue, envelope("m-0"))])
    consumer = await transport.consume(queue, prefetch=1)
    await asyncio.wait_for(consumer.get(), 5)
    await consumer.close()

    await transport.send([Outgoing(queue, envelope(f"m-{n}")) for n in range(1, 21)])

    await eventually(lambda: broker_count_is(broker, queue, 20), "all 20 left in the queue")


async def test_one_batch_with_a_repeated_message_id_delivers_both(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue, channels=1)
    batch = [Outgoing(queue, envelope(f"m-{n % 3}", str(n).encode())) for n in range(9)]
    await asyncio.gather(transport.send(batch), transport.send(batch))

    bodies = [(await broker.get(queue)).body for _ in range(18)]
    assert sorted(bodies) == sorted([str(n).encode() for n in range(9)] * 2)
    assert [len(run) for run in distinct_runs(batch)] == [3, 3, 3]


async def test_closing_a_consumer_returns_buffered_deliveries_in_order_after_the_handed_out_ones(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    await transport.send([Outgoing(queue, envelope(f"m-{n}")) for n in range(3)])
    consumer = await transport.consume(queue, prefetch=5)
    held = await asyncio.wait_for(consumer.get(), 5)
    await eventually(
        lambda: broker_count_is(broker, queue, 0), "the other two delivered to the consumer"
    )

    await consumer.close()
    with pytest.raises(Exception, match="closed"):
        await consumer.get()
    assert await broker.count(queue) == 0  # buffered ones wait for the channel's close
    await held.ack()  # still owed after close, and its channel is still open
    await eventually(lambda: broker_count_is(broker, queue, 2), "the two buffered returned")
    await transport.stop()
    await broker.publish(aio_pika.Message(b"{}", message_id="m-after"), queue)
    after_stop = [(await broker.get(queue)).message_id for _ in range(3)]
    assert after_stop == ["m-1", "m-2", "m-after"]
    assert await broker.count(queue) == 0


async def broker_count_is(broker: Broker, queue: str, expected: int) -> bool:
    """Whether `queue` holds `expected` ready messages."""
    return await broker.count(queue) == expected


def test_delays_round_up_to_two_significant_digits() -> None:
    assert [wait_milliseconds(s) for s in (0.0001, 0.05, 0.099, 0.2, 1.234, 59.9)] == [
        1,
        50,
        99,
        200,
        1300,
        60000,
    ]
    assert wait_queue_name("", "orders", 200) == "orders.wait.200"
    assert wait_queue_name("mersal.events", "a.B", 200) == "mersal.events.a.B.wait.200"


async def test_an_unconfirmed_publish_is_outcome_unknown_and_can_be_sent_again(
    make_transport: Make, broker: Broker, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue, publish_timeout=0.3, channels=1)

    async def never_confirmed(*args: object, **kwargs: object) -> bool:
        await asyncio.sleep(10)
        return True

    monkeypatch.setattr(Publisher, "publish", never_confirmed)
    started_at = time.monotonic()
    with pytest.raises(OutcomeUnknown, match=r"not confirmed within 0\.3s"):
        await transport.send([Outgoing(queue, envelope("m-17"))])
    assert time.monotonic() - started_at < 1.0
    monkeypatch.undo()

    await transport.send([Outgoing(queue, envelope("m-17"))])
    assert (await broker.get(queue)).message_id == "m-17"


async def test_a_send_while_the_connection_closes_under_it_is_sent_or_outcome_unknown(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    """aiormq raises RuntimeError or a bare Exception there; a caller must see neither."""
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue, publish_timeout=0.5, channels=1)
    outcomes: dict[str, str] = {}
    for n in range(12):
        connection = transport._link.require()
        await connection.ready()
        underlay = connection.transport.connection  # type: ignore[union-attr]
        publisher = transport._publishing._pool._slots[0]
        if n % 2 and publisher is not None:  # every other time, the channel must be opened
            await publisher.channel.close()
        closing = asyncio.create_task(underlay.close(ConnectionError("closed by the test")))
        for _ in range(n // 2):  # the close runs a few steps ahead of the send
            await asyncio.sleep(0)
        try:
            await transport.send([Outgoing(queue, envelope(f"m-{n}"))])
            outcomes[f"m-{n}"] = "sent"
        except OutcomeUnknown:
            outcomes[f"m-{n}"] = "unknown"
        await closing

    await eventually(lambda: transport.connected, "reconnected", timeout=10)
    await transport.send([Outgoing(queue, envelope("m-after"))])
    received = {(await broker.get(queue)).message_id for _ in range(await broker.count(queue))}
    assert {message_id for message_id, outcome in outcomes.items() if outcome == "sent"} <= received
    assert "m-after" in received


async def test_a_send_in_flight_when_the_transport_stops_is_never_a_cancellation(
    make_transport: Make, prefix: str
) -> None:
    """aio-pika's close fails what is pending with CancelledError; the sender was not cancelled."""
    queue = f"{prefix}.in"
    for n in range(16):
        transport = await started(make_transport, queue, publish_timeout=2.0, channels=1)
        if n % 2:  # a publishing channel is open already
            await transport.send([Outgoing(queue, envelope(f"warm-{n}"))])
        sending = asyncio.create_task(transport.send([Outgoing(queue, envelope(f"m-{n}"))]))
        for _ in range(n // 2):
            await asyncio.sleep(0)
        await transport.stop()
        await asyncio.wait([sending], timeout=10)
        assert sending.done() and not sending.cancelled(), f"send {n} was cancelled"
        error = sending.exception()
        assert error is None or isinstance(error, MersalError), repr(error)


async def test_a_declaration_while_the_connection_is_lost_waits_for_the_reconnect(
    make_transport: Make, broker: Broker, prefix: str, vhost: str, url: str
) -> None:
    """Not aiormq's ConnectionClosed: what app.start and app.request declare comes through."""
    transport = await started(make_transport)
    declared: list[str] = []
    for n in range(3):
        # Blocking the loop on purpose: the broker's close waits unread, so the declaration
        # goes out on a connection that is already closed and learns it mid-call.
        rabbitmqctl("close_all_connections", "-p", vhost, "test")
        queue = f"{prefix}.after-close-{n}"
        await transport.declare(queue)
        await transport.bind(queue, f"tests.Topic{n}")
        declared.append(queue)
    await eventually(lambda: transport.connected, "reconnected", timeout=10)
    for n in range(len(declared)):
        await transport.send([Outgoing(f"tests.Topic{n}", envelope(f"m-{n}"), publish=True)])
    async with await aio_pika.connect(url) as connection:  # the broker fixture's was closed
        fresh = Broker(url, connection, await connection.channel())
        received = [(await fresh.get(queue)).message_id for queue in declared]
    assert received == ["m-0", "m-1", "m-2"]


async def test_consuming_while_the_connection_is_lost_waits_for_the_reconnect(
    make_transport: Make, prefix: str, vhost: str
) -> None:
    """Not aiormq's AMQPConnectionError: app.start looks for partitions and consumes through."""
    queues = [f"{prefix}.in-{n}" for n in range(3)]
    transport = await started(make_transport, *queues)
    for queue in queues:
        rabbitmqctl("close_all_connections", "-p", vhost, "test")  # the close waits unread
        consumer = await transport.consume(queue, prefetch=1)
        await transport.send([Outgoing(queue, envelope(f"m-{queue}"))])
        delivery = await asyncio.wait_for(consumer.get(), 10)
        assert delivery.envelope.message_id == f"m-{queue}"
        await delivery.ack()
        await consumer.close()


async def test_a_send_right_after_the_broker_closed_the_connection_waits_for_it(
    make_transport: Make, broker: Broker, prefix: str, vhost: str
) -> None:
    """The channel's connection is gone; the send waits for the reconnect within its timeout."""
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue, publish_timeout=10.0)
    await transport.send([Outgoing(queue, envelope("m-before"))])  # a channel in the pool
    rabbitmqctl("close_all_connections", "-p", vhost, "test")  # the close waits unread
    await transport.send([Outgoing(queue, envelope("m-after"))])
    await eventually(lambda: transport.connected, "reconnected", timeout=10)


async def test_stop_ends_a_declaration_that_waits_for_a_reconnect(
    make_transport: Make, prefix: str, vhost: str
) -> None:
    transport = await started(make_transport)
    transport._link.pause = 60  # after the first failed round it would wait a minute
    transport._link.nodes = ["amqp://guest:guest@127.0.0.1:1/"]  # nobody answers there
    await asyncio.to_thread(rabbitmqctl, "close_all_connections", "-p", vhost, "test")
    declaring = asyncio.create_task(transport.declare(f"{prefix}.never"))
    await asyncio.sleep(0.3)
    assert not declaring.done()
    started_at = time.monotonic()
    await transport.stop()
    with pytest.raises(MersalError, match="not running"):
        await asyncio.wait_for(declaring, 5)
    assert time.monotonic() - started_at < 2


async def test_prefetch_bounds_the_unacknowledged_deliveries_and_stop_returns_them(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    await transport.send([Outgoing(queue, envelope(f"m-{n}")) for n in range(5)])
    consumer = await transport.consume(queue, prefetch=2)
    taken = [await asyncio.wait_for(consumer.get(), 5) for _ in range(2)]

    await taken[0].ack()  # room for one more
    taken.append(await asyncio.wait_for(consumer.get(), 5))  # the broker filled it ...
    assert await broker.count(queue) == 2  # ... and no more: the other two wait for room
    await transport.stop()  # unacknowledged deliveries go back to the queue
    await eventually(
        lambda: broker_count_is(broker, queue, 4), "the two unacknowledged back", timeout=10
    )
    assert [delivery.envelope.message_id for delivery in taken] == ["m-0", "m-1", "m-2"]


async def test_a_publish_the_broker_nacks_raises_a_mersal_error(
    make_transport: Make, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)

    async def nacked(*args: object, **kwargs: object) -> None:
        raise aiormq.exceptions.DeliveryError(None, aiormq.spec.Basic.Nack(delivery_tag=1))

    monkeypatch.setattr(aiormq.Channel, "basic_publish", nacked)
    with pytest.raises(MersalError, match="RabbitMQ refused") as caught:
        await transport.send([Outgoing(queue, envelope("m-19"))])
    assert not isinstance(caught.value, OutcomeUnknown | Unroutable)


async def test_the_password_never_reaches_the_logs(
    url: str, make_transport: Make, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="mersal.rabbitmq")
    transport = await started(make_transport, f"{prefix}.in")
    await transport.stop()
    wrong = RabbitMQTransport(url.replace("guest:guest@", "guest:s3cret@"))
    with pytest.raises(MersalError) as caught:
        await wrong.start()

    assert "guest:***@" in caplog.text
    assert "guest:guest" not in caplog.text
    assert "s3cret" not in str(caught.value)
    assert "s3cret" not in repr(wrong)


@pytest.mark.parametrize("ack_mode", ["on_receive", "none"])
async def test_with_acks_on_receive_or_none_a_delivery_leaves_the_queue_as_it_arrives(
    make_transport: Make, broker: Broker, prefix: str, ack_mode: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue, ack_mode=ack_mode)
    await transport.send([Outgoing(queue, envelope(f"m-{n}")) for n in range(3)])
    consumer = await transport.consume(queue, prefetch=10)
    received = [await asyncio.wait_for(consumer.get(), 5) for _ in range(3)]

    assert [d.envelope.message_id for d in received] == ["m-0", "m-1", "m-2"]
    await received[0].nack(requeue=True)  # nothing to return: it is gone already
    await consumer.close()
    await transport.stop()
    assert await broker.count(queue) == 0


@pytest.mark.parametrize("ack_mode", ["on_receive", "none"])
async def test_with_acks_on_receive_or_none_a_lost_channel_loses_no_buffered_delivery(
    make_transport: Make, prefix: str, ack_mode: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue, ack_mode=ack_mode)
    sent = [f"m-{n}" for n in range(20)]
    consumer = await transport.consume(queue, prefetch=20)
    await transport.send([Outgoing(queue, envelope(message_id)) for message_id in sent])
    first = await asyncio.wait_for(consumer.get(), 5)
    await eventually(lambda: consumer._buffer, "deliveries waiting in the buffer")
    channel = first.message.channel
    await channel.basic_ack(delivery_tag=first.message.delivery_tag + 1000)  # the broker closes it
    await eventually(lambda: channel.is_closed, "the consumer's channel closed")

    received = {first.envelope.message_id}
    while not received >= set(sent):  # the broker forgot them: none may be dropped
        received.add((await asyncio.wait_for(consumer.get(), 10)).envelope.message_id)

    assert received == set(sent)
    await consumer.close()
    await transport.stop()


def test_an_unknown_ack_mode_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="ack_mode"):
        RabbitMQTransport("amqp://guest:guest@127.0.0.1/", ack_mode="sometimes")


async def test_fire_and_forget_publishes_without_confirms_and_ignores_unroutable(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue, fire_and_forget=True)
    await transport.send([Outgoing(f"{prefix}.nowhere", envelope("m-lost"))])
    await transport.send([Outgoing(queue, envelope("m-kept"))])

    message = await broker.get(queue)
    assert message.message_id == "m-kept"


async def test_headers_too_large_for_a_frame_are_unsendable_and_the_connection_lives(
    make_transport: Make, broker: Broker, prefix: str
) -> None:
    queue = f"{prefix}.in"
    transport = await started(make_transport, queue)
    huge = envelope("m-huge", **{"x-note": "n" * 140_000})
    with pytest.raises(Unsendable, match="the broker takes"):
        await transport.send([Outgoing(queue, huge)])
    await transport.send([Outgoing(queue, envelope("m-after"))])
    assert (await broker.get(queue)).message_id == "m-after"
