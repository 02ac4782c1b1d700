"""The quick start (README.md shows it too): an order taken and billed."""

# --8<-- [start:program]
import asyncio
from dataclasses import dataclass

from mersal import App, message


@message("shop.PlaceOrder.v1")  # the wire type name; default "module.QualName"
@dataclass
class PlaceOrder:
    order_id: str
    amount: float


@message("shop.OrderPlaced.v1")
@dataclass
class OrderPlaced:
    order_id: str


class PlaceOrderHandler:
    # built per message, arguments injected by type
    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, order: PlaceOrder) -> None:
        # leaves once this succeeded
        await self.app.publish(OrderPlaced(order.order_id))


async def main() -> list[str]:
    app = App("orders")  # its input queue; on MERSAL_TRANSPORT, else memory://
    billed: list[str] = []
    done = asyncio.Event()

    async def bill(event: OrderPlaced) -> None:
        billed.append(event.order_id)
        done.set()

    app.register(PlaceOrder, PlaceOrderHandler)  # a class (DI) ...
    app.register(OrderPlaced, bill)  # ... or an async function
    # app.send(PlaceOrder(...)) goes to the queue "orders"
    app.route(PlaceOrder, "orders")
    app.subscribe(OrderPlaced)  # published OrderPlaced events reach this app
    async with app:  # declares its queue, starts the worker; leaving drains it
        await app.send(PlaceOrder("o-1", 9.5))
        await asyncio.wait_for(done.wait(), timeout=5)
    return billed


if __name__ == "__main__":
    print(asyncio.run(main()))  # ['o-1']
# --8<-- [end:program]
