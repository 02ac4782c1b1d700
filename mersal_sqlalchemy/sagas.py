"""The SQL saga store: one row per running saga, in the message's session or connection."""

from __future__ import annotations

import asyncio
import base64
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from sqlalchemy import (
    CursorResult,
    Delete,
    Insert,
    Select,
    Table,
    Update,
    bindparam,
    delete,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from mersal.context import MessageContext
from mersal.errors import ConcurrencyConflict
from mersal.sagas import StoredSaga
from mersal.transaction import Transaction
from mersal_sqlalchemy.engines import ENDING, is_postgresql

T = TypeVar("T")

BINARY = "base64:"
"""Marks data stored in base64: bytes that are not UTF-8, or text that starts so itself."""

LOST_RACE = ("40001", "40P01")
"""PostgreSQL's serialization failure and deadlock: another transaction got there first."""


class SqlSagaStore:
    """One app's sagas in the saga table, in the transaction of the message being handled.

    A start inserts the row; the table's key (app, saga type, correlation value) lets only one
    of two concurrent starts commit. A save updates the row only at the revision it was loaded
    at, and a pessimistic load locks it (`FOR UPDATE`, on PostgreSQL; SQLite has one writer).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        table: Table,
        app: str,
        executor_of: Callable[[MessageContext], AsyncSession | AsyncConnection],
    ) -> None:
        self.engine = engine
        self.table = table
        self.app = app
        self.executor_of = executor_of
        self.locks = is_postgresql(engine)
        self._statements = _Statements.of(table)

    async def find(
        self,
        context: MessageContext,
        saga: str,
        *,
        correlation: str | None = None,
        saga_id: str | None = None,
        lock: bool = False,
    ) -> StoredSaga | None:
        """The saga by correlation value or id, as the message's transaction sees it."""
        query, values = self._select(saga, correlation, saga_id, lock=lock and self.locks)
        result = await _raced(self.executor_of(context).execute(query, values))
        return _stored(result.first())

    async def insert(self, context: MessageContext, saga: str, stored: StoredSaga) -> None:
        """Create the saga at revision 1; a conflict if another message created it first."""
        assert stored.data is not None
        values = {
            "app": self.app,
            "saga": saga,
            "correlation": stored.correlation,
            "id": stored.id,
            "revision": 1,
            "data": as_text(stored.data),
        }
        executor = self.executor_of(context)
        if isinstance(executor, AsyncSession):
            await executor.flush()  # the handler's own rows: their errors are the handler's
        try:
            await _raced(executor.execute(self._statements.insert, values))
        except IntegrityError:
            raise ConcurrencyConflict(
                f"saga {saga} {stored.correlation!r} was started by another message meanwhile"
            ) from None

    async def update(self, context: MessageContext, saga: str, stored: StoredSaga) -> None:
        """Save the data if the row is still at the revision it was loaded at."""
        assert stored.data is not None
        values = {
            **self._row(saga, stored),
            "next_revision": stored.revision + 1,
            "next_data": as_text(stored.data),
        }
        await self._one_row(context, self._statements.update, values, saga, stored)

    async def delete(self, context: MessageContext, saga: str, stored: StoredSaga) -> None:
        """Delete the saga if it is still at the revision it was loaded at."""
        await self._one_row(context, self._statements.delete, self._row(saga, stored), saga, stored)

    async def read(
        self, saga: str, correlation: str, *, transaction: Transaction | None = None
    ) -> StoredSaga | None:
        """The saga as last committed; with `transaction`, as its session sees it.

        Outside a transaction it is read on a connection of its own. Inside one (a message's,
        or an `app.transaction()` block's) it is read through the transaction's session or
        connection: on SQLite the one pooled connection may be that transaction's. Reads that
        share a session take turns (a session runs one statement at a time).
        """
        query, values = self._select(saga, correlation, None)
        executor = _executor_of(transaction)
        if executor is None:
            async with self.engine.connect() as connection:
                return _stored((await connection.execute(query, values)).first())
        async with _turns(executor):
            return _stored((await executor.execute(query, values)).first())

    def _select(
        self, saga: str, correlation: str | None, saga_id: str | None, *, lock: bool = False
    ) -> tuple[Select[Any], dict[str, Any]]:
        """The query that finds a saga by id or correlation value, and its parameters."""
        values = {"at_app": self.app, "at_saga": saga}
        statements = self._statements
        if saga_id is not None:
            query = statements.by_id_locked if lock else statements.by_id
            return query, {**values, "at_id": saga_id}
        query = statements.by_correlation_locked if lock else statements.by_correlation
        return query, {**values, "at_correlation": correlation}

    def _row(self, saga: str, stored: StoredSaga) -> dict[str, Any]:
        """The parameters that name the saga's row at the revision it was loaded at."""
        return {
            "at_app": self.app,
            "at_saga": saga,
            "at_correlation": stored.correlation,
            "at_id": stored.id,
            "at_revision": stored.revision,
        }

    async def _one_row(
        self,
        context: MessageContext,
        statement: Any,
        values: dict[str, Any],
        saga: str,
        stored: StoredSaga,
    ) -> None:
        result = await _raced(self.executor_of(context).execute(statement, values))
        if cast(CursorResult[Any], result).rowcount != 1:
            raise ConcurrencyConflict(
                f"saga {saga} {stored.correlation!r} changed since it was loaded at revision "
                f"{stored.revision}"
            )


@dataclass(frozen=True)
class _Statements:
    """The saga table's statements, built once: each run binds its values."""

    by_correlation: Select[Any]
    by_correlation_locked: Select[Any]
    by_id: Select[Any]
    by_id_locked: Select[Any]
    insert: Insert
    update: Update
    delete: Delete

    @classmethod
    def of(cls, table: Table) -> _Statements:
        """The statements on `table`."""
        c = table.c
        columns = (c.id, c.correlation, c.revision, c.data)
        of_saga = (c.app == bindparam("at_app"), c.saga == bindparam("at_saga"))
        by_correlation = select(*columns).where(
            *of_saga, c.correlation == bindparam("at_correlation")
        )
        by_id = select(*columns).where(*of_saga, c.id == bindparam("at_id"))
        row = (
            *of_saga,
            c.correlation == bindparam("at_correlation"),
            c.id == bindparam("at_id"),
            c.revision == bindparam("at_revision"),
        )
        return cls(
            by_correlation,
            by_correlation.with_for_update(),
            by_id,
            by_id.with_for_update(),
            insert(table),
            update(table)
            .where(*row)
            .values(
                revision=bindparam("next_revision"),
                data=bindparam("next_data"),
                updated_at=func.now(),
            ),
            delete(table).where(*row),
        )


def _executor_of(transaction: Transaction | None) -> AsyncSession | AsyncConnection | None:
    """The session or connection an open transaction writes through, unless it is ending."""
    if transaction is None or not transaction.open:
        return None
    executor = transaction.session
    if isinstance(executor, AsyncSession) and not executor.info.get(ENDING):
        return executor
    return executor if isinstance(executor, AsyncConnection) else None


_TURNS: weakref.WeakKeyDictionary[object, asyncio.Lock] = weakref.WeakKeyDictionary()
"""Per session or connection: the lock its saga reads take turns with."""


def _turns(executor: AsyncSession | AsyncConnection) -> asyncio.Lock:
    """The lock that reads through `executor` take turns with (one statement at a time)."""
    lock = _TURNS.get(executor)
    if lock is None:
        lock = _TURNS[executor] = asyncio.Lock()
    return lock


async def _raced(work: Awaitable[T]) -> T:
    """`work`, with PostgreSQL's lost races (deadlock, serialization) as conflicts."""
    try:
        return await work
    except DBAPIError as error:
        if getattr(error.orig, "sqlstate", None) in LOST_RACE:
            raise ConcurrencyConflict(f"lost a race for a saga's row: {error.orig}") from None
        raise


def as_text(data: bytes) -> str:
    """Encoded saga data as the text column holds it: UTF-8 as it is, other bytes in base64."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        text = BINARY
    if text.startswith(BINARY):
        return BINARY + base64.b64encode(data).decode()
    return text


def as_bytes(text: str) -> bytes:
    """The encoded saga data a text column holds (see `as_text`)."""
    if text.startswith(BINARY):
        return base64.b64decode(text[len(BINARY) :])
    return text.encode()


def _stored(row: Any) -> StoredSaga | None:
    if row is None:
        return None
    return StoredSaga(row.id, row.correlation, row.revision, as_bytes(row.data))
