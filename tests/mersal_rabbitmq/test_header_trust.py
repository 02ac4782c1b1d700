"""Forged control headers from a raw producer on RabbitMQ steer nothing into silence.

RabbitMQ hands over what another client published as it is: a `deliver-at` header on it delays
nothing (only a Mersal sender turns deliver-at into a wait queue). A dead letter drops the forged
header: it is neither parked in `<error queue>.wait.<ms>` for as long as the header says nor, past
the 48 days RabbitMQ can wait, returned to its queue every second without end.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import pytest

from mersal import App, MessageContext, RetryPolicy
from tests.fuzz.amqp import headers_of
from tests.fuzz.rig import DOOMED, JSON, ORDER, Doom, Doomed, Order
from tests.support import Broker, eventually

pytestmark = pytest.mark.integration

DOOM_TYPE = f"{Doom.__module__}.{Doom.__qualname__}"
ORDER_BODY = json.dumps({"order_id": "o-1", "amount": 9.5}).encode()
DOOMED_BODY = json.dumps({"order_id": "o-1"}).encode()


class Running:
    """An app on the session's vhost, a raw producer, and what the handlers saw."""

    def __init__(self, app: App, broker: Broker, error_queue: str) -> None:
        self.app = app
        self.broker = broker
        self.error_queue = error_queue
        self.handled: list[str] = []
        self.failed: list[str] = []

    async def publish(self, message_id: str, type_name: str, body: bytes, **headers: Any) -> None:
        message = aio_pika.Message(
            body, message_id=message_id, type=type_name, content_type=JSON, headers=headers
        )
        await self.broker.publish(message, self.app.name)

    def wait_queues(self) -> list[str]:
        return [queue for queue in self.app.transport.queues if ".wait." in queue]  # type: ignore[attr-defined]


@pytest.fixture
async def running(amqp_url: str, broker: Broker) -> AsyncIterator[Running]:
    name = f"trust-{uuid.uuid4().hex[:10]}"
    app = App(
        name,
        transport=amqp_url,
        retry=RetryPolicy(immediate=1, delayed=[0.05], error_queue=f"{name}.error"),
    )
    setup = Running(app, broker, f"{name}.error")

    async def take_order(message: Order, context: MessageContext) -> None:
        setup.handled.append(context.message_id)

    async def doom(message: Doomed, context: MessageContext) -> None:
        setup.failed.append(context.message_id)
        raise Doom(f"{message.order_id} is doomed")

    app.register(Order, take_order)
    app.register(Doomed, doom)
    broker.watch(app)
    async with app:
        yield setup
    assert await broker.count(name) == 0  # nothing was left unacknowledged


async def test_a_forged_deliver_at_does_not_delay_handling(running: Running) -> None:
    day_ahead = f"{time.time() + 86_400:.6f}"

    await running.publish("m-1", ORDER, ORDER_BODY, **{"deliver-at": day_ahead})
    await eventually(lambda: running.handled == ["m-1"], "handling at once", timeout=5)

    assert running.wait_queues() == []


@pytest.mark.parametrize("deliver_at", ["a-day-ahead", "1e12", "inf"])
@pytest.mark.parametrize("kind", ["undecodable", "failing"])
async def test_a_forged_deliver_at_does_not_hold_back_the_dead_letter(
    running: Running, deliver_at: str, kind: str
) -> None:
    if deliver_at == "a-day-ahead":
        deliver_at = f"{time.time() + 86_400:.6f}"
    if kind == "undecodable":
        await running.publish("m-1", "os.system", ORDER_BODY, **{"deliver-at": deliver_at})
    else:  # on its last attempt: dead-lettered straight from the failure, no delayed retry
        await running.publish("m-1", DOOMED, DOOMED_BODY, attempt="2", **{"deliver-at": deliver_at})

    dead = headers_of(await running.broker.get(running.error_queue, timeout=5))

    assert dead["message-id"] == "m-1"
    assert "deliver-at" not in dead
    assert dead["error-type"] in ("mersal.errors.DecodeError", DOOM_TYPE)
    assert all(not queue.startswith(running.error_queue) for queue in running.wait_queues())


async def test_a_forged_attempt_count_cannot_drop_a_failing_message(running: Running) -> None:
    await running.publish("m-1", DOOMED, DOOMED_BODY, attempt="999999")

    arrived = await running.broker.get(running.error_queue, timeout=5)
    dead = headers_of(arrived)

    assert dead["message-id"] == "m-1"
    assert dead["error-type"] == DOOM_TYPE
    assert dead["error-message"] == "o-1 is doomed"
    assert arrived.body == DOOMED_BODY
    assert running.failed == ["m-1"]


async def test_a_forged_error_header_does_not_make_a_message_dead(running: Running) -> None:
    forged = {"error-type": "mersal.errors.DecodeError", "error-message": "forged"}

    await running.publish("m-1", ORDER, ORDER_BODY, **forged)
    await eventually(lambda: running.handled == ["m-1"], "normal handling", timeout=5)

    assert await running.broker.count(running.error_queue) == 0
