"""The Alembic environment for Mersal's outbox and inbox tables.

The database URL comes from `-x database=...`, then `MERSAL_DATABASE`, then `sqlalchemy.url`;
table names from `-x outbox_table=...` and `-x inbox_table=...`. Each set of tables records its
migrations in a version table of its own (`<outbox>_alembic_version`), so that these
migrations never meet the revisions of your own Alembic project in `alembic_version`.
"""

from __future__ import annotations

import asyncio
import logging.config
import os

from alembic import context
from sqlalchemy import Connection, pool
from sqlalchemy.ext.asyncio import create_async_engine

from mersal.errors import ConfigurationError
from mersal_sqlalchemy.database import database_url
from mersal_sqlalchemy.tables import migration_table_names, version_table_name

config = context.config
if config.config_file_name is not None and config.get_section("loggers") is not None:
    logging.config.fileConfig(config.config_file_name, disable_existing_loggers=False)

arguments = context.get_x_argument(as_dictionary=True)
outbox, _inbox = migration_table_names(arguments)
version_table = version_table_name(outbox)


def database() -> str:
    """The URL of the database to migrate."""
    url = (
        arguments.get("database")
        or os.environ.get("MERSAL_DATABASE")
        or config.get_main_option("sqlalchemy.url")
    )
    if not url:
        raise ConfigurationError(
            "no database to migrate: pass -x database=URL or set MERSAL_DATABASE"
        )
    return url


def run_offline() -> None:
    """Print the SQL instead of running it (`alembic upgrade head --sql`)."""
    context.configure(
        url=database_url(database()),
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
        context.run_migrations()


async def run_online() -> None:
    """Connect with the async driver and run the migrations."""
    engine = create_async_engine(database_url(database()), poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(run_on)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    asyncio.run(run_online())
