"""Fixtures for the `mersal` command's tests: outbox databases, memory brokers, a RabbitMQ vhost.

The outbox tests run on a SQLite file and (marked `integration`) on a PostgreSQL database of
their own, both migrated by `mersal db upgrade`'s code. The RabbitMQ tests use the session's
vhost and delete the queues they name afterwards.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from uuid import uuid4

import aio_pika
import pytest

from mersal.cli import main
from mersal_sqlalchemy.cli import upgrade
from tests.sql.conftest import BACKENDS, postgres_database, sqlite_file

RABBITMQ_HOST = os.environ.get("MERSAL_TEST_RABBITMQ_HOST", "127.0.0.1")


async def mersal(*argv: str) -> int:
    """Run `mersal ARGV` in this process (in a thread: it runs an event loop of its own)."""
    return await asyncio.to_thread(main, list(argv))


@pytest.fixture(params=BACKENDS)
async def database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A migrated database of this test's own: a SQLite file, or a PostgreSQL database."""
    if request.param == "sqlite":
        url = sqlite_file(tmp_path)
        await asyncio.to_thread(upgrade, url)
        yield url
        return
    async with postgres_database(migrate=True) as url:
        yield url


@pytest.fixture
def memory_url() -> str:
    """A memory transport URL whose broker no other test shares."""
    return f"memory://cli-{uuid4().hex}"


@pytest.fixture
def amqp_url(vhost: str) -> str:
    """The AMQP URL of the session's RabbitMQ vhost."""
    return f"amqp://guest:guest@{RABBITMQ_HOST}/{vhost}"


class Queues:
    """The test's view of RabbitMQ queues from outside: counts; deleted after the test."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.names: set[str] = set()

    async def count(self, queue: str) -> int:
        """How many messages are ready in `queue`."""
        async with await aio_pika.connect(self.url) as connection:
            channel = await connection.channel()
            declared = await channel.declare_queue(queue, passive=True)
            return int(declared.declaration_result.message_count or 0)

    async def delete(self, names: Sequence[str]) -> None:
        """Delete the queues (missing ones are fine)."""
        async with await aio_pika.connect(self.url) as connection:
            channel = await connection.channel()
            for name in names:
                await channel.queue_delete(name)


@pytest.fixture
async def queues(amqp_url: str) -> AsyncIterator[Queues]:
    """Count RabbitMQ queues; the names added to `queues.names` are deleted afterwards."""
    helper = Queues(amqp_url)
    yield helper
    await helper.delete(sorted(helper.names))
