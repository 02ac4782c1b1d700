"""The order fulfilment example: a saga that ships paid, reserved orders and cancels unpaid ones.

On the Harness (memory) the tests choose the order of events and deliver the payment deadline
at once; on RabbitMQ and PostgreSQL the example runs as `python -m examples.order_fulfilment`
would, with a real one-second deadline.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from uuid import uuid4

import pytest

from examples.order_fulfilment import (
    Fulfilment,
    OrderCancelled,
    OrderFulfilment,
    OrderPlaced,
    OrderShipped,
    Outcomes,
    PaymentReceived,
    Plan,
    ReleaseStock,
    ReserveStock,
    Restock,
    ShipOrder,
    Stock,
    fulfil,
    shop_app,
    warehouse_app,
)
from mersal import App
from mersal.testing import Harness
from tests.support import postgres_database

ROOT = Path(__file__).parents[2]


@pytest.fixture(autouse=True)
def no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The apps use what the tests give them, not MERSAL_TRANSPORT or MERSAL_DATABASE."""
    monkeypatch.delenv("MERSAL_TRANSPORT", raising=False)
    monkeypatch.delenv("MERSAL_DATABASE", raising=False)


class Shop:
    """The example's two apps on memory, with the warehouse's stock and the customers' news."""

    def __init__(self) -> None:
        self.stock = Stock(on_hand={"book": 5, "lamp": 0})
        self.outcomes = Outcomes()
        self.warehouse = warehouse_app(self.stock)
        self.shop: App = shop_app(outcomes=self.outcomes)
        self.bus = Harness(self.warehouse, self.shop)

    async def publish(self, event: object) -> None:
        """Publish an event as the storefront or the payment provider would, then settle."""
        await self.shop.publish(event)
        # the payment deadline waits in the broker
        await self.bus.idle(include_delayed=False)

    async def restock(self, sku: str, quantity: int) -> None:
        """Deliver new stock to the warehouse, then settle."""
        await self.shop.send(Restock(sku, quantity))
        await self.bus.idle(include_delayed=False)

    async def saga(self, order_id: str) -> Fulfilment | None:
        """The order's saga data as committed, or None once it has completed."""
        return await self.bus.saga_data(OrderFulfilment, order_id)

    async def deadline_passes(self) -> int:
        """Deliver the waiting payment deadlines now; how many there were."""
        delivered = self.bus.deliver_delayed()
        await self.bus.idle(include_delayed=False)
        return delivered


async def test_an_order_paid_before_its_stock_is_reserved_ships_once() -> None:
    shop = Shop()
    async with shop.bus as bus:
        # no lamps: the reservation waits
        await shop.publish(OrderPlaced("o-1", "lamp", 1))
        await shop.publish(PaymentReceived("o-1"))
        assert await shop.saga("o-1") == Fulfilment(
            "o-1", paid=True, reserved=False
        )
        assert bus.sent_of(ShipOrder) == []

        await shop.restock("lamp", 1)
        assert await shop.saga("o-1") is None, "shipped: the saga completed"
        assert await shop.deadline_passes() == 1, (
            "the deadline still came, and was ignored"
        )

    assert bus.sent_of(ReserveStock) == [ReserveStock("o-1", "lamp", 1)]
    assert bus.sent_of(ShipOrder) == [ShipOrder("o-1")]
    assert bus.published_of(OrderShipped) == [OrderShipped("o-1")]
    assert bus.published_of(OrderCancelled) == []
    assert shop.outcomes == Outcomes(shipped={"o-1"})
    assert (shop.stock.shipped, shop.stock.on_hand) == (
        ["o-1"],
        {"book": 5, "lamp": 0},
    )


async def test_an_order_reserved_before_it_is_paid_ships_once() -> None:
    shop = Shop()
    async with shop.bus as bus:
        await shop.publish(OrderPlaced("o-2", "book", 2))
        assert await shop.saga("o-2") == Fulfilment(
            "o-2", paid=False, reserved=True
        )
        assert shop.stock.on_hand["book"] == 3
        assert bus.sent_of(ShipOrder) == []

        await shop.publish(PaymentReceived("o-2"))
        assert await shop.saga("o-2") is None
        assert await shop.deadline_passes() == 1

    assert bus.sent_of(ShipOrder) == [ShipOrder("o-2")]
    assert bus.published_of(OrderShipped) == [OrderShipped("o-2")]
    assert bus.published_of(OrderCancelled) == []
    assert shop.outcomes == Outcomes(shipped={"o-2"})
    assert shop.stock.on_hand == {"book": 3, "lamp": 0}


