"""One engine for your code and the app's outbox: one pool, one database
transaction (SQLite)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import String, select
from sqlalchemy.ext.asyncio import async_sessionmaker
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from mersal import App, message
from mersal.testing import Harness
from mersal_sqlalchemy import SqlStorage, attach, make_engine


class Base(DeclarativeBase):
    pass


class Signup(Base):
    __tablename__ = "signups"
    email: Mapped[str] = mapped_column(String(200), primary_key=True)


@message("accounts.Welcome.v1")
@dataclass
class Welcome:
    email: str


async def main(database: str) -> tuple[bool, list[str], list[str]]:
    """Sign a user up; return: the outbox used our engine?, rows, mails."""
    welcomed: list[str] = []
    mailer = App("mailer")

    async def welcome(message: Welcome) -> None:
        welcomed.append(message.email)

    mailer.register(Welcome, welcome)

    # --8<-- [start:share]
    engine = make_engine(database)  # the one engine (and pool) of this process
    app = App("signup", consume=False)  # a send-only front end
    app.route(Welcome, "mailer")
    # the outbox and its relay use that engine
    storage = attach(app, engine=engine)
    # what your code uses
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    # --8<-- [end:share]
    async with engine.begin() as connection:
        await connection.run_sync(Base.metadata.create_all)
    try:
        async with Harness(mailer, app) as bus:
            # --8<-- [start:use]
            async with sessions() as session, app.transaction(session):
                session.add(Signup(email="ada@example.com"))
                # an outbox row in this transaction
                await app.send(Welcome("ada@example.com"))
            # --8<-- [end:use]
            await bus.idle()
        async with sessions() as session:
            rows = list((await session.scalars(select(Signup.email))).all())
        return (
            isinstance(storage, SqlStorage) and storage.engine is engine,
            rows,
            welcomed,
        )
    finally:
        # --8<-- [start:dispose]
        # yours to dispose of: attach(engine=...) leaves it open
        await engine.dispose()
        # --8<-- [end:dispose]
