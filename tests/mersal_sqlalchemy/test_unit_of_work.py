"""The Core unit of work: a message whose handlers ask for an AsyncConnection is handled on one.

No ORM session is built for it; its rows, its outbox rows and its inbox row commit together on
the connection, or not at all. A handler may not commit, roll back or close the connection;
savepoints undo their rows and their sends; a handler asking for a session beside one asking
for a connection shares one transaction. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from lagom import Container
from sqlalchemy import insert, select, text
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from mersal import App, MessageContext, RetryPolicy
from mersal.sagas import Saga
from mersal_sqlalchemy import SESSION
from mersal_sqlalchemy.unit_of_work import MessageAsyncConnection
from tests.mersal_sqlalchemy.support import (
    ORDERS,
    Order,
    PlaceOrder,
    Ship,
    Sink,
    count,
    create_business_tables,
    outbox_empty,
    storage_of,
)
from tests.support import eventually


@dataclass
class Seen:
    """What the handlers were given, per message."""

    executors: list[object] = field(default_factory=list)
    sessions: list[object] = field(default_factory=list)
    runs: Counter[str] = field(default_factory=Counter)


class CoreOrderHandler:
    """Inserts the order with Core and sends a Ship; raises for `fail=True` after both."""

    def __init__(
        self, app: App, connection: AsyncConnection, context: MessageContext, seen: Seen
    ) -> None:
        self.app, self.connection, self.context, self.seen = app, connection, context, seen

    async def __call__(self, message: PlaceOrder) -> None:
        """Handle one order."""
        self.seen.executors.append(self.connection)
        self.seen.sessions.append(self.context.items.get(SESSION))
        await self.connection.execute(insert(ORDERS).values(order_id=message.order_id))
        await self.app.send(Ship(len(self.seen.executors)))
        if message.fail:
            raise RuntimeError(f"order {message.order_id} fails on purpose")


def core_app(database: str, memory_url: str, seen: Seen, *handlers: Any) -> App:
    """An app whose PlaceOrder handlers are `handlers` (CoreOrderHandler by default)."""
    container = Container()
    container[Seen] = seen
    app = App(
        "orders",
        transport=memory_url,
        database=database,
        retry=RetryPolicy(immediate=0, delayed=[], error_queue="error"),
        container=container,
    )
    for handler in handlers or (CoreOrderHandler,):
        app.register(PlaceOrder, handler)
    app.route(PlaceOrder, "orders")
    app.route(Ship, "sink")
    return app


async def order_ids(app: App) -> list[str]:
    """The order ids committed, in id order."""
    async with storage_of(app).engine.connect() as connection:
        query = select(ORDERS.c.order_id).order_by(ORDERS.c.id)
        return list((await connection.execute(query)).scalars())


def error_of(sink: Sink) -> str:
    """The error message of the one dead-lettered message."""
    dead = [o for o in sink.seen if o.address == "error"]
    assert len(dead) == 1, dead
    return dead[0].envelope.headers["error-message"]


async def test_a_core_handler_commits_its_row_its_sends_and_the_inbox_row_without_a_session(
    database: str, memory_url: str
) -> None:
    await create_business_tables(database)
    sink = await Sink(memory_url).start("error")
    seen = Seen()
    app = core_app(database, memory_url, seen)
    async with app:
        storage = storage_of(app)
        await app.send(PlaceOrder("o-1"))
        await eventually(lambda: len(sink.ids()) == 1, "the Ship leaves through the outbox")
        assert await order_ids(app) == ["o-1"]
        assert await count(storage.engine, storage.tables.inbox) == 1
        assert await outbox_empty(storage)
    assert [type(e) for e in seen.executors] == [MessageAsyncConnection]
    assert seen.sessions == [None]
    assert sink.ids("error") == []


def writer(then: Callable[[AsyncConnection], Awaitable[None]]) -> type:
    """A Core handler that inserts the order, sends a Ship, then does `then` to the connection."""

    class Writer:
        def __init__(self, app: App, connection: AsyncConnection) -> None:
            self.app, self.connection = app, connection

        async def __call__(self, message: PlaceOrder) -> None:
            await self.connection.execute(insert(ORDERS).values(order_id=message.order_id))
            await self.app.send(Ship(1))
            await then(self.connection)

    return Writer


async def failed_attempt(database: str, memory_url: str, handler: type) -> str:
    """Send one PlaceOrder to `handler`; check it left nothing and sent nothing; its error."""
    await create_business_tables(database)
    sink = await Sink(memory_url).start("error")
    app = core_app(database, memory_url, Seen(), handler)
    async with app:
        storage = storage_of(app)
        await app.send(PlaceOrder("o-1"))
        await eventually(lambda: len(sink.ids("error")) == 1, "the message is dead-lettered")
        assert await order_ids(app) == []
        assert await count(storage.engine, storage.tables.inbox) == 0
        assert await count(storage.engine, storage.tables.outbox) == 0
    assert sink.ids() == []
    return error_of(sink)


async def _raise(connection: AsyncConnection) -> None:
    raise RuntimeError("the order fails on purpose")


async def test_a_core_handler_that_raises_leaves_nothing_and_sends_nothing(
    database: str, memory_url: str
) -> None:
    assert "fails on purpose" in await failed_attempt(database, memory_url, writer(_raise))


async def test_a_message_delivered_twice_to_a_core_handler_is_handled_once(
    database: str, memory_url: str
) -> None:
    await create_business_tables(database)
    sink = await Sink(memory_url).start("error")
    seen = Seen()
    app = core_app(database, memory_url, seen)
    async with app:
        await app.send(PlaceOrder("o-1"), headers={"message-id": "same"})
        await eventually(lambda: len(sink.ids()) == 1, "the first copy is handled")
        await app.send(PlaceOrder("o-1"), headers={"message-id": "same"})
        await eventually(lambda: sink.queue_settled("orders"), "the copy is settled")
        assert await order_ids(app) == ["o-1"]
    assert len(seen.executors) == 1
    assert sink.ids("error") == []


async def _commit(connection: AsyncConnection) -> None:
    await connection.commit()


async def _rollback(connection: AsyncConnection) -> None:
    await connection.rollback()


async def _close(connection: AsyncConnection) -> None:
    await connection.close()


async def _commit_underneath(connection: AsyncConnection) -> None:
    transaction = connection.get_transaction()
    assert transaction is not None
    await transaction.commit()


async def _rollback_underneath(connection: AsyncConnection) -> None:
    transaction = connection.get_transaction()
    assert transaction is not None
    await transaction.rollback()


ENDINGS: dict[str, tuple[Callable[[AsyncConnection], Awaitable[None]], str]] = {
    "commit": (_commit, "do not commit the message's connection"),
    "rollback": (_rollback, "do not roll back the message's connection"),
    "close": (_close, "do not close the message's connection"),
    "commit of its transaction": (_commit_underneath, "do not commit the message's connection"),
    "rollback of its transaction": (_rollback_underneath, "connection was rolled back"),
}


@pytest.mark.parametrize("ending", list(ENDINGS))
async def test_a_core_handler_may_not_end_the_messages_connection(
    database: str, memory_url: str, ending: str
) -> None:
    end, refusal = ENDINGS[ending]
    assert refusal in await failed_attempt(database, memory_url, writer(end))


@dataclass
class Work:
    """A command whose Core handler writes a row, then a row and a send in a savepoint."""

    n: int
    style: str


STYLES = ("released", "rolled back", "failed statement")


class SavepointHandler:
    """Writes an outer row, then works in a savepoint in one of STYLES, then sends Ship(n)."""

    def __init__(self, app: App, connection: AsyncConnection) -> None:
        self.app, self.connection = app, connection

    async def __call__(self, message: Work) -> None:
        connection, style = self.connection, message.style
        await connection.execute(insert(ORDERS).values(order_id=f"{style}: outer"))
        try:
            async with connection.begin_nested():
                await connection.execute(insert(ORDERS).values(order_id=f"{style}: savepoint"))
                await self.app.send(Ship(100 + message.n))
                if style == "rolled back":
                    raise LookupError("undo the savepoint")
                if style == "failed statement":
                    await connection.execute(insert(ORDERS).values(id=1, order_id="clash"))
                    await connection.execute(insert(ORDERS).values(id=1, order_id="clash"))
        except (LookupError, IntegrityError):
            pass
        await self.app.send(Ship(message.n))


async def test_savepoints_on_the_connection_undo_their_rows_and_their_sends(
    database: str, memory_url: str
) -> None:
    await create_business_tables(database)
    sink = await Sink(memory_url).start("error")
    app = core_app(database, memory_url, Seen())
    app.register(Work, SavepointHandler)
    app.route(Work, "orders")
    async with app:
        for n, style in enumerate(STYLES):
            await app.send(Work(n, style))
        await eventually(
            lambda: len(sink.ids()) + len(sink.ids("error")) >= 4, "every message handled"
        )
        await eventually(lambda: sink.queue_settled("orders"), "every message settled")
        rows = await order_ids(app)
    errors = [o.envelope.headers.get("error-message") for o in sink.seen if o.address == "error"]
    assert errors == []
    assert sorted(rows) == sorted(
        ["released: outer", "released: savepoint", "rolled back: outer", "failed statement: outer"]
    )
    shipped = sorted(json.loads(o.envelope.body)["n"] for o in sink.seen if o.address == "sink")
    assert shipped == [0, 1, 2, 100]
    assert sink.duplicates() == {}


async def test_a_failed_statement_a_handler_swallowed_fails_the_attempt_on_postgresql(
    postgres_url: str, memory_url: str
) -> None:
    """PostgreSQL aborts the transaction: its COMMIT would silently roll everything back."""
    reason = await failed_attempt(postgres_url, memory_url, writer(_swallow_a_failure))
    assert "no_such_table" in reason
    assert "begin_nested" in reason


async def _swallow_a_failure(connection: AsyncConnection) -> None:
    with contextlib.suppress(DBAPIError):
        await connection.execute(text("SELECT * FROM no_such_table"))


class SessionOrderHandler:
    """Adds an order through the ORM, after reading what the Core handler wrote."""

    def __init__(self, session: AsyncSession, seen: Seen) -> None:
        self.session, self.seen = session, seen

    async def __call__(self, message: PlaceOrder) -> None:
        query = select(ORDERS.c.order_id).where(ORDERS.c.order_id == message.order_id)
        self.seen.runs["core rows seen"] += len((await self.session.execute(query)).all())
        self.session.add(Order(order_id=f"{message.order_id} (orm)"))
        self.seen.sessions.append(self.session)


async def test_handlers_asking_for_a_session_and_a_connection_share_one_transaction(
    database: str, memory_url: str
) -> None:
    await create_business_tables(database)
    sink = await Sink(memory_url).start("error")
    seen = Seen()
    app = core_app(database, memory_url, seen, CoreOrderHandler, SessionOrderHandler)
    async with app:
        await app.send(PlaceOrder("o-1"))
        await app.send(PlaceOrder("o-2", fail=True))
        await eventually(lambda: len(sink.ids("error")) == 1, "the failing order dead-letters")
        await eventually(lambda: len(sink.ids()) == 1, "the Ship of o-1 leaves")
        rows = await order_ids(app)
    assert sorted(rows) == ["o-1", "o-1 (orm)"]
    assert seen.runs["core rows seen"] == 1  # o-2's handler raised before the ORM one ran
    connection = seen.executors[0]
    assert isinstance(connection, MessageAsyncConnection)
    session = seen.sessions[-1]
    assert isinstance(session, AsyncSession)


class Repository:
    """A dependency of a handler on a connection that asks for the session."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session


