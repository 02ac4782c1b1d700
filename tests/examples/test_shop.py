"""The tutorial's shop: an order paid, an order cancelled, a late refund.

On the Harness (memory and SQLite) the tests decide when billing answers and
deliver the payment window's end at once; on RabbitMQ and PostgreSQL the orders
service starts in its lifespan as uvicorn would start it, billing runs as
`mersal run` or in this process, and the payment window is one real second
(SHOP_PAYMENT_WINDOW).
"""

# --8<-- [start:imports]
from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from examples.shop.billing import create_app
from examples.shop.db import Order, Payment, create_tables
from examples.shop.messages import (
    ChargeOrder,
    OrderCancelled,
    OrderPlaced,
    PaymentReceived,
    RefundPayment,
)
from examples.shop.sagas import Checkout, OrderPayment
from examples.shop.settings import BILLING, Settings
from examples.shop.web import Shop, create_api, create_shop, take_order
from mersal import App
from mersal.testing import Harness
from mersal_sqlalchemy import make_engine
from tests.examples.conftest import mersal_run, ready, served
from tests.support import eventually, free_port, postgres_database

# --8<-- [end:imports]


# --8<-- [start:fixtures]
@pytest.fixture
async def settings(tmp_path: Path) -> Settings:
    """The shop on memory:// and a SQLite file of its own, tables created."""
    database = f"sqlite+aiosqlite:///{tmp_path / 'shop.db'}"
    await create_tables(database)
    return Settings(transport="memory://", database=database)


@pytest.fixture
async def shop(settings: Settings) -> AsyncIterator[Shop]:
    """The orders service (not started: the test hands its app to a Harness)."""
    made = create_shop(settings)
    yield made
    await made.engine.dispose()


@pytest.fixture
def billing(settings: Settings) -> App:
    """The billing app."""
    return create_app(settings)


async def status_of(shop: Shop, order_id: str) -> str | None:
    """The order's status as committed, or None if there is no such order."""
    async with shop.sessions() as session:
        order = await session.get(Order, order_id)
        return None if order is None else order.status


async def payments(database: str) -> dict[str, str]:
    """Billing's payments: order id -> status."""
    engine = make_engine(database)
    try:
        async with engine.connect() as connection:
            rows = await connection.execute(
                select(Payment.order_id, Payment.status)
            )
            return {order_id: status for order_id, status in rows}
    finally:
        await engine.dispose()


async def place(shop: Shop, order_id: str, amount: float) -> None:
    """Take an order as POST /orders does."""
    async with shop.sessions() as session:
        await take_order(shop.bus, session, order_id, amount)
        # --8<-- [end:fixtures]


# --8<-- [start:endpoint-test]
async def test_an_order_taken_over_http_is_charged_and_paid(
    shop: Shop, billing: App
) -> None:
    api = create_api(shop)
    async with Harness(shop.bus, billing) as bus, served(api) as client:
        placed = await client.post(
            "/orders", json={"order_id": "o-1", "amount": 9.5}
        )
        assert placed.status_code == 202, placed.text
        assert placed.json() == {
            "order_id": "o-1",
            "amount": 9.5,
            "status": "placed",
        }

        again = await client.post(
            "/orders", json={"order_id": "o-1", "amount": 1.0}
        )
        assert again.status_code == 409
        assert again.json() == {"detail": "order 'o-1' exists already"}

        # the payment window waits in the broker
        await bus.idle(include_delayed=False)
        paid = await client.get("/orders/o-1")
        assert paid.json() == {
            "order_id": "o-1",
            "amount": 9.5,
            "status": "paid",
        }
        assert (await client.get("/orders/o-2")).status_code == 404

    assert bus.published_of(OrderPlaced) == [OrderPlaced("o-1", 9.5)]
    assert bus.sent_of(ChargeOrder) == [ChargeOrder("o-1", 9.5)]
    assert bus.published_of(PaymentReceived) == [PaymentReceived("o-1", 9.5)]
    # --8<-- [end:endpoint-test]


# --8<-- [start:saga-tests]
async def test_a_paid_order_ignores_the_end_of_its_payment_window(
    shop: Shop, billing: App
) -> None:
    async with Harness(shop.bus, billing) as bus:
        await place(shop, "o-1", 9.5)
        await bus.idle(include_delayed=False)
        assert await status_of(shop, "o-1") == "paid"
        assert await bus.saga_data(OrderPayment, "o-1") is None  # completed

        assert bus.deliver_delayed() == 1  # the window ends now
        await bus.idle(include_delayed=False)
        assert await status_of(shop, "o-1") == "paid"
    assert bus.published_of(OrderCancelled) == []


