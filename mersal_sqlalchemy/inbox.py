"""The SQL inbox: the message ids an app has handled, recorded in the handler's transaction."""

from __future__ import annotations

import asyncio

from sqlalchemy import Delete, Select, Table, bindparam, delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from mersal.messages import stored_key
from mersal_sqlalchemy.engines import is_postgresql, one_of, sql_time


def inbox_key(message_id: str) -> str:
    """The id as stored: itself, or a digest of it if the column cannot hold it as it is."""
    return stored_key(message_id)


class Inbox:
    """One app's handled message ids, kept for `retention` seconds after handling."""

    def __init__(
        self,
        engine: AsyncEngine,
        table: Table,
        app: str,
        *,
        retention: float,
        cleanup_batch: int = 1_000,
    ) -> None:
        self.engine = engine
        self.table = table
        self.app = app
        self.retention = retention
        self.cleanup_batch = cleanup_batch
        insert = postgresql.insert if is_postgresql(engine) else sqlite.insert
        self._record = (
            insert(table)
            .values(app=bindparam("app"), message_id=bindparam("message_id"))
            .on_conflict_do_nothing()
            .returning(table.c.message_id)
        )

    async def record(self, executor: AsyncSession | AsyncConnection, message_id: str) -> bool:
        """Record the id in the transaction of `executor`; False if it was handled already.

        A copy being handled at the same moment holds the row: the insert waits for that
        transaction and then finds the id (it committed) or records it (it rolled back).
        """
        parameters = {"app": self.app, "message_id": inbox_key(message_id)}
        result = await executor.execute(self._record, parameters)
        return result.first() is not None

    async def seen(self, message_id: str, connection: AsyncConnection | None = None) -> bool:
        """Whether the id was recorded already: read on `connection`, or on one of its own."""
        if connection is not None:
            return (await connection.execute(self.seen_query(message_id))).first() is not None
        async with self.engine.connect() as connection:
            return (await connection.execute(self.seen_query(message_id))).first() is not None

    def seen_query(self, message_id: str) -> Select[tuple[str]]:
        """The lookup of one id (by the primary key)."""
        table = self.table
        return select(table.c.message_id).where(
            table.c.app == self.app, table.c.message_id == inbox_key(message_id)
        )

    def cleanup_statement(self) -> Delete:
        """Delete one batch of this app's ids older than the retention window."""
        table = self.table
        expired = (
            select(table.c.message_id)
            .where(
                table.c.app == self.app,
                table.c.handled_at < sql_time(self.engine, -self.retention),
            )
            .limit(self.cleanup_batch)
        )
        chosen = one_of(table.c.message_id, expired, self.engine)  # by the primary key
        return delete(table).where(table.c.app == self.app, chosen)

    async def clean(self) -> int:
        """Delete ids older than the retention window, in bounded batches; returns how many."""
        statement = self.cleanup_statement()
        total = 0
        while True:
            async with self.engine.begin() as connection:
                deleted = (await connection.execute(statement)).rowcount
            total += deleted
            if deleted < self.cleanup_batch:
                return total
            await asyncio.sleep(0)
