"""Databases as the release before per-pair version tables migrated them (the files in data/)."""

from __future__ import annotations

from pathlib import Path

import asyncpg  # type: ignore[import-untyped]
from sqlalchemy.engine import make_url

DATA = Path(__file__).parent / "data"


async def migrate_as_before(database: str, name: str) -> None:
    """Run `data/legacy_<name>.sql` (what that release's `mersal db upgrade` ran) on PostgreSQL."""
    url = make_url(database).set(drivername="postgresql").render_as_string(hide_password=False)
    connection = await asyncpg.connect(url, timeout=5)
    try:
        await connection.execute((DATA / f"legacy_{name}.sql").read_text())
    finally:
        await connection.close()