async def test_an_unpaid_order_is_cancelled_and_its_stock_released() -> None:
    shop = Shop()
    async with shop.bus as bus:
        await shop.publish(OrderPlaced("o-3", "book", 2))
        # still awaiting its stock
        await shop.publish(OrderPlaced("o-4", "lamp", 1))
        assert shop.stock.on_hand["book"] == 3
        assert len(bus.deferred) == 2, "one payment deadline per order"

        assert await shop.deadline_passes() == 2
        assert await shop.saga("o-3") is None
        assert await shop.saga("o-4") is None
        await shop.restock("lamp", 1)  # nobody awaits it any more

    cancelled = [
        OrderCancelled(order, "not paid in time") for order in ("o-3", "o-4")
    ]
    assert (
        sorted(bus.published_of(OrderCancelled), key=lambda e: e.order_id)
        == cancelled
    )
    assert sorted(bus.sent_of(ReleaseStock), key=lambda c: c.order_id) == [
        ReleaseStock("o-3"),
        ReleaseStock("o-4"),
    ]
    assert bus.sent_of(ShipOrder) == []
    assert shop.outcomes == Outcomes(cancelled={"o-3", "o-4"})
    assert shop.stock.on_hand == {"book": 5, "lamp": 1}
    assert shop.stock.awaited == []


async def test_a_late_payment_is_dead_lettered_for_a_refund() -> None:
    shop = Shop()
    async with shop.bus as bus:
        await shop.publish(OrderPlaced("o-5", "book", 1))
        await shop.deadline_passes()
        # too late: no saga waits for it
        await shop.publish(PaymentReceived("o-5"))
        while bus.deliver_delayed(within=10):  # its delayed retries, at once
            await bus.idle(include_delayed=False)

    [dead] = bus.dead_lettered
    assert dead.message == PaymentReceived("o-5")
    assert dead.error_type.endswith("UnmatchedPayment")
    # 1 + 1 immediate + 3 delayed: found no saga each time
    assert dead.attempts == 5
    assert bus.sent_of(ShipOrder) == []


async def test_a_run_with_real_deadlines_on_memory() -> None:
    plan = Plan(
        orders=12,
        unpaid_every=4,
        backorder_every=3,
        payment_window=0.5,
        timeout=20,
    )
    result = await fulfil(plan, f"memory://fulfilment-{uuid4().hex}", None)
    assert result.problems() == []
    assert (
        len(result.shipped),
        len(result.cancelled),
        result.shipped_after_restock,
    ) == (9, 3, 3)


async def test_the_command_on_memory_and_sqlite() -> None:
    options = ["--orders", "6", "--payment-window", "2", "--timeout", "30"]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "examples.order_fulfilment",
        *options,
        "--quiet",
        cwd=ROOT,
        env={
            k: v for k, v in os.environ.items() if not k.startswith("MERSAL_")
        },
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    figures = dict(pair.split("=") for pair in out.decode().split())
    assert figures["shipped"] == "5"
    assert figures["cancelled"] == figures["released"] == "1"
    assert figures["sagas_left"] == "0"


@pytest.mark.integration
async def test_one_order_shipped_one_cancelled_on_rabbitmq_and_postgresql(
    own_vhost: str,
) -> None:
    plan = Plan(
        orders=2,
        unpaid_every=2,
        backorder_every=0,
        payment_window=1.0,
        timeout=30,
    )
    async with postgres_database(migrate=True) as database:
        result = await fulfil(plan, own_vhost, database)
    assert result.problems() == []
    [shipped] = result.shipped
    [cancelled] = result.cancelled
    assert shipped.endswith("-0001")
    assert cancelled.endswith("-0002")
    assert result.seconds >= 1.0, (
        "the cancel waited for the one-second deadline"
    )
