"""The payment saga: charge an order, mark it paid, or cancel it when late."""

# --8<-- [start:imports]
from __future__ import annotations

from dataclasses import dataclass

from examples.shop.db import Orders
from examples.shop.messages import (
    ChargeOrder,
    OrderCancelled,
    OrderPlaced,
    PaymentReceived,
    RefundPayment,
)
from examples.shop.settings import Settings
from mersal import App, message
from mersal.sagas import Saga

# --8<-- [end:imports]


# --8<-- [start:saga]
@message("shop.PaymentOverdue.v1")
@dataclass
class PaymentOverdue:
    """The saga's timeout: the order's payment window has ended."""

    order_id: str


@dataclass
class Checkout:
    """One order's payment: the saga's data, stored between its messages."""

    order_id: str = ""
    amount: float = 0.0


class OrderPayment(Saga[Checkout], name="shop.OrderPayment"):
    """Charges an order; marks it paid when paid in time, else cancels it."""

    started_by = (OrderPlaced,)
    correlation = {OrderPlaced: "order_id", PaymentReceived: "order_id"}

    def __init__(self, app: App, orders: Orders, settings: Settings) -> None:
        self.app = app
        # built on the message's session: its writes commit with the saga
        self.orders = orders
        self.settings = settings

    async def placed(self, event: OrderPlaced) -> None:
        """Ask billing to charge the order, and start the payment window."""
        self.data = Checkout(event.order_id, event.amount)
        await self.app.send(ChargeOrder(event.order_id, event.amount))
        await self.request_timeout(
            self.settings.payment_window, PaymentOverdue(event.order_id)
        )

    async def paid(self, event: PaymentReceived) -> None:
        """The payment came in time: the order is paid."""
        await self.orders.set_status(event.order_id, "paid")
        self.mark_complete()

    async def overdue(self, timeout: PaymentOverdue) -> None:
        """The window ended first: cancel the order (a paid one is complete)."""
        await self.orders.set_status(self.data.order_id, "cancelled")
        await self.app.publish(
            OrderCancelled(self.data.order_id, "not paid in time")
        )
        self.mark_complete()

    async def not_found(self, message: object) -> None:
        """A payment no order waits for (cancelled already): give it back."""
        if isinstance(message, PaymentReceived):
            await self.app.send(RefundPayment(message.order_id, message.amount))
            return
        await super().not_found(message)
        # --8<-- [end:saga]
