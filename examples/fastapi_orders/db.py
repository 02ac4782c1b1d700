"""The shop's tables and its repository, which works on whatever session it is given."""

from __future__ import annotations

from sqlalchemy import String
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    """The shop's own tables (Mersal's outbox and inbox are migrated by `mersal db upgrade`)."""


class Order(Base):
    """An order the web layer took; the worker marks it billed."""

    __tablename__ = "shop_orders"

    order_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    amount: Mapped[float]
    status: Mapped[str] = mapped_column(String(20))


class Invoice(Base):
    """The bill for an order: at most one per order."""

    __tablename__ = "shop_invoices"

    order_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    amount: Mapped[float]


class UnknownOrder(Exception):
    """No order has the id a message names."""


# --8<-- [start:repository]
class Orders:
    """The orders repository: reads and writes through its session.

    The web layer builds it on the request's session; in the worker, Mersal
    builds it for each message on the message's session, so its writes commit
    with the message's inbox row.
    """

    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    def add(self, order_id: str, amount: float) -> Order:
        """A new order, status "placed" (written when the session commits)."""
        order = Order(order_id=order_id, amount=amount, status="placed")
        self.session.add(order)
        return order

    async def get(self, order_id: str) -> Order | None:
        """The order with this id, if there is one."""
        return await self.session.get(Order, order_id)

    async def bill(self, order_id: str) -> Invoice:
        """Write the order's invoice and mark the order billed."""
        order = await self.get(order_id)
        if order is None:
            raise UnknownOrder(f"no order {order_id!r}")
        order.status = "billed"
        invoice = Invoice(order_id=order_id, amount=order.amount)
        self.session.add(invoice)
        return invoice
        # --8<-- [end:repository]