async def test_an_order_not_paid_in_its_window_is_cancelled(shop: Shop) -> None:
    # billing is down: its queue keeps the charge
    async with Harness(shop.bus) as bus:
        await shop.bus.transport.declare(BILLING)
        await place(shop, "o-1", 9.5)
        await bus.idle(include_delayed=False)
        assert await bus.saga_data(OrderPayment, "o-1") == Checkout("o-1", 9.5)
        assert await status_of(shop, "o-1") == "placed"

        assert bus.deliver_delayed() == 1
        await bus.idle(include_delayed=False)
        assert await status_of(shop, "o-1") == "cancelled"
        assert await bus.saga_data(OrderPayment, "o-1") is None
    assert bus.published_of(OrderCancelled) == [
        OrderCancelled("o-1", "not paid in time")
    ]


async def test_a_payment_after_the_cancel_is_refunded(shop: Shop) -> None:
    async with Harness(shop.bus) as bus:
        await shop.bus.transport.declare(BILLING)
        await place(shop, "o-1", 9.5)
        await bus.idle(include_delayed=False)
        bus.deliver_delayed()
        await bus.idle(include_delayed=False)

        # as billing would, too late
        await shop.bus.publish(PaymentReceived("o-1", 9.5))
        await bus.idle(include_delayed=False)
        assert await status_of(shop, "o-1") == "cancelled"
    assert bus.sent_of(RefundPayment) == [RefundPayment("o-1", 9.5)]
    # --8<-- [end:saga-tests]


# --8<-- [start:billing-test]
async def test_billing_charges_an_order_then_refunds_it(
    settings: Settings, billing: App
) -> None:
    async with Harness(billing) as bus:
        await billing.send(ChargeOrder("o-1", 9.5))
        await bus.idle()
        assert bus.published_of(PaymentReceived) == [
            PaymentReceived("o-1", 9.5)
        ]
        assert await payments(settings.database) == {"o-1": "charged"}

        await billing.send(RefundPayment("o-1", 9.5))
        await bus.idle()
        assert await payments(settings.database) == {"o-1": "refunded"}
        # --8<-- [end:billing-test]


def test_the_settings_come_from_the_environment() -> None:
    environment = {
        "MERSAL_TRANSPORT": "amqp://shop:pw@rabbit/shop",
        "MERSAL_DATABASE": "postgresql+asyncpg://shop@db/shop",
        "SHOP_PAYMENT_WINDOW": "1.5",
    }
    assert Settings.from_environment(environment) == Settings(
        "amqp://shop:pw@rabbit/shop",
        "postgresql+asyncpg://shop@db/shop",
        1.5,
        30.0,
    )
    assert Settings.from_environment({}) == Settings()


@pytest.fixture
async def environment(
    own_vhost: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[str]:
    """MERSAL_TRANSPORT and MERSAL_DATABASE: own vhost, new database."""
    async with postgres_database(migrate=True) as database:  # mersal db upgrade
        await create_tables(database)  # python -m examples.shop.db
        monkeypatch.setenv("MERSAL_TRANSPORT", own_vhost)
        monkeypatch.setenv("MERSAL_DATABASE", database)
        yield database


async def status_over_http(client: httpx.AsyncClient, order_id: str) -> str:
    """The order's status as GET /orders/{id} shows it."""
    response = await client.get(f"/orders/{order_id}")
    assert response.status_code == 200, response.text
    status: str = response.json()["status"]
    return status


@pytest.mark.integration
async def test_an_order_is_paid_on_rabbitmq_and_postgresql(
    environment: str, own_vhost: str
) -> None:
    port = free_port()
    env = {"MERSAL_TRANSPORT": own_vhost, "MERSAL_DATABASE": environment}
    async with mersal_run(
        "examples.shop.billing:create_app", env, port
    ) as worker:
        await eventually(
            lambda: ready(f"http://127.0.0.1:{port}/readyz"),
            "billing",
            timeout=30,
        )
        async with served(create_api()) as client:
            placed = await client.post(
                "/orders", json={"order_id": "o-1", "amount": 9.5}
            )
            assert placed.status_code == 202, placed.text

            async def paid() -> bool:
                return await status_over_http(client, "o-1") == "paid"

            await eventually(paid, "o-1 paid", timeout=30)
        worker.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            assert await worker.wait() == 0
    assert await payments(environment) == {"o-1": "charged"}


@pytest.mark.integration
async def test_an_order_not_paid_in_time_is_cancelled_and_a_late_payment_refunded(
    environment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHOP_PAYMENT_WINDOW", "1")
    async with create_app():
        pass  # billing's queue exists; then billing is down
    async with served(create_api()) as client:
        started = time.monotonic()
        placed = await client.post(
            "/orders", json={"order_id": "o-1", "amount": 9.5}
        )
        assert placed.status_code == 202, placed.text

        async def cancelled() -> bool:
            return await status_over_http(client, "o-1") == "cancelled"

        await eventually(cancelled, "o-1 cancelled", timeout=30)
        assert time.monotonic() - started >= 1.0, (
            "cancelled at the end of the window"
        )
        assert await payments(environment) == {}

        async def refunded() -> bool:
            return await payments(environment) == {"o-1": "refunded"}

        # billing is back: it charges the cancelled order, and the saga has it
        # refunded
        async with create_app():
            await eventually(refunded, "o-1 refunded", timeout=30)
        assert await status_over_http(client, "o-1") == "cancelled"
