"""Handlers: a class built per message with its dependencies injected, or an
async function."""

from __future__ import annotations

from dataclasses import dataclass

from lagom import Container

from mersal import App, MessageContext, message
from mersal.testing import Harness


@message("pricing.PriceChanged.v1")
@dataclass
class PriceChanged:
    sku: str
    price: float


# --8<-- [start:class]
class Prices:
    """Stands for your repository or API client."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}


class PriceChangedHandler:
    # built for each message; each argument is injected by its type annotation
    def __init__(self, prices: Prices, context: MessageContext) -> None:
        self.prices = prices
        self.context = context

    async def __call__(self, message: PriceChanged) -> None:
        self.prices.current[message.sku] = message.price


# --8<-- [end:class]


# --8<-- [start:function]
audit: list[str] = []


async def audit_price(message: PriceChanged, context: MessageContext) -> None:
    audit.append(
        f"{message.sku} on attempt {context.attempt} from {context.queue}"
    )
    # --8<-- [end:function]


# --8<-- [start:register]
def build_app(prices: Prices) -> App:
    container = Container()
    container[Prices] = prices  # every handler gets this one instance
    app = App("pricing", container=container)
    app.register(PriceChanged, PriceChangedHandler)  # runs first
    # then this, in the same transaction
    app.register(PriceChanged, audit_price)
    app.route(PriceChanged, "pricing")
    return app
    # --8<-- [end:register]


async def main() -> dict[str, float]:
    """Handle one PriceChanged and return the prices the handler class wrote."""
    prices = Prices()
    app = build_app(prices)
    async with Harness(app) as bus:
        await app.send(PriceChanged("p-1", 9.5))
        await bus.idle()
    return prices.current
