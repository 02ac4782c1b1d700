"""Engines for the supported database URLs: drivers, dialects, SQLite tuned for concurrent writers.

Also the SQL that differs by dialect (the database's clock, a column among a subquery's values)
and a driver's error in its own words.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sqlite3
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, Select, any_, event, func
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import AsyncAdaptedQueuePool, ConnectionPoolEntry
from sqlalchemy.sql.elements import ColumnElement

from mersal.errors import ConfigurationError
from mersal.timeouts import not_counted
from mersal.urls import mask

CANNOT_CONNECT_NOW = "57P03"
"""PostgreSQL's SQLSTATE for a server that is starting up or shutting down."""

DRIVERS = {
    "postgresql": "postgresql+asyncpg",
    "postgres": "postgresql+asyncpg",
    "postgresql+asyncpg": "postgresql+asyncpg",
    "sqlite": "sqlite+aiosqlite",
    "sqlite+aiosqlite": "sqlite+aiosqlite",
}
"""The async driver Mersal uses for each driver name a URL may give."""

DIALECTS = ("postgresql", "sqlite")
"""The SQL dialects Mersal supports."""

ENDING = "mersal.ending"
"""Set in a message session's `info` once it is ending: nothing more goes through it."""
SQLITE_BUSY_TIMEOUT_MS = 30_000
"""How long a SQLite writer waits for the write lock before it gives up."""
SQLITE_MIN_VERSION = (3, 35, 0)
"""The oldest SQLite the outbox runs on (UPDATE ... RETURNING)."""


def database_url(database: str) -> URL:
    """The SQLAlchemy URL for `database`, with the async driver we support for its backend."""
    url = supported_url(database)
    if url.get_backend_name() == "sqlite":
        if url.database in (None, "", ":memory:"):
            raise ConfigurationError(
                f"database {mask(database)!r} is an in-memory SQLite database, where every "
                "connection sees a database of its own: use a file, 'sqlite+aiosqlite:///app.db'"
            )
        if sqlite3.sqlite_version_info < SQLITE_MIN_VERSION:
            raise ConfigurationError(
                f"SQLite {sqlite3.sqlite_version} is too old for the outbox: it needs 3.35 or later"
            )
    return url


def supported_url(database: str) -> URL:
    """`database` parsed, with our async driver for its backend; a ConfigurationError if none."""
    try:
        url = make_url(database)
    except ArgumentError:
        raise ConfigurationError(
            f"database {mask(database)!r} is not a database URL: use "
            "'postgresql+asyncpg://user:password@host/name' or 'sqlite+aiosqlite:///file.db'"
        ) from None
    driver = DRIVERS.get(url.drivername)
    if driver is None:
        raise ConfigurationError(
            f"database {mask(database)!r} uses {url.drivername!r}, which Mersal does not support: "
            "use 'postgresql+asyncpg://...' or 'sqlite+aiosqlite:///file.db'"
        )
    return url.set(drivername=driver)


def dialect_of(database: str) -> str:
    """The dialect, 'postgresql' or 'sqlite', of a database URL or a dialect's own name."""
    if "://" in database:
        return supported_url(database).get_backend_name()
    driver = DRIVERS.get(database)
    if driver is None:
        raise ConfigurationError(
            f"dialect {database!r} is not one Mersal supports: use postgresql or sqlite"
        )
    return driver.partition("+")[0]


def reason(error: BaseException, database: str | URL | None = None) -> str:
    """The driver's own words for `error` (not SQLAlchemy's additions), the password masked."""
    if isinstance(error, DBAPIError) and error.orig is not None:
        error = error.orig
    text = f"{type(error).__name__}: {error}".strip()
    password = _password(database)
    return text.replace(password, "***") if password else text


def _password(database: str | URL | None) -> str | None:
    if isinstance(database, str):
        try:
            database = make_url(database)
        except ArgumentError:
            return None
    return str(database.password) if database is not None and database.password else None


# SQLAlchemy names a pool's logger after its class, so ours would log its INFO lines ("Pool
# disposed. Pool size: 35 ...") wherever `mersal*` is at INFO: keep them at SQLAlchemy's level.
logging.getLogger(f"{__name__}.HandlerPool").setLevel(logging.WARNING)


class HandlerPool(AsyncAdaptedQueuePool):
    """SQLAlchemy's asyncio queue pool; a handler's wait for a connection is not counted
    against its `handler_timeout` (on SQLite every message waits for the one connection)."""

    def _do_get(self) -> ConnectionPoolEntry:  # the pool's one hook for handing a connection out
        with not_counted():
            return super()._do_get()


