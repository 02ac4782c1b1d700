"""Fixtures for the `mersal` command's tests: the command in process, migrated databases,
RabbitMQ queues looked at from outside.

The outbox tests run on a SQLite file and (marked `integration`) on a PostgreSQL database of
their own, both migrated by `mersal db upgrade`'s code. The RabbitMQ tests use the session's
vhost and delete the queues they name afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import aio_pika
import pytest

from mersal.cli import main


async def mersal(*argv: str) -> int:
    """Run `mersal ARGV` in this process (in a thread: it runs an event loop of its own)."""
    return await asyncio.to_thread(main, list(argv))


@pytest.fixture
def database(migrated_database: str) -> str:
    """The commands' database: made by `mersal db upgrade`, as an operator's is."""
    return migrated_database


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
