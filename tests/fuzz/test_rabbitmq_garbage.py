"""Garbage from a producer that is not Mersal, on RabbitMQ: every delivery reaches the error queue.

A raw aio-pika producer publishes deliveries with properties and headers no Mersal app would
send. Each ends in the error queue once, with a DecodeError that says why and its body intact;
then the app still handles a good message, and nothing is left in its queue or unacknowledged.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import aio_pika
import pytest

from mersal import App, MessageContext, RetryPolicy
from tests.fuzz.amqp import headers_of
from tests.fuzz.corpus import PICKLE_BOMB, canaries_imported, nested
from tests.fuzz.rig import CAP, DECODE_ERROR, JSON, ORDER, Order
from tests.support import RABBITMQ_HOST, Broker, eventually

pytestmark = pytest.mark.integration

ORDER_BODY = b'{"order_id": "o-1", "amount": 9.5}'

# message id -> (the raw message, a fragment of the reason it must be dead-lettered with)
GARBAGE: dict[str, tuple[aio_pika.Message, str]] = {
    "no-type": (aio_pika.Message(ORDER_BODY, message_id="no-type"), "no type header"),
    "bytes-headers": (
        aio_pika.Message(
            ORDER_BODY,
            message_id="bytes-headers",
            headers={"type": bytearray(b"\xff\xfe\x00os.system"), "x-blob": bytearray(b"\x00\xff")},
        ),
        "unknown message type",
    ),
    "table-header": (
        aio_pika.Message(
            ORDER_BODY,
            message_id="table-header",
            headers={"type": {"name": ORDER}, "x-list": [1, "two", {"three": 3}]},
        ),
        "no type header",
    ),
    "odd-scalars": (
        aio_pika.Message(
            ORDER_BODY,
            message_id="odd-scalars",
            headers={
                "type": 12345,
                "attempt": 3e38,
                "deliver-at": None,
                "x-when": datetime(2001, 2, 3, tzinfo=UTC),
                "x-yes": True,
            },
        ),
        "unknown message type",
    ),
    "long-type": (
        aio_pika.Message(ORDER_BODY, message_id="long-type", headers={"type": "a" * 1_024}),
        "unknown message type",
    ),
    "pickle": (
        aio_pika.Message(
            PICKLE_BOMB,
            message_id="pickle",
            type=ORDER,
            content_type="application/x-python-pickle",
        ),
        "content type",
    ),
    "invalid-utf8": (
        aio_pika.Message(
            b'{"order_id": "\xff\xfe\xfd", "amount": 1}',
            message_id="invalid-utf8",
            type=ORDER,
            content_type=JSON,
        ),
        "Invalid UTF-8",
    ),
    "hostile-type": (
        aio_pika.Message(ORDER_BODY, message_id="hostile-type", type="subprocess.Popen"),
        "unknown message type",
    ),
    "deep": (
        aio_pika.Message(
            b'{"order_id": "o-1", "amount": 1, "x": %s}' % nested(3_000).encode(),
            message_id="deep",
            type=ORDER,
        ),
        "nests too deeply",
    ),
}


async def test_garbage_from_a_foreign_producer_ends_in_the_error_queue_with_a_reason(
    vhost: str, broker: Broker
) -> None:
    name = f"garbage-{uuid.uuid4().hex[:10]}"
    error_queue = f"{name}.error"
    handled: list[str] = []

    async def take_order(message: Order, context: MessageContext) -> None:
        handled.append(context.message_id)

    app = App(
        name,
        transport=f"amqp://guest:guest@{RABBITMQ_HOST}/{vhost}",
        retry=RetryPolicy(immediate=1, delayed=[60.0], error_queue=error_queue),
        max_body_size=CAP,
    )
    app.register(Order, take_order)
    broker.watch(app)

    async with app:
        for message, _ in GARBAGE.values():
            await broker.publish(message, name)
        good = aio_pika.Message(ORDER_BODY, message_id="good", type=ORDER, content_type=JSON)
        await broker.publish(good, name)
        await eventually(lambda: handled == ["good"], "the good message", timeout=10)
        dead = {}
        for _ in GARBAGE:
            arrived = await broker.get(error_queue, timeout=10)
            dead[arrived.message_id] = arrived
    # The app stopped: a delivery it left unacknowledged would be back in its queue now.
    assert await broker.count(name) == 0
    assert await broker.count(error_queue) == 0  # each one arrived exactly once

    assert handled == ["good"]
    assert set(dead) == set(GARBAGE)
    received = {message_id: headers_of(message) for message_id, message in dead.items()}
    for message_id, (sent, reason) in GARBAGE.items():
        headers = received[message_id]
        assert headers["error-type"] == DECODE_ERROR, message_id
        assert reason in headers["error-message"], (message_id, headers["error-message"])
        assert headers["error-source-queue"] == name
        assert dead[message_id].body == sent.body, message_id
    assert received["long-type"]["type"] == "a" * 1_024
    assert received["bytes-headers"]["type"] == "\ufffd\ufffd\x00os.system"
    assert received["bytes-headers"]["x-blob"] == "\x00\ufffd"
    assert received["odd-scalars"]["type"] == "12345"
    assert "deliver-at" not in received["odd-scalars"]
    assert received["pickle"]["content-type"] == "application/x-python-pickle"
    assert not canaries_imported()


async def test_a_delivery_with_huge_headers_still_reaches_the_error_queue(
    vhost: str, broker: Broker
) -> None:
    name = f"garbage-{uuid.uuid4().hex[:10]}"
    error_queue = f"{name}.error"
    app = App(
        name,
        transport=f"amqp://guest:guest@{RABBITMQ_HOST}/{vhost}",
        retry=RetryPolicy(immediate=0, delayed=[], error_queue=error_queue),
    )
    app.register(Order, _never_called)
    broker.watch(app)

    async with app:
        # 112,000 bytes of type name fit one frame; its dead letter, with the name repeated in
        # the error message and the traceback, does not.
        huge = aio_pika.Message(ORDER_BODY, message_id="huge", headers={"type": "a" * 112_000})
        await broker.publish(huge, name)

        dead = await broker.get(error_queue, timeout=4)

    assert dead.message_id == "huge"


async def _never_called(message: Order) -> None:
    raise AssertionError("no handler runs for an undecodable delivery")
