"""Transactions and the outbox on SQLite: a handler's rows and sends commit
together."""

from __future__ import annotations

# --8<-- [start:models]
from dataclasses import dataclass

from sqlalchemy import String, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from mersal import App, message
from mersal.testing import Harness
from mersal_sqlalchemy import attach, make_engine


class Base(DeclarativeBase):
    pass


class Cart(Base):
    __tablename__ = "carts"
    cart_id: Mapped[str] = mapped_column(String(40), primary_key=True)


class Order(Base):
    __tablename__ = "orders"
    order_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    amount: Mapped[float]


@message("shop.PlaceOrder.v1")
@dataclass
class PlaceOrder:
    order_id: str
    amount: float


@message("shop.OrderPlaced.v1")
@dataclass
class OrderPlaced:
    order_id: str
    # --8<-- [end:models]


# --8<-- [start:handler]
class PlaceOrderHandler:
    # the message's session
    def __init__(self, app: App, session: AsyncSession) -> None:
        self.app = app
        self.session = session

    async def __call__(self, message: PlaceOrder) -> None:
        self.session.add(
            Order(order_id=message.order_id, amount=message.amount)
        )
        await self.app.publish(OrderPlaced(message.order_id))  # an outbox row
        # Mersal commits the session after the handlers: order, outbox row and
        # inbox row
        # --8<-- [end:handler]


# --8<-- [start:app]
def build_app(engine: AsyncEngine) -> App:
    app = App("orders")
    # or App("orders", database="sqlite+aiosqlite:///shop.db")
    attach(app, engine=engine)
    app.register(PlaceOrder, PlaceOrderHandler)
    app.route(PlaceOrder, "orders")
    return app
    # --8<-- [end:app]


# --8<-- [start:outside]
async def check_out(
    app: App, engine: AsyncEngine, cart_id: str, amount: float
) -> None:
    async with AsyncSession(engine) as session, app.transaction(session):
        session.add(Cart(cart_id=cart_id))
        await app.send(PlaceOrder(cart_id, amount))
    # a clean exit wrote the outbox row into the session and committed it; on an
    # exception the block rolls the session back and nothing is sent
    # --8<-- [end:outside]


class OutOfStock(Exception):
    """Raised in the sample to show a block that fails."""


async def main(database: str) -> tuple[list[str], list[str], list[OrderPlaced]]:
    """Check out a cart, fail another; return carts, orders, events."""
    engine = make_engine(database)
    async with engine.begin() as connection:
        await connection.run_sync(Base.metadata.create_all)
    app = build_app(engine)
    try:
        async with Harness(app) as bus:
            await check_out(app, engine, "c-1", 9.5)
            try:
                # --8<-- [start:failure]
                async with (
                    AsyncSession(engine) as session,
                    app.transaction(session),
                ):
                    session.add(Cart(cart_id="c-2"))
                    await app.send(PlaceOrder("c-2", 20.0))
                    # rolled back: no cart row, no PlaceOrder
                    raise OutOfStock("c-2")
                # --8<-- [end:failure]
            except OutOfStock:
                pass
            await bus.idle()
        async with AsyncSession(engine) as session:
            carts = list((await session.scalars(select(Cart.cart_id))).all())
            orders = list((await session.scalars(select(Order.order_id))).all())
        return carts, orders, bus.published_of(OrderPlaced)
    finally:
        await engine.dispose()
