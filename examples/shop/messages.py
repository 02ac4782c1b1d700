"""The messages between the orders service and the billing worker."""

# --8<-- [start:imports]
from __future__ import annotations

from dataclasses import dataclass

from mersal import message

# --8<-- [end:imports]


# --8<-- [start:messages]
@message("shop.OrderPlaced.v1")
@dataclass
class OrderPlaced:
    """An order was taken (an event: the orders service publishes it)."""

    order_id: str
    amount: float


@message("shop.ChargeOrder.v1")
@dataclass
class ChargeOrder:
    """Charge the customer for an order (a command, to billing)."""

    order_id: str
    amount: float


@message("shop.PaymentReceived.v1")
@dataclass
class PaymentReceived:
    """The customer paid for an order (an event: billing publishes it)."""

    order_id: str
    amount: float


@message("shop.RefundPayment.v1")
@dataclass
class RefundPayment:
    """Give back a payment whose order was cancelled (a command, to billing)."""

    order_id: str
    amount: float


@message("shop.OrderCancelled.v1")
@dataclass
class OrderCancelled:
    """An order will not be fulfilled (an event)."""

    order_id: str
    reason: str
    # --8<-- [end:messages]
