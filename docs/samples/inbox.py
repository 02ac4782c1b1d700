"""The inbox on SQLite: a message delivered twice has its effects once."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import String, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from mersal import App, Header, message
from mersal.testing import Harness
from mersal_sqlalchemy import make_engine


class Base(DeclarativeBase):
    pass


class Payment(Base):
    __tablename__ = "payments"
    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[str] = mapped_column(String(40))


# --8<-- [start:handler]
@message("payments.Pay.v1")
@dataclass
class Pay:
    order_id: str


class PayHandler:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def __call__(self, message: Pay) -> None:
        self.session.add(Payment(order_id=message.order_id))
        # --8<-- [end:handler]


async def main(database: str) -> int:
    """Send a payment twice with one message id; return the payments written."""
    engine = make_engine(database)
    async with engine.begin() as connection:
        await connection.run_sync(Base.metadata.create_all)
    # --8<-- [start:app]
    app = App("payments", database=database)  # its inbox table is there
    app.register(Pay, PayHandler)
    app.route(Pay, "payments")
    # --8<-- [end:app]
    async with Harness(app) as bus:
        # --8<-- [start:twice]
        # a producer that sends again after a lost confirm: the same message,
        # the same id
        await app.send(Pay("o-1"), headers={Header.MESSAGE_ID: "pay-o-1"})
        await app.send(Pay("o-1"), headers={Header.MESSAGE_ID: "pay-o-1"})
        # the second delivery finds "pay-o-1" in the inbox: skipped, acked
        # --8<-- [end:twice]
        await bus.idle()
    try:
        async with AsyncSession(engine) as session:
            return int(
                await session.scalar(select(func.count()).select_from(Payment))
                or 0
            )
    finally:
        await engine.dispose()
