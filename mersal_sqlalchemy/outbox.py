"""The SQL outbox: rows written in the sender's transaction, claimed by the relay with a lease."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import msgspec
from sqlalchemy import Insert, Row, Table, Update, delete, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.sql.elements import ColumnElement

from mersal.messages import Envelope
from mersal.outbox import OutboxRow
from mersal.transport import Outgoing
from mersal_sqlalchemy.engines import is_postgresql, one_of, sql_time

log = logging.getLogger("mersal.sqlalchemy")

Executor = AsyncSession | AsyncConnection
"""Where outbox rows are written: a session or a connection, inside its transaction."""

MAX_REASON = 4_000

_headers_json = msgspec.json.Encoder()
_headers_of = msgspec.json.Decoder(dict[str, str])


def outbox_rows(app: str, outgoing: Sequence[Outgoing]) -> list[dict[str, Any]]:
    """The outbox rows for the messages `app` sends, in the order it sent them."""
    return [
        {
            "app": app,
            "address": message.address,
            "publish": message.publish,
            "headers": _headers_json.encode(message.envelope.headers).decode(),
            "body": message.envelope.body,
        }
        for message in outgoing
    ]


async def write_outbox(
    executor: Executor,
    table: Table,
    app: str,
    outgoing: Sequence[Outgoing],
    channel: str | None,
) -> None:
    """Insert the rows in one statement; on PostgreSQL it also NOTIFYs `channel` at commit.

    On asyncpg, once the transaction has begun on the connection, the rows go straight to
    asyncpg (a prepared statement, a third of the CPU of SQLAlchemy's execute); SQLAlchemy's
    execution events do not see that insert. If it fails, SQLAlchemy runs it again, to fail
    as SQLAlchemy's users expect (a DBAPIError naming the statement, a broken connection
    invalidated): the failed statement left nothing that can commit.
    """
    if not outgoing:
        return
    direct = await asyncpg_insert(executor, table, channel)
    if direct is not None:
        try:
            await _insert_directly(*direct, app, outgoing, channel)
            return
        except Exception as error:
            log.debug("the outbox insert through asyncpg failed (%s); through SQLAlchemy", error)
    await executor.execute(insert_statement(table, channel, app), outbox_rows(app, outgoing))


async def _insert_directly(
    driver: Any, statement: str, app: str, outgoing: Sequence[Outgoing], channel: str | None
) -> None:
    rows = [
        (row["app"], row["address"], row["publish"], row["headers"], row["body"], channel, app)
        for row in outbox_rows(app, outgoing)
    ]
    if len(rows) == 1:
        await driver.execute(statement, *rows[0])
    else:
        await driver.executemany(statement, rows)


async def asyncpg_insert(
    executor: Executor, table: Table, channel: str | None
) -> tuple[Any, str] | None:
    """asyncpg's connection and the insert in its terms, if the transaction began there.

    None where SQLAlchemy must write it: other drivers, SQLite, a schema, and engines whose
    `schema_translate_map` moves the table.
    """
    if channel is None or table.schema is not None:
        return None
    connection = await executor.connection() if isinstance(executor, AsyncSession) else executor
    options = (
        connection.sync_connection.get_execution_options() if connection.sync_connection else {}
    )
    if connection.dialect.driver != "asyncpg" or options.get("schema_translate_map"):
        return None
    driver = (await connection.get_raw_connection()).driver_connection
    if driver is None or not driver.is_in_transaction():
        return None
    return driver, driver_insert(connection.dialect.identifier_preparer.quote(table.name))


@lru_cache(maxsize=64)
def driver_insert(table: str) -> str:
    """The outbox insert in asyncpg's terms: $1..$5 the row, pg_notify($6, $7)."""
    return (
        f"INSERT INTO {table} (app, address, publish, headers, body) "
        "VALUES ($1, $2, $3, $4, $5) RETURNING pg_notify($6, $7)"
    )


@lru_cache(maxsize=64)
def insert_statement(table: Table, channel: str | None, app: str) -> Insert:
    """The outbox insert, built once; with a channel each row returns `pg_notify(channel, app)`.

    PostgreSQL delivers identical notifications of one transaction once, at commit, so a
    transaction that writes many rows still wakes the listening relays once.
    """
    statement = table.insert()
    if channel is not None:
        statement = statement.returning(func.pg_notify(channel, app))
    return statement


