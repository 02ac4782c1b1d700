"""The Alembic environment for Mersal's outbox, inbox and saga tables (what `mersal db` runs).

The database URL comes from `-x database=...`, then `MERSAL_DATABASE`, then `sqlalchemy.url`;
table names from `-x outbox_table=...` and `-x inbox_table=...` (the saga table is named after
the inbox). Each pair of tables records its
migrations in a version table of its own (`mersal_sqlalchemy.tables.version_table_name`), so
that these migrations never meet the revisions of your own Alembic project in
`alembic_version`. Offline (`--sql`) only the dialect is needed: `-x dialect=postgresql|sqlite`,
or the URL's. On PostgreSQL each run holds an advisory lock (one for all our migrations) for its
transaction, so that concurrent runs (several init containers) wait for the first one.
"""

from __future__ import annotations

import asyncio
import logging.config
import os

from alembic import context
from sqlalchemy import Connection, pool, text
from sqlalchemy.ext.asyncio import create_async_engine

from mersal.errors import ConfigurationError
from mersal_sqlalchemy.engines import database_url, dialect_of
from mersal_sqlalchemy.migrations import table_names
from mersal_sqlalchemy.tables import migration_lock_key, version_table_name

config = context.config
if config.config_file_name is not None and config.get_section("loggers") is not None:
    logging.config.fileConfig(config.config_file_name, disable_existing_loggers=False)

arguments = context.get_x_argument(as_dictionary=True)
version_table = version_table_name(*table_names())


def database() -> str | None:
    """The URL of the database to migrate, if one is given."""
    return (
        arguments.get("database")
        or os.environ.get("MERSAL_DATABASE")
        or config.get_main_option("sqlalchemy.url")
        or None
    )


def offline_dialect() -> str:
    """The dialect to write SQL for: `-x dialect=...`, else the database URL's."""
    named = arguments.get("dialect") or database()
    if not named:
        raise ConfigurationError(
            "printing the SQL needs a dialect: pass -x dialect=postgresql|sqlite "
            "(mersal db ... --sql --dialect ...), or a database URL, of which only the dialect "
            "is used"
        )
    return dialect_of(named)


def run_offline() -> None:
    """Print the SQL instead of running it (`alembic upgrade head --sql`): no connection."""
    context.configure(
        dialect_name=offline_dialect(),
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        version_table=version_table,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_on(connection: Connection) -> None:
    """Run the migrations on an open connection."""
    context.configure(connection=connection, version_table=version_table)
    with context.begin_transaction():
        lock(connection)
        context.run_migrations()


def lock(connection: Connection) -> None:
    """On PostgreSQL, wait for our other migrations running on the database (until commit)."""
    if connection.dialect.name == "postgresql":
        key = migration_lock_key()
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})


async def run_online() -> None:
    """Connect with the async driver and run the migrations."""
    url = database()
    if not url:
        raise ConfigurationError(
            "no database to migrate: pass -x database=URL or set MERSAL_DATABASE"
        )
    engine = create_async_engine(database_url(url), poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(run_on)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    asyncio.run(run_online())
