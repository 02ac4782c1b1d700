"""The shop's tables and repositories; `python -m examples.shop.db` makes them.

Both services use one database here, to keep the tutorial short; each has tables
of its own (and Mersal keeps each app's outbox rows, inbox rows and sagas apart
by the app's name).
"""

# --8<-- [start:imports]
from __future__ import annotations

import asyncio

from sqlalchemy import String
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from examples.shop.settings import Settings
from mersal_sqlalchemy import make_engine

# --8<-- [end:imports]


# --8<-- [start:tables]
class Base(DeclarativeBase):
    """The shop's own tables (Mersal's are migrated by `mersal db upgrade`)."""


class Order(Base):
    """An order: "placed", then "paid" or "cancelled" (the orders' table)."""

    __tablename__ = "shop_orders"

    order_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    amount: Mapped[float]
    status: Mapped[str] = mapped_column(String(20))


class Payment(Base):
    """A charge for an order: "charged", maybe "refunded" (billing's table)."""

    __tablename__ = "shop_payments"

    order_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    amount: Mapped[float]
    status: Mapped[str] = mapped_column(String(20))
    # --8<-- [end:tables]


# --8<-- [start:orders]
class UnknownOrder(Exception):
    """No order has the id a message names."""


class Orders:
    """The orders repository, on the session it was built with."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    def add(self, order_id: str, amount: float) -> Order:
        """A new order, "placed" (written when the session commits)."""
        order = Order(order_id=order_id, amount=amount, status="placed")
        self.session.add(order)
        return order

    async def get(self, order_id: str) -> Order | None:
        """The order with this id, if there is one."""
        return await self.session.get(Order, order_id)

    async def set_status(self, order_id: str, status: str) -> None:
        """Mark the order "paid" or "cancelled"."""
        order = await self.get(order_id)
        if order is None:
            raise UnknownOrder(f"no order {order_id!r}")
        order.status = status
        # --8<-- [end:orders]


async def create_tables(database: str) -> None:
    """Create the shop's tables in `database` where they are missing."""
    engine = make_engine(database)
    try:
        async with engine.begin() as connection:
            await connection.run_sync(Base.metadata.create_all)
    finally:
        await engine.dispose()


if __name__ == "__main__":
    asyncio.run(create_tables(Settings.from_environment().database))