def make_engine(database: str | URL, **options: Any) -> AsyncEngine:
    """An async engine for `database`; on SQLite, tuned for concurrent writers (WAL, IMMEDIATE).

    `options` go to `sqlalchemy.ext.asyncio.create_async_engine` (pool_size, echo, ...).
    """
    url = database if isinstance(database, URL) else database_url(database)
    engine = create_async_engine(url, **{"poolclass": HandlerPool, **options})
    if is_sqlite(engine):
        tune_sqlite(engine)
    return engine


def one_of(
    column: ColumnElement[Any], chosen: Select[Any], engine: AsyncEngine
) -> ColumnElement[bool]:
    """`column` among the values `chosen` selects, as the engine's planner takes it best.

    On PostgreSQL `column = ANY(ARRAY(...))`: the rows are then reached through `column`'s
    index; `column IN (...)` makes it hash-join them against a scan of the whole table.
    """
    if is_postgresql(engine):
        return column == any_(func.array(chosen.scalar_subquery()))
    return column.in_(chosen.scalar_subquery())


def is_postgresql(engine: AsyncEngine) -> bool:
    """Whether the engine talks to PostgreSQL."""
    return engine.dialect.name == "postgresql"


def autocommits(engine: AsyncEngine) -> bool:
    """Whether the engine was made or set to run each statement in a transaction of its own."""
    on_connect = "_on_connect_isolation_level"  # where create_async_engine(isolation_level=) goes
    levels = (
        engine.get_execution_options().get("isolation_level"),
        getattr(engine.dialect, on_connect, None),
    )
    return "AUTOCOMMIT" in levels


def is_sqlite(engine: AsyncEngine) -> bool:
    """Whether the engine talks to SQLite."""
    return engine.dialect.name == "sqlite"


class RollbackOnClose(sqlite3.Connection):
    """A SQLite connection that ends its transaction when closed, whoever still holds a cursor.

    Since Python 3.11 closing a connection whose cursor still holds a statement (as the
    traceback of a cancelled query does) leaves it open as a zombie until that cursor is
    freed, and a zombie keeps its write lock: every other writer would wait on it.
    """

    def close(self) -> None:
        """Roll back what is open, then close."""
        with contextlib.suppress(sqlite3.Error):  # then closing ends it, as it can
            self.rollback()
        super().close()


@functools.cache
def rolling_back(factory: Any) -> Any:
    """RollbackOnClose, or the user's own connection class (connect_args) with it mixed in."""
    if factory is None:
        return RollbackOnClose
    if not isinstance(factory, type) or issubclass(factory, RollbackOnClose):
        return factory  # sqlite3 refuses what is not a Connection class, as it would anyway
    return type(factory.__name__, (RollbackOnClose, factory), {})


def tune_sqlite(engine: AsyncEngine) -> None:
    """WAL, a busy timeout, and BEGIN IMMEDIATE, so that concurrent writers wait their turn.

    A transaction that reads before it writes would otherwise fail with "database is locked"
    when another one holds the write lock; taking the write lock at BEGIN makes it wait.
    Connections roll back when closed (RollbackOnClose), so that one invalidated by a
    cancellation does not keep the write lock.
    """
    sync_engine = engine.sync_engine

    @event.listens_for(sync_engine, "do_connect")
    def do_connect(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> None:
        cparams["factory"] = rolling_back(cparams.get("factory"))

    @event.listens_for(sync_engine, "connect")
    def connect(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None  # sqlite3 no longer emits BEGIN itself
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        finally:
            cursor.close()

    @event.listens_for(sync_engine, "begin")
    def begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def sql_time(engine: AsyncEngine, seconds: float = 0.0) -> ColumnElement[Any]:
    """The database's current time plus `seconds`, as an SQL expression."""
    if is_postgresql(engine):
        return func.now() + timedelta(seconds=seconds) if seconds else func.now()
    # SQLite keeps times as 'YYYY-MM-DD HH:MM:SS' text, the format of CURRENT_TIMESTAMP.
    return func.datetime("now", f"{seconds:+.3f} seconds")


def seconds_since(engine: AsyncEngine, moment: ColumnElement[Any]) -> ColumnElement[Any]:
    """The seconds from `moment` to the database's now, as an SQL expression."""
    if is_postgresql(engine):
        return func.extract("epoch", func.now() - moment)
    # SQLite keeps times as 'YYYY-MM-DD HH:MM:SS' text in UTC, which julianday() reads.
    return (func.julianday("now") - func.julianday(moment)) * 86_400.0
