"""The database: engines for the supported URLs, the SQL clock, and the schema check at start."""

from __future__ import annotations

import contextlib
import functools
import sqlite3
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import (
    Connection,
    Select,
    any_,
    column,
    event,
    func,
    insert,
    inspect,
    select,
    table,
)
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.sql.elements import ColumnElement

from mersal.errors import ConfigurationError, MersalError, Unreachable
from mersal.transport import mask
from mersal_sqlalchemy.tables import (
    DEFAULT_INBOX,
    DEFAULT_OUTBOX,
    HEAD_REVISION,
    REVISIONS,
    Tables,
)

CANNOT_CONNECT_NOW = "57P03"
"""PostgreSQL's SQLSTATE for a server that is starting up or shutting down."""

DRIVERS = {
    "postgresql": "postgresql+asyncpg",
    "postgres": "postgresql+asyncpg",
    "postgresql+asyncpg": "postgresql+asyncpg",
    "sqlite": "sqlite+aiosqlite",
    "sqlite+aiosqlite": "sqlite+aiosqlite",
}

SQLITE_BUSY_TIMEOUT_MS = 30_000
SQLITE_MIN_VERSION = (3, 35, 0)  # UPDATE ... RETURNING
SHARED_VERSION_TABLE = "alembic_version"


def database_url(database: str) -> URL:
    """The SQLAlchemy URL for `database`, with the async driver we support for its backend."""
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
    url = url.set(drivername=driver)
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


def make_engine(database: str | URL, **options: Any) -> AsyncEngine:
    """An async engine for `database`; on SQLite, tuned for concurrent writers (WAL, IMMEDIATE).

    `options` go to `sqlalchemy.ext.asyncio.create_async_engine` (pool_size, echo, ...).
    """
    url = database if isinstance(database, URL) else database_url(database)
    engine = create_async_engine(url, **options)
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


def upgrade_command(database: str, tables: Tables) -> str:
    """The command that creates or upgrades the tables (the password masked)."""
    command = f"mersal db upgrade --database '{mask(database)}'"
    if tables.outbox.name != DEFAULT_OUTBOX:
        command += f" --outbox-table {tables.outbox.name}"
    if tables.inbox.name != DEFAULT_INBOX:
        command += f" --inbox-table {tables.inbox.name}"
    return command


@dataclass
class Schema:
    """What the database holds of our tables: which exist, what they lack, their revision."""

    missing_tables: list[str] = field(default_factory=list)
    missing_columns: dict[str, list[str]] = field(default_factory=dict)
    versions: list[str] | None = None
    shared_versions: list[str] | None = None

    def problem(self) -> str | None:
        """Why the app cannot use the tables as they are; None when it can."""
        if self.missing_tables:
            return f"the table(s) {', '.join(self.missing_tables)} do not exist"
        if self.missing_columns:
            name, columns = next(iter(self.missing_columns.items()))
            return f"table {name} has no column(s) {', '.join(columns)}: it is out of date"
        versions = self.versions
        if versions is None:
            versions = [v for v in self.shared_versions or () if v in REVISIONS]
            return _version_problem(versions) if versions else None
        return _version_problem(versions) if versions else "no migration of the tables is recorded"


def _version_problem(versions: list[str]) -> str | None:
    if HEAD_REVISION in versions:
        return None
    known = [v for v in versions if v in REVISIONS]
    if known:
        return f"the tables are at migration {known[0]}, behind {HEAD_REVISION}"
    return (
        f"the tables are at migration {', '.join(versions)}, which this version of "
        f"mersal_sqlalchemy does not know (expected {HEAD_REVISION})"
    )


async def prepare_schema(engine: AsyncEngine, tables: Tables, database: str, create: bool) -> None:
    """Check that the tables exist at our revision, or create them; a ConfigurationError if not.

    A database that does not answer raises `Unreachable`; one that refuses, a `MersalError`.
    """
    try:
        async with engine.begin() as connection:
            schema = await connection.run_sync(read_schema, tables)
            if create and schema.missing_tables:
                await connection.run_sync(create_schema, tables, schema)
                return
    except (OSError, TimeoutError) as error:
        raise Unreachable(
            f"cannot connect to the database at {mask(database)}: {type(error).__name__}: "
            f"{error}; is it running, and are the host and port right?"
        ) from error
    except DBAPIError as error:
        if getattr(error.orig, "sqlstate", None) == CANNOT_CONNECT_NOW:
            raise Unreachable(
                f"the database at {mask(database)} is starting up or shutting down: {error.orig}"
            ) from error
        raise MersalError(
            f"cannot use the database at {mask(database)}: {error.orig}; check the URL, the "
            "database name, the credentials and the user's rights"
        ) from error
    problem = schema.problem()
    if problem is not None:
        raise ConfigurationError(
            f"{problem} in database {mask(database)}: run `{upgrade_command(database, tables)}`"
        )


def read_schema(connection: Connection, tables: Tables) -> Schema:
    """Inspect the database for our tables, their columns and their recorded revision."""
    inspector = inspect(connection)
    existing = set(inspector.get_table_names())
    schema = Schema()
    for wanted in (tables.outbox, tables.inbox):
        if wanted.name not in existing:
            schema.missing_tables.append(wanted.name)
            continue
        present = {found["name"] for found in inspector.get_columns(wanted.name)}
        missing = [c.name for c in wanted.columns if c.name not in present]
        if missing:
            schema.missing_columns[wanted.name] = missing
    if tables.version.name in existing:
        schema.versions = _versions(connection, tables.version.name)
    if SHARED_VERSION_TABLE in existing:
        schema.shared_versions = _versions(connection, SHARED_VERSION_TABLE)
    return schema


def _versions(connection: Connection, name: str) -> list[str]:
    version = table(name, column("version_num"))
    return [str(value) for value in connection.execute(select(version.c.version_num)).scalars()]


def create_schema(connection: Connection, tables: Tables, schema: Schema) -> None:
    """Create the missing tables and record them as migrated to our head revision."""
    tables.metadata.create_all(connection, tables=[tables.outbox, tables.inbox])
    if schema.versions is None:
        tables.version.create(connection)
    if not schema.versions:
        connection.execute(insert(tables.version).values(version_num=HEAD_REVISION))
