"""An app with its outbox and inbox on PostgreSQL; tests/docs runs it on a
database of its own."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import String, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from mersal import App, message
from mersal.testing import Harness
from mersal_sqlalchemy import attach, make_engine


class Base(DeclarativeBase):
    pass


class Shipment(Base):
    __tablename__ = "shipments"
    order_id: Mapped[str] = mapped_column(String(40), primary_key=True)


@message("shipping.Ship.v1")
@dataclass
class Ship:
    order_id: str


class ShipHandler:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def __call__(self, message: Ship) -> None:
        self.session.add(Shipment(order_id=message.order_id))


# --8<-- [start:app]
def build_app(database: str) -> App:
    """`database`: "postgresql+asyncpg://user:password@db.internal/shipping"."""
    app = App("shipping", database=database)  # or MERSAL_DATABASE
    attach(  # optional: only to change the defaults
        app,
        engine_options={"pool_size": 20, "pool_pre_ping": True},
        relay_batch=500,
    )
    app.register(Ship, ShipHandler)
    app.route(Ship, "shipping")
    return app
    # --8<-- [end:app]


async def main(database: str) -> list[str]:
    """Ship one order (on memory://); return the shipments the handler wrote."""
    engine = make_engine(database)
    try:
        async with engine.begin() as connection:
            await connection.run_sync(Base.metadata.create_all)
        app = build_app(database)
        async with Harness(app) as bus:
            await app.send(Ship("o-1"))
            await bus.idle()
        async with AsyncSession(engine) as session:
            return list(
                (await session.scalars(select(Shipment.order_id))).all()
            )
    finally:
        await engine.dispose()
