"""The inbox and outbox inserts belong to the transaction they are written in, on any table."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest
from sqlalchemy import event, func, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from mersal.messages import Envelope
from mersal.transport import Outgoing
from mersal_sqlalchemy.engines import make_engine
from mersal_sqlalchemy.inbox import Inbox
from mersal_sqlalchemy.outbox import write_outbox
from mersal_sqlalchemy.tables import Tables, make_tables
from tests.support import eventually

pytestmark = pytest.mark.integration

TABLES = make_tables()


@pytest.fixture
async def engine(postgres_url: str) -> AsyncIterator[AsyncEngine]:
    engine = make_engine(postgres_url)
    yield engine
    await engine.dispose()


def outgoing(n: int) -> Outgoing:
    headers = {"message-id": f"m-{n:03d}", "type": "Ship", "odd": "quote ' and \\ and é"}
    return Outgoing(f"queue-{n % 3}", Envelope(headers, bytes([n % 256, 0, 255])), n % 2 == 0)


async def count(engine: AsyncEngine, tables: Tables, which: str) -> int:
    table = tables.outbox if which == "outbox" else tables.inbox
    async with engine.connect() as connection:
        return int((await connection.execute(select(func.count()).select_from(table))).scalar_one())


async def test_rows_written_first_in_a_session_roll_back_with_it(engine: AsyncEngine) -> None:
    """The first statement of a session or connection, ours, is inside its transaction."""
    inbox = Inbox(engine, TABLES.inbox, "orders", retention=60)
    async with AsyncSession(engine) as session:
        assert await inbox.record(session, "first")
        await write_outbox(session, TABLES.outbox, "orders", [outgoing(1)], TABLES.channel)
        await session.rollback()
    async with engine.connect() as connection:
        await write_outbox(connection, TABLES.outbox, "orders", [outgoing(2)], None)
        await connection.rollback()
    assert await count(engine, TABLES, "outbox") == 0
    assert await count(engine, TABLES, "inbox") == 0


async def test_the_inbox_says_whether_an_id_is_new(engine: AsyncEngine) -> None:
    inbox = Inbox(engine, TABLES.inbox, "orders", retention=60)
    async with AsyncSession(engine) as session, session.begin():
        assert await inbox.record(session, "once")
    async with AsyncSession(engine) as session, session.begin():
        assert not await inbox.record(session, "once")
        assert await inbox.record(session, "x" * 300)  # stored as a digest
        assert not await inbox.record(session, "x" * 300)


@pytest.mark.parametrize("begun", [False, True], ids=["through-sqlalchemy", "through-asyncpg"])
async def test_rows_keep_their_order_fields_and_bytes(engine: AsyncEngine, begun: bool) -> None:
    """Once the transaction has begun, the rows go straight to asyncpg: the same rows."""
    sent = [outgoing(n) for n in range(120)]
    through_sqlalchemy: list[str] = []

    @event.listens_for(engine.sync_engine, "before_cursor_execute")
    def note(connection: object, cursor: object, statement: str, *args: object) -> None:
        if statement.startswith("INSERT"):
            through_sqlalchemy.append(statement)

    async with AsyncSession(engine) as session, session.begin():
        if begun:
            await session.execute(text("SELECT 1"))
        await write_outbox(session, TABLES.outbox, "orders", sent[:1], TABLES.channel)
        await write_outbox(session, TABLES.outbox, "orders", sent[1:], TABLES.channel)
    table = TABLES.outbox
    async with engine.connect() as connection:
        query = select(table.c.app, table.c.address, table.c.publish, table.c.headers, table.c.body)
        rows = (await connection.execute(query.order_by(table.c.id))).all()
    assert [row.address for row in rows] == [message.address for message in sent]
    assert [row.publish for row in rows] == [message.publish for message in sent]
    assert [row.body for row in rows] == [message.envelope.body for message in sent]
    assert {row.app for row in rows} == {"orders"}
    assert len(through_sqlalchemy) == (0 if begun else 1)  # the first write begins it
    assert '"odd":"quote \' and \\\\ and é"' in rows[0].headers


async def test_one_commit_notifies_the_channel_once(engine: AsyncEngine) -> None:
    dsn = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    listener = await asyncpg.connect(dsn)
    heard: list[str] = []
    await listener.add_listener(TABLES.channel, lambda *args: heard.append(args[-1]))
    try:
        async with AsyncSession(engine) as session, session.begin():
            await write_outbox(session, TABLES.outbox, "orders", [outgoing(1)], TABLES.channel)
            await write_outbox(session, TABLES.outbox, "orders", [outgoing(2)], TABLES.channel)
        async with AsyncSession(engine) as session:
            await write_outbox(session, TABLES.outbox, "orders", [outgoing(3)], TABLES.channel)
            await session.rollback()
        await eventually(lambda: bool(heard), "the notification")
        await listener.execute("SELECT 1")
    finally:
        await listener.close()
    assert heard == ["orders"]


async def test_rows_written_first_on_a_fresh_connection_commit_with_it(engine: AsyncEngine) -> None:
    async with engine.connect() as connection:
        await write_outbox(connection, TABLES.outbox, "orders", [outgoing(1)], None)
        await connection.commit()
    assert await count(engine, TABLES, "outbox") == 1


@pytest.mark.parametrize("names", [("OrdersOutbox", "OrdersInbox"), ("order", "user")])
async def test_mixed_case_and_reserved_table_names_work(
    engine: AsyncEngine, names: tuple[str, str]
) -> None:
    tables = make_tables(*names)
    async with engine.begin() as connection:
        await connection.run_sync(tables.metadata.create_all)
    inbox = Inbox(engine, tables.inbox, "orders", retention=60)
    async with AsyncSession(engine) as session, session.begin():
        assert await inbox.record(session, "m-1")
        await write_outbox(session, tables.outbox, "orders", [outgoing(1)], tables.channel)
    assert await count(engine, tables, "outbox") == 1
    assert await count(engine, tables, "inbox") == 1


async def test_a_failed_insert_fails_as_sqlalchemy_reports_it(engine: AsyncEngine) -> None:
    """The direct insert, in a transaction already aborted, fails as a DBAPIError naming it."""
    async with AsyncSession(engine) as session:
        await session.execute(text("SELECT 1"))
        with pytest.raises(DBAPIError):
            await session.execute(text("SELECT 1 / 0"))
        with pytest.raises(DBAPIError, match="INSERT INTO mersal_outbox") as caught:
            await write_outbox(session, TABLES.outbox, "orders", [outgoing(1)], TABLES.channel)
        assert "current transaction is aborted" in str(caught.value)
        await session.rollback()
    assert await count(engine, TABLES, "outbox") == 0


async def test_an_engine_that_translates_the_schema_writes_where_it_points(
    postgres_url: str,
) -> None:
    """schema_translate_map moves the tables (one schema per tenant): the rows go there too."""
    engine = make_engine(postgres_url, execution_options={"schema_translate_map": {None: "t1"}})
    try:
        async with engine.begin() as connection:
            await connection.execute(text("CREATE SCHEMA t1"))
            await connection.run_sync(TABLES.metadata.create_all)
        inbox = Inbox(engine, TABLES.inbox, "orders", retention=60)
        async with AsyncSession(engine) as session, session.begin():
            assert await inbox.record(session, "m-1")  # the transaction has begun
            await write_outbox(session, TABLES.outbox, "orders", [outgoing(1)], TABLES.channel)
        async with engine.connect() as connection:
            counts = await connection.exec_driver_sql(
                "SELECT (SELECT count(*) FROM t1.mersal_outbox), "
                "(SELECT count(*) FROM public.mersal_outbox)"
            )
            assert tuple(counts.one()) == (1, 0)
    finally:
        await engine.dispose()


async def test_a_direct_insert_cancelled_midway_leaves_nothing_and_the_connection_usable(
    postgres_url: str,
) -> None:
    """Cancelled while asyncpg runs it (a handler timeout, a stop): rolled back, pool fine."""
    engine = make_engine(postgres_url, pool_size=1, max_overflow=0)  # the one connection is reused
    try:
        async with engine.begin() as connection:
            await connection.execute(
                text(
                    "CREATE FUNCTION slow_insert() RETURNS trigger AS $$ BEGIN "
                    "PERFORM pg_sleep(0.5); RETURN NEW; END $$ LANGUAGE plpgsql"
                )
            )
            await connection.execute(
                text(
                    "CREATE TRIGGER slow_insert BEFORE INSERT ON mersal_outbox "
                    "FOR EACH ROW EXECUTE FUNCTION slow_insert()"
                )
            )
        for n in range(3):
            session = AsyncSession(engine)

            async def writing(session: AsyncSession = session, n: int = n) -> None:
                await session.execute(text("SELECT 1"))  # begun: the insert goes to asyncpg
                await write_outbox(session, TABLES.outbox, "orders", [outgoing(n)], TABLES.channel)
                await session.commit()

            task = asyncio.create_task(writing())
            await asyncio.sleep(0.2)  # inside the slow insert
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await session.close()
        async with AsyncSession(engine) as session, session.begin():
            await write_outbox(session, TABLES.outbox, "orders", [outgoing(9)], TABLES.channel)
        async with engine.connect() as connection:
            query = select(TABLES.outbox.c.headers)
            rows = (await connection.execute(query)).scalars().all()
        assert len(rows) == 1 and '"m-009"' in rows[0]
    finally:
        await engine.dispose()
