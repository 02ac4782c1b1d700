"""Apps on RabbitMQ end to end: `App(..., transport="amqp://...")` with no other change."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import pytest

from mersal import App, Header, MessageContext, OutcomeUnknown, RetryPolicy, message
from mersal_rabbitmq import RabbitMQTransport
from tests.mersal_rabbitmq.support import rabbitmqctl
from tests.support import Broker, eventually

pytestmark = pytest.mark.integration


@message("tests.mersal_rabbitmq.PlaceOrder.v1")
@dataclass
class PlaceOrder:
    order_id: str


@message("tests.mersal_rabbitmq.OrderPlaced.v1")
@dataclass
class OrderPlaced:
    order_id: str


@message("tests.mersal_rabbitmq.GetQuote.v1")
@dataclass
class GetQuote:
    item: str


@message("tests.mersal_rabbitmq.Quote.v1")
@dataclass
class Quote:
    item: str
    price: float


@dataclass
class Seen:
    """A message a handler saw, with its headers and when."""

    message: object
    headers: dict[str, str]
    at: float


def app_named(name: str, url: str, broker: Broker, **options: object) -> App:
    """An app on the test vhost whose queues are deleted after the test."""
    retry = options.pop("retry", None) or RetryPolicy(error_queue=f"{name}.error")
    app = App(name, transport=url, retry=retry, **options)  # type: ignore[arg-type]
    assert isinstance(app.transport, RabbitMQTransport)
    broker.watch(app)
    return app


async def test_a_command_is_handled_and_its_event_reaches_the_subscriber(
    url: str, broker: Broker, prefix: str
) -> None:
    orders = app_named(f"{prefix}.orders", url, broker)
    billing = app_named(f"{prefix}.billing", url, broker)
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
    assert event[Header.SOURCE] == orders.name


async def test_a_request_gets_its_reply_through_a_temporary_queue(
    url: str, broker: Broker, prefix: str
) -> None:
    shop = app_named(f"{prefix}.shop", url, broker)
    client = app_named(f"{prefix}.client", url, broker)

    async def quote(request: GetQuote) -> None:
        await shop.reply(Quote(request.item, 9.5))

    shop.register(GetQuote, quote)
    client.route(GetQuote, shop.name)
    async with shop, client:
        answer = await client.request(GetQuote("tea"), timeout=5, reply_type=Quote)
        replies = [q for q in client.transport.queues if ".replies." in q]  # type: ignore[attr-defined]

    assert answer == Quote("tea", 9.5)
    assert len(replies) == 1
    assert await broker.exists(replies[0]) is False  # temporary: gone with the connection


async def test_a_failing_handler_retries_through_the_wait_queue_then_lands_in_error(
    url: str, broker: Broker, prefix: str
) -> None:
    retry = RetryPolicy(immediate=1, delayed=[0.2], error_queue=f"{prefix}.error")
    app = app_named(f"{prefix}.orders", url, broker, retry=retry)
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
    assert attempts[2].at - attempts[1].at >= 0.2
    assert attempts[2].headers[Header.ATTEMPT] == "2"
    # the wait queue is named for the delay left when the copy is sent: 200 ms, a little
    # less on a busy machine
    waits = [q for q in app.transport.queues if q.startswith(f"{app.name}.wait.")]  # type: ignore[attr-defined]
    assert waits
    assert all(100 <= int(queue.rpartition(".")[2]) <= 200 for queue in waits)
    headers = dead.headers or {}
    assert dead.message_id == sent_id
    assert headers[Header.ERROR_ATTEMPTS] == "3"
    assert headers[Header.ERROR_TYPE] == "builtins.RuntimeError"
    assert headers[Header.ERROR_MESSAGE] == "cannot place o-2"
    assert "RuntimeError: cannot place o-2" in str(headers[Header.ERROR_TRACEBACK])
    assert headers[Header.ERROR_QUEUE] == app.name
    assert dead.body == b'{"order_id":"o-2"}'
    assert await broker.count(app.name) == 0


async def test_nothing_is_lost_when_the_broker_closes_every_connection(
    url: str, vhost: str, broker: Broker, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mersal.rabbitmq")
    app = app_named(f"{prefix}.orders", url, broker, concurrency=4)
    handled: set[str] = set()

    async def place(command: PlaceOrder) -> None:
        await asyncio.sleep(0.01)
        handled.add(command.order_id)

    app.register(PlaceOrder, place)
    app.route(PlaceOrder, app.name)
    sent_after_close = 0
    sent = 0
    async with app:
        closing: asyncio.Task[str] | None = None
        while sent < 200 or sent_after_close < 20:  # some sends after the close, whenever it is
            assert sent < 2_000, "the connections never closed"
            if sent == 50:
                closing = asyncio.create_task(
                    asyncio.to_thread(rabbitmqctl, "close_all_connections", "-p", vhost, "test")
                )
            await send_until_sure(app, PlaceOrder(f"o-{sent}"))
            sent += 1
            if closing is None:
                continue
            if closing.done():
                sent_after_close += 1
            else:
                await asyncio.sleep(0.01)  # keep sending while the connections close
        assert closing is not None
        await closing
        await eventually(lambda: len(handled) == sent, f"all {sent} handled", timeout=30)

    assert handled == {f"o-{n}" for n in range(sent)}
    assert "reconnected to RabbitMQ" in caplog.text


async def send_until_sure(app: App, command: PlaceOrder) -> None:
    """Send, sending again while the outcome is unknown (as the outbox relay does)."""
    for _ in range(50):
        try:
            await app.send(command)
            return
        except OutcomeUnknown:
            await asyncio.sleep(0.1)
    raise AssertionError(f"could not send {command}")
