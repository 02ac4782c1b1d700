"""The orders worker: `mersal run examples.fastapi_orders.worker:create_app`."""

from __future__ import annotations

from examples.fastapi_orders import settings
from examples.fastapi_orders.db import Orders
from examples.fastapi_orders.messages import PlaceOrder
from mersal import App, RetryPolicy


# --8<-- [start:handler]
class PlaceOrderHandler:
    """Bills an order through the repository, built on the message's session."""

    def __init__(self, orders: Orders) -> None:
        self.orders = orders

    async def __call__(self, message: PlaceOrder) -> None:
        await self.orders.bill(message.order_id)
        # --8<-- [end:handler]


def create_app(
    *, transport: str | None = None, database: str | None = None
) -> App:
    """The worker app, on the settings' broker and database unless given."""
    app = App(
        settings.ORDERS_QUEUE,
        transport=transport or settings.transport(),
        database=database or settings.database(),
        retry=RetryPolicy(
            immediate=2, delayed=[1.0, 10.0], error_queue=settings.ORDERS_ERRORS
        ),
    )
    app.register(PlaceOrder, PlaceOrderHandler)
    # the web app sends them here: say so (no start warning)
    app.route(PlaceOrder, app.name)
    return app