class FactoryHandler:
    """Asks for the connection, and for a Repository the container builds from a factory."""

    def __init__(self, connection: AsyncConnection, repository: Repository) -> None:
        self.connection, self.repository = connection, repository

    async def __call__(self, message: PlaceOrder) -> None:
        raise AssertionError("never built: its Repository cannot have a session")


async def test_a_dependency_asking_for_a_session_on_a_connection_message_is_told_how(
    database: str, memory_url: str
) -> None:
    """A dependency the container builds from a factory cannot be read ahead: it asks late."""
    await create_business_tables(database)
    sink = await Sink(memory_url).start("error")

    app = core_app(database, memory_url, Seen(), FactoryHandler)
    app.handlers.container[Repository] = lambda c: Repository(c[AsyncSession])
    async with app:
        await app.send(PlaceOrder("o-1"))
        await eventually(lambda: len(sink.ids("error")) == 1, "the message is dead-lettered")
    reason = error_of(sink)
    assert "AsyncSession" in reason
    assert "session: AsyncSession" in reason


@dataclass
class Count:
    key: str
    n: int


@dataclass
class Counted:
    total: int = 0
    seen: list[int] = field(default_factory=list)


class Counter_(Saga[Counted], name="tests.unit_of_work.Counter"):
    """A saga that writes a Core row per event beside its data."""

    started_by = (Count,)
    correlation = {Count: "key"}

    def __init__(self, connection: AsyncConnection) -> None:
        self.connection = connection

    async def count(self, message: Count) -> None:
        self.data.total += message.n
        self.data.seen.append(message.n)
        await self.connection.execute(insert(ORDERS).values(order_id=f"count {message.n}"))


async def test_a_saga_asking_for_a_connection_keeps_its_data_on_it(
    database: str, memory_url: str
) -> None:
    await create_business_tables(database)
    sink = await Sink(memory_url).start("error")
    app = App(
        "counting",
        transport=memory_url,
        database=database,
        retry=RetryPolicy(immediate=0, delayed=[], error_queue="error"),
        concurrency=1,
    )
    app.register_saga(Counter_)
    app.route(Count, "counting")
    async with app:
        for n in (1, 2, 3):
            await app.send(Count("k", n))
        await eventually(lambda: sink.queue_settled("counting"), "every event settled")

        async def total() -> int:
            stored = await storage_of(app).sagas.read("tests.unit_of_work.Counter", "k")
            return 0 if stored is None else json.loads(stored.data)["total"]

        await eventually(lambda: total(), "the saga counted", timeout=5)
        assert await total() == 6
        assert sorted(await order_ids(app)) == ["count 1", "count 2", "count 3"]
    assert sink.ids("error") == []
