"""The messages between the web layer and the worker."""

from __future__ import annotations

from dataclasses import dataclass

from mersal import message


@message("shop.PlaceOrder.v1")
@dataclass
class PlaceOrder:
    """Bill an order the web layer took (a command, to the orders worker)."""

    order_id: str
    amount: float