def row_of(record: Row[Any]) -> OutboxRow:
    """The OutboxRow for a claimed database row; one that cannot be read says why."""
    problem: str | None = None
    try:
        headers = _headers_of.decode(record.headers)
    except (msgspec.DecodeError, TypeError) as error:
        headers, problem = {}, f"its headers are not a JSON object of strings ({error})"
    body = record.body
    if not isinstance(body, bytes | bytearray | memoryview):
        body, problem = b"", problem or f"its body is a {type(body).__name__}, not bytes"
    address = record.address if isinstance(record.address, str) else ""
    envelope = Envelope(headers, bytes(body))
    outgoing = Outgoing(address, envelope, bool(record.publish))
    return OutboxRow(record.id, outgoing, record.attempts, problem)


class SqlOutboxStore:
    """One app's rows in an outbox table: claimed with a lease, deleted once confirmed.

    Only rows written by `app` are claimed, so that apps sharing one table each send their own
    rows through their own transport. On PostgreSQL the claim skips rows another relay has
    locked, so several relays of one app never claim one row at the same time.
    """

    def __init__(self, engine: AsyncEngine, table: Table, app: str, *, lease: float = 30.0) -> None:
        self._postgresql = is_postgresql(engine)
        # The claim's SKIP LOCKED and the deletes of confirmed rows rely on READ COMMITTED: at
        # a stricter level of the user's engine, relays of one app fail to serialize and a
        # confirmed row whose delete failed is sent again when its lease runs out.
        self.engine = (
            engine.execution_options(isolation_level="READ COMMITTED")
            if self._postgresql
            else engine
        )
        self.table = table
        self.app = app
        self.lease = lease

    async def claim(self, limit: int) -> list[OutboxRow]:
        """Lease up to `limit` unsent rows of this app, oldest first (committed at once)."""
        statement = self.claim_statement(limit)
        async with self.engine.begin() as connection:
            records = (await connection.execute(statement)).all()
        return [row_of(record) for record in sorted(records, key=lambda record: record.id)]

    def claim_statement(self, limit: int) -> Update:
        """The claim: lease the oldest unleased, unparked rows of this app (by the claim index)."""
        table = self.table
        candidates = (
            select(table.c.id)
            .where(
                table.c.app == self.app,
                table.c.parked_at.is_(None),
                or_(table.c.lease_until.is_(None), table.c.lease_until < sql_time(self.engine)),
            )
            .order_by(table.c.id)
            .limit(limit)
        )
        if self._postgresql:
            candidates = candidates.with_for_update(skip_locked=True)
        statement = (
            update(table)
            .where(one_of(table.c.id, candidates, self.engine))  # by the primary key
            .values(
                lease_until=sql_time(self.engine, self.lease),
                attempts=table.c.attempts + 1,
            )
            .returning(
                table.c.id,
                table.c.address,
                table.c.publish,
                table.c.headers,
                table.c.body,
                table.c.attempts,
            )
        )
        return statement

    async def delete(self, ids: Sequence[int]) -> None:
        """Forget rows the broker confirmed."""
        if ids:
            async with self.engine.begin() as connection:
                await connection.execute(delete(self.table).where(self.table.c.id.in_(ids)))

    async def release(self, ids: Sequence[int], delay: float = 0.0) -> None:
        """Give back the lease on rows that could not be sent now: claimable after `delay` s."""
        if ids:
            until = sql_time(self.engine, delay) if delay > 0 else None
            statement = update(self.table).where(self.table.c.id.in_(ids))
            async with self.engine.begin() as connection:
                await connection.execute(statement.values(lease_until=until))

    async def park(self, row_id: int, reason: str) -> None:
        """Set a row aside, with the reason, until an operator deals with it."""
        statement = (
            update(self.table)
            .where(self.table.c.id == row_id)
            .values(
                parked_reason=reason[:MAX_REASON],
                parked_at=sql_time(self.engine),
                lease_until=None,
            )
        )
        async with self.engine.begin() as connection:
            await connection.execute(statement)

    async def count_parked(self) -> int:
        """How many of this app's rows are parked."""
        return await self._count(self.table.c.parked_at.is_not(None))

    async def pending(self) -> int:
        """How many of this app's rows wait to be sent (parked rows not counted)."""
        return await self._count(self.table.c.parked_at.is_(None))

    async def _count(self, condition: ColumnElement[bool]) -> int:
        table = self.table
        query = select(func.count()).select_from(table).where(table.c.app == self.app, condition)
        async with self.engine.connect() as connection:
            return int((await connection.execute(query)).scalar_one())
