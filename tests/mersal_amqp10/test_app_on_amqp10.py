"""Apps on AMQP 1.0 end to end: `App(..., transport="amqp10://...")` with no other change.

What reached a queue is read over 0-9-1, where RabbitMQ 3.10 packs an AMQP 1.0 message's
headers into one binary header (`amqp10_headers` reads them back).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import proton
import pytest

from mersal import App, Header, MessageContext, RetryPolicy
from mersal_amqp10 import Amqp10Transport
from tests.mersal_amqp10.support import (
    amqp10_headers,
    amqp_decoded,
    count_unconsumed,
    rabbitmq_side,
    raw_send,
)
from tests.mersal_rabbitmq.test_app_on_rabbitmq import (
    GetQuote,
    OrderPlaced,
    PlaceOrder,
    Quote,
    Seen,
)
from tests.support import Broker, eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

MakeApp = Callable[..., App]


def declared_queues(app: App) -> list[str]:
    """The queues the app's transport declared (over its 0-9-1 side)."""
    assert isinstance(app.transport, Amqp10Transport)
    return rabbitmq_side(app.transport).queues


async def test_a_command_is_handled_and_its_event_reaches_the_subscriber(
    make_app: MakeApp, broker: Broker, prefix: str
) -> None:
    orders, billing = make_app(f"{prefix}.orders"), make_app(f"{prefix}.billing")
    handled: list[Seen] = []
    billed: list[Seen] = []

    async def place(command: PlaceOrder, context: MessageContext) -> None:
        handled.append(Seen(command, dict(context.headers), time.time()))
        await orders.publish(OrderPlaced(command.order_id))

    async def bill(event: OrderPlaced, context: MessageContext) -> None:
        billed.append(Seen(event, dict(context.headers), time.time()))

    orders.register(PlaceOrder, place)
    orders.route(PlaceOrder, orders.name)
    billing.register(OrderPlaced, bill)
    billing.subscribe(OrderPlaced)
    async with billing, orders:
        sent_id = await orders.send(PlaceOrder("o-1"))
        await eventually(lambda: len(billed) == 1, "the event at billing", timeout=10)

    assert [seen.message for seen in handled] == [PlaceOrder("o-1")]
    assert [seen.message for seen in billed] == [OrderPlaced("o-1")]
    command, event = handled[0].headers, billed[0].headers
    assert command[Header.MESSAGE_ID] == sent_id
    assert event[Header.TYPE] == "tests.mersal_rabbitmq.OrderPlaced.v1"
    assert event[Header.CAUSATION_ID] == sent_id
    assert event[Header.CORRELATION_ID] == command[Header.CORRELATION_ID] == sent_id
    for app in (orders, billing):
        assert await count_unconsumed(broker, app.name) == 0
        assert await broker.count(f"{app.name}.error") == 0


async def test_a_failing_handler_retries_then_its_message_lands_in_error_with_the_reason(
    make_app: MakeApp, broker: Broker, prefix: str
) -> None:
    retry = RetryPolicy(immediate=1, delayed=[0.2], error_queue=f"{prefix}.error")
    app = make_app(f"{prefix}.orders", retry=retry)
    attempts: list[Seen] = []

    async def fail(command: PlaceOrder, context: MessageContext) -> None:
        attempts.append(Seen(context.attempt, dict(context.headers), time.time()))
        raise RuntimeError(f"cannot place {command.order_id}")

    app.register(PlaceOrder, fail)
    app.route(PlaceOrder, app.name)
    async with app:
        sent_id = await app.send(PlaceOrder("o-2"))
        dead = await broker.get(f"{prefix}.error", timeout=10)

    assert [seen.message for seen in attempts] == [1, 2, 3]
    assert attempts[2].at - attempts[1].at >= 0.2  # the delayed attempt went through a wait queue
    assert [q for q in declared_queues(app) if q.startswith(f"{app.name}.wait.")]
    headers = amqp10_headers(dead)
    assert dead.message_id == headers[Header.MESSAGE_ID] == sent_id
    assert headers[Header.ERROR_ATTEMPTS] == "3"
    assert headers[Header.ERROR_TYPE] == "builtins.RuntimeError"
    assert headers[Header.ERROR_MESSAGE] == "cannot place o-2"
    assert "RuntimeError: cannot place o-2" in headers[Header.ERROR_TRACEBACK]
    assert headers[Header.ERROR_QUEUE] == app.name
    assert dead.body == b'{"order_id":"o-2"}'
    assert await count_unconsumed(broker, app.name) == 0
    assert await broker.count(f"{prefix}.error") == 0


async def test_a_request_gets_its_reply_through_a_temporary_queue(
    make_app: MakeApp, broker: Broker, prefix: str
) -> None:
    shop, client = make_app(f"{prefix}.shop"), make_app(f"{prefix}.client")

    async def quote(request: GetQuote) -> None:
        await shop.reply(Quote(request.item, 9.5))

    shop.register(GetQuote, quote)
    client.route(GetQuote, shop.name)
    async with shop, client:
        answer = await client.request(GetQuote("tea"), timeout=5, reply_type=Quote)
        replies = [q for q in declared_queues(client) if ".replies." in q]
        assert len(replies) == 1
        assert await broker.exists(replies[0]) is True

    assert answer == Quote("tea", 9.5)
    assert await broker.exists(replies[0]) is False  # deleted as its transport stopped


async def test_a_message_whose_body_is_an_amqp_map_is_dead_lettered_without_a_handler(
    make_app: MakeApp, broker: Broker, vhost: str, prefix: str
) -> None:
    app = make_app(f"{prefix}.orders")
    handled: list[PlaceOrder] = []

    async def place(command: PlaceOrder) -> None:
        handled.append(command)

    app.register(PlaceOrder, place)
    async with app:
        foreign = proton.Message(
            body={"order_id": "o-3"},  # an amqp-value section, not data
            id="raw-map",
            subject="tests.mersal_rabbitmq.PlaceOrder.v1",
            content_type="application/json",
        )
        await asyncio.to_thread(raw_send, vhost, f"/amq/queue/{app.name}", [foreign])
        dead = await broker.get(f"{app.name}.error", timeout=10)

    assert handled == []
    headers = amqp10_headers(dead)
    assert headers[Header.MESSAGE_ID] == "raw-map"
    assert "application/x-amqp-value" in headers[Header.ERROR_MESSAGE]
    assert amqp_decoded(dead.body) == {"order_id": "o-3"}  # the body as it came, AMQP-encoded
    assert await count_unconsumed(broker, app.name) == 0
