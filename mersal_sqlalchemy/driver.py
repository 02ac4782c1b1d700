"""Our fixed statements straight on asyncpg, inside the transaction SQLAlchemy began.

The inbox insert and the outbox insert run once per message. Through SQLAlchemy each costs a
statement compile lookup, an execution context and a result; here each is one prepared
statement (asyncpg caches it per connection) on the connection under the session or
connection the rows belong to, after making sure its transaction has begun: SQLAlchemy's
asyncpg adapter begins it lazily, at the first statement it runs itself.

That needs the adapter's `_transaction`, `_start_transaction` and `_execute_mutex`. Where they
are missing (another SQLAlchemy version, another driver), `on_driver` says so and the callers
take SQLAlchemy's way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

T = TypeVar("T")

Statement = Callable[[Any], Awaitable[T]]
"""A statement to run on an asyncpg connection."""


async def on_driver(executor: AsyncSession | AsyncConnection, statement: Statement[T]) -> T | None:
    """Run `statement` on the asyncpg connection in `executor`'s transaction (begun if need be).

    Returns None without running it when the connection is not an asyncpg one we know how to
    share (SQLite, say); the caller then goes through SQLAlchemy.
    """
    connection = await executor.connection() if isinstance(executor, AsyncSession) else executor
    if connection.dialect.driver != "asyncpg":
        return None
    raw = await connection.get_raw_connection()
    adapted: Any = raw.dbapi_connection
    mutex = getattr(adapted, "_execute_mutex", None)
    if mutex is None or not hasattr(adapted, "_start_transaction"):
        return None
    async with mutex:
        if getattr(adapted, "_transaction", None) is None:
            await adapted._start_transaction()
        return await statement(raw.driver_connection)
