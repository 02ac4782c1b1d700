"""Fixtures for the SQL outbox tests: a fresh PostgreSQL database per test, or a SQLite file.

PostgreSQL is reached through `MERSAL_TEST_POSTGRES` (default: the `postgres` database on
127.0.0.1 as user `postgres`); each test gets a database `mersal_test_<uuid>` of its own, dropped
afterwards. Tests that need PostgreSQL are marked `integration` and skipped when it is down.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from uuid import uuid4

import asyncpg  # type: ignore[import-untyped]
import pytest
from sqlalchemy.engine import make_url

from mersal_sqlalchemy.cli import upgrade

ADMIN_URL = os.environ.get("MERSAL_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")

BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)]


@asynccontextmanager
async def postgres_database(migrate: bool) -> AsyncIterator[str]:
    """A new PostgreSQL database (migrated or empty) for one test, dropped afterwards."""
    name = f"mersal_test_{uuid4().hex}"
    try:
        admin = await asyncpg.connect(ADMIN_URL, timeout=5)
    except (OSError, asyncpg.PostgresError) as error:
        pytest.skip(f"PostgreSQL is not available at {ADMIN_URL}: {error}")
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    url = make_url(ADMIN_URL).set(drivername="postgresql+asyncpg", database=name)
    rendered = url.render_as_string(hide_password=False)
    try:
        if migrate:
            await asyncio.to_thread(upgrade, rendered)
        yield rendered
    finally:
        admin = await asyncpg.connect(ADMIN_URL, timeout=5)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


def sqlite_file(directory: Path) -> str:
    """The URL of a SQLite file in `directory` (not created yet)."""
    return f"sqlite+aiosqlite:///{directory / 'app.db'}"


@pytest.fixture(params=BACKENDS)
async def database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A database the app can use: a migrated PostgreSQL one, or a SQLite file (embedded)."""
    if request.param == "sqlite":
        yield sqlite_file(tmp_path)
        return
    async with postgres_database(migrate=True) as url:
        yield url


@pytest.fixture(params=BACKENDS)
async def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A database without our tables: an empty PostgreSQL database, or a new SQLite file."""
    if request.param == "sqlite":
        yield sqlite_file(tmp_path)
        return
    async with postgres_database(migrate=False) as url:
        yield url


@pytest.fixture
async def postgres_url() -> AsyncIterator[str]:
    """A migrated PostgreSQL database of this test's own."""
    async with postgres_database(migrate=True) as url:
        yield url


@pytest.fixture
async def empty_postgres_url() -> AsyncIterator[str]:
    """An empty PostgreSQL database of this test's own."""
    async with postgres_database(migrate=False) as url:
        yield url


@pytest.fixture
def memory_url() -> str:
    """A memory transport URL whose broker no other test shares."""
    return f"memory://sql-{uuid4().hex}"
