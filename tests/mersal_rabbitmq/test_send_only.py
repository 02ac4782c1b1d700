"""`App(consume=False)`: a send-only app declares no queue of its own, yet sends through its outbox.

A web front end or a script sends commands and publishes events without handling any: it must
not leave an input or an error queue behind on the broker, and its outbox relay must still
carry what its transactions committed.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from mersal import App, ConfigurationError, Header, MessageContext, RetryPolicy, message
from tests.support import Broker, eventually, postgres_database

pytestmark = pytest.mark.integration


@message("tests.send_only.PlaceOrder.v1")
@dataclass
class PlaceOrder:
    order_id: str


@message("tests.send_only.OrderPlaced.v1")
@dataclass
class OrderPlaced:
    order_id: str


@message("tests.send_only.Price.v1")
@dataclass
class Price:
    item: str


@message("tests.send_only.Priced.v1")
@dataclass
class Priced:
    item: str
    cents: int


async def test_a_send_only_app_declares_no_queue_and_its_outbox_rows_reach_the_receivers(
    url: str, broker: Broker, prefix: str
) -> None:
    front_errors = RetryPolicy(error_queue=f"{prefix}.web-err")
    orders = App(f"{prefix}.orders", transport=url, retry=RetryPolicy(error_queue=f"{prefix}.err"))
    broker.watch(orders)
    seen: list[tuple[object, dict[str, str]]] = []

    async def place(command: PlaceOrder, context: MessageContext) -> None:
        seen.append((command, dict(context.headers)))

    async def placed(event: OrderPlaced, context: MessageContext) -> None:
        seen.append((event, dict(context.headers)))

    orders.register(PlaceOrder, place)
    orders.register(OrderPlaced, placed)
    orders.subscribe(OrderPlaced)
    async with postgres_database(migrate=True) as database:
        front = App(
            f"{prefix}.web", transport=url, consume=False, retry=front_errors, database=database
        )
        front.route(PlaceOrder, orders.name)
        engine = create_async_engine(database)
        try:
            async with orders, front:
                health = front.health()
                assert (health.live, health.ready, health.checks) == (True, True, {})
                assert front.worker is None
                async with AsyncSession(engine) as session, front.transaction(session):
                    await front.send(PlaceOrder("o-1"))
                    await front.publish(OrderPlaced("o-1"))
                await eventually(lambda: len(seen) == 2, "both messages handled", timeout=10)
                assert not await broker.exists(front.name)
                assert not await broker.exists(front_errors.error_queue)
        finally:
            await engine.dispose()

    assert sorted(type(found).__name__ for found, _ in seen) == ["OrderPlaced", "PlaceOrder"]
    for _, headers in seen:
        assert headers[Header.SOURCE] == front.name
        assert Header.REPLY_TO not in headers, "nothing could reply to a send-only app's queue"


async def test_a_send_only_app_can_still_ask_and_get_a_reply(
    url: str, broker: Broker, prefix: str
) -> None:
    front = App(f"{prefix}.script", transport=url, consume=False)
    prices = App(f"{prefix}.prices", transport=url, retry=RetryPolicy(error_queue=f"{prefix}.err"))
    broker.watch(prices)
    broker.watch(front)

    async def price(question: Price) -> None:
        await prices.reply(Priced(question.item, 250))

    prices.register(Price, price)
    front.route(Price, prices.name)
    async with prices, front:
        answer = await front.request(Price("tea"), timeout=10, reply_type=Priced)
    assert answer == Priced("tea", 250)
    assert not await broker.exists(front.name)


@pytest.mark.parametrize(
    "mistake, refusal",
    [
        ("subscribe", "receives nothing, yet it subscribes to or handles OrderPlaced"),
        ("register", "receives nothing, yet it subscribes to or handles PlaceOrder"),
        ("route home", "has no queue of its own, yet it routes PlaceOrder to"),
    ],
)
async def test_what_a_send_only_app_could_never_receive_is_refused_at_start(
    mistake: str, refusal: str, url: str, prefix: str
) -> None:
    app = App(f"{prefix}.web", transport=url, consume=False)

    async def ignore(message: object) -> None:
        return None

    if mistake == "subscribe":
        app.register(OrderPlaced, ignore)
        app.subscribe(OrderPlaced)
    elif mistake == "register":
        app.register(PlaceOrder, ignore)
    else:
        app.route(PlaceOrder, app.name)
    with pytest.raises(ConfigurationError, match=refusal):
        await app.start()
    assert not app.running


async def test_sends_to_its_own_queue_in_a_send_only_app_say_what_to_do_instead(
    url: str, prefix: str
) -> None:
    app = App(f"{prefix}.web", transport=url, consume=False)
    async with app:
        assert app.healthy
        with pytest.raises(ConfigurationError, match=r"cannot send_local\(\): route the type"):
            await app.send_local(PlaceOrder("o-2"))
        with pytest.raises(
            ConfigurationError, match=r"cannot defer\(\) a PlaceOrder that has no route"
        ):
            await app.defer(5, PlaceOrder("o-3"))
