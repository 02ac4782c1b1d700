"""Testing with mersal.testing.Harness: a pytest test (tests/docs runs it)."""

from __future__ import annotations

# --8<-- [start:test]
from dataclasses import dataclass

from mersal import App, RetryPolicy, message
from mersal.testing import Harness


@message("orders.PlaceOrder.v1")
@dataclass
class PlaceOrder:
    order_id: str
    amount: float


@message("orders.OrderPlaced.v1")
@dataclass
class OrderPlaced:
    order_id: str


class PaymentDeclined(Exception):
    pass


def build_app() -> App:
    # quick retries
    app = App("orders", retry=RetryPolicy(immediate=1, delayed=[0.01]))

    async def place(message: PlaceOrder) -> None:
        if message.amount <= 0:
            raise PaymentDeclined(f"nothing to pay for {message.order_id}")
        await app.publish(OrderPlaced(message.order_id))

    app.register(PlaceOrder, place)
    app.route(PlaceOrder, "orders")
    return app


async def test_a_declined_order_is_dead_lettered_after_three_attempts() -> None:
    app = build_app()
    # a private memory:// broker, whatever the app's transport
    async with Harness(app) as bus:
        await app.send(PlaceOrder("o-1", 9.5))
        await app.send(PlaceOrder("o-2", 0))
        # until nothing is queued, in flight, delayed or in an outbox
        await bus.idle()
    assert bus.published_of(OrderPlaced) == [OrderPlaced("o-1")]
    assert bus.dead_lettered_of(PlaceOrder) == [PlaceOrder("o-2", 0)]
    [dead] = bus.dead_lettered
    assert (dead.address, dead.attempts, dead.source_queue) == (
        "error",
        3,
        "orders",
    )
    assert dead.error_type.endswith("PaymentDeclined")
    # the one delayed retry went through the broker
    assert len(bus.retried) == 1
    # --8<-- [end:test]
