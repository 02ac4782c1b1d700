"""A repository behind an interface, built per message on its session."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from lagom import Container
from sqlalchemy import String, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from mersal import App, message
from mersal.testing import Harness
from mersal_sqlalchemy import make_engine


class Base(DeclarativeBase):
    pass


class Customer(Base):
    __tablename__ = "customers"
    customer_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    email: Mapped[str] = mapped_column(String(200))


@message("crm.ChangeEmail.v1")
@dataclass
class ChangeEmail:
    customer_id: str
    email: str


# --8<-- [start:repository]
class Customers(Protocol):
    """What the handler needs: the interface, not the database."""

    async def change_email(self, customer_id: str, email: str) -> None:
        """Give the customer a new email address."""


class SqlCustomers:
    """Customers in SQL, through the session it is built with."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def change_email(self, customer_id: str, email: str) -> None:
        """Give the customer a new email address (created if unknown)."""
        customer = await self.session.get(Customer, customer_id)
        if customer is None:
            self.session.add(Customer(customer_id=customer_id, email=email))
        else:
            customer.email = email


class ChangeEmailHandler:
    def __init__(self, customers: Customers) -> None:
        self.customers = customers

    async def __call__(self, message: ChangeEmail) -> None:
        await self.customers.change_email(message.customer_id, message.email)


def build_app(database: str) -> App:
    container = Container()
    # resolved per message, in the message's scope, where AsyncSession is the
    # message's session (mypy wants a concrete class as the key: the ignore)
    container[Customers] = (  # type: ignore[type-abstract]
        lambda scope: SqlCustomers(scope[AsyncSession])
    )
    app = App("crm", database=database, container=container)
    app.register(ChangeEmail, ChangeEmailHandler)
    app.route(ChangeEmail, "crm")
    return app
    # --8<-- [end:repository]


async def main(database: str) -> list[tuple[str, str]]:
    """Change two addresses; return the customers the repository wrote."""
    engine = make_engine(database)
    try:
        async with engine.begin() as connection:
            await connection.run_sync(Base.metadata.create_all)
        app = build_app(database)
        async with Harness(app) as bus:
            await app.send(ChangeEmail("c-1", "ada@example.com"))
            await bus.idle()
            await app.send(ChangeEmail("c-1", "ada@example.org"))
            await app.send(ChangeEmail("c-2", "alan@example.com"))
            await bus.idle()
        async with AsyncSession(engine) as session:
            rows = await session.execute(
                select(Customer.customer_id, Customer.email)
            )
            return sorted((row.customer_id, row.email) for row in rows)
    finally:
        await engine.dispose()
