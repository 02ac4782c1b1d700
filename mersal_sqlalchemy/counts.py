"""The outbox and inbox counted, for `mersal status` and the relay's backlog: read-only queries."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from sqlalchemy import Table, func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from mersal.errors import ConfigurationError, MersalError
from mersal.inspection import AppRows, StorageStatus
from mersal.urls import mask
from mersal_sqlalchemy.engines import reason, seconds_since
from mersal_sqlalchemy.schema import read_schema, upgrade_command
from mersal_sqlalchemy.tables import Tables


async def storage_status(
    engine: AsyncEngine, tables: Tables, database: str, app: str | None
) -> StorageStatus:
    """Pending and parked outbox rows, the oldest pending one's age, inbox rows: `app`'s or all.

    A ConfigurationError naming the fix (`mersal db upgrade`) when the tables are missing or
    behind; a MersalError (password masked) when the database cannot be reached. Nothing is
    created.
    """
    url = engine.url
    sqlite_file = Path(url.database or "")
    if url.get_backend_name() == "sqlite" and not await asyncio.to_thread(sqlite_file.is_file):
        raise ConfigurationError(
            f"there is no SQLite database at {mask(database)}: check the URL, or create it with "
            f"`{upgrade_command(database, tables)}`"
        )
    try:
        async with engine.connect() as connection:
            schema = await connection.run_sync(read_schema, tables)
            problem = schema.explain(database, tables)
            if problem is not None:
                raise ConfigurationError(problem)
            outbox = (await connection.execute(outbox_counts(engine, tables.outbox, app))).one()
            by_app = (await connection.execute(counts_by_app(engine, tables.outbox))).all()
            inbox = (await connection.execute(row_count(tables.inbox, app))).scalar_one()
            failures = None
            if tables.dead_letters.name not in schema.missing_tables:
                counted = await connection.execute(failure_count(tables.dead_letters, app))
                failures = int(counted.scalar_one())
    except (SQLAlchemyError, OSError) as error:
        raise MersalError(
            f"cannot look at the database {mask(database)}: {reason(error, url)}"
        ) from None
    apps = tuple(
        AppRows(str(row.app), int(row.pending), int(row.parked), _age(row.age)) for row in by_app
    )
    return StorageStatus(
        int(outbox.pending),
        int(outbox.parked),
        _age(outbox.age),
        int(inbox),
        app,
        apps,
        failures,
    )


def _age(seconds: Any) -> float | None:
    return None if seconds is None else max(0.0, float(seconds))


def outbox_counts(engine: AsyncEngine, table: Table, app: str | None) -> Any:
    """One row: `pending`, `parked` and `age` (seconds) of the oldest pending row, or NULL."""
    query = select(*_counts(engine, table)).select_from(table)
    return query.where(table.c.app == app) if app is not None else query


def counts_by_app(engine: AsyncEngine, table: Table) -> Any:
    """`outbox_counts` of each app with rows in the outbox (`app` column), by app name."""
    return select(table.c.app, *_counts(engine, table)).group_by(table.c.app).order_by(table.c.app)


def _counts(engine: AsyncEngine, table: Table) -> tuple[Any, ...]:
    """The outbox's `pending` and `parked` row counts, and the `age` of its oldest pending row."""
    waiting = table.c.parked_at.is_(None)
    return (
        func.count().filter(waiting).label("pending"),
        func.count().filter(table.c.parked_at.is_not(None)).label("parked"),
        seconds_since(engine, func.min(table.c.created_at).filter(waiting)).label("age"),
    )


def row_count(table: Table, app: str | None) -> Any:
    """How many rows `table` holds (of `app`, if given)."""
    query = select(func.count()).select_from(table)
    return query.where(table.c.app == app) if app is not None else query


def failure_count(table: Table, app: str | None) -> Any:
    """How many failed messages the dead-letter table holds (of `app`), tombstones left out."""
    return row_count(table, app).where(table.c.resolved_at.is_(None))
