"""Fixtures for the RabbitMQ tests: one vhost per session, unique queue names per test.

A vhost costs three `rabbitmqctl` calls (about 2 s), so the session shares one (deleted at the
end) and each test names its queues with its own prefix and deletes them afterwards.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aio_pika
import pytest
from rabbitmq_support import Broker

from mersal_rabbitmq import RabbitMQTransport
from tests.support import RABBITMQ_HOST


@pytest.fixture
def url(vhost: str) -> str:
    """The AMQP URL of the session's vhost."""
    return f"amqp://guest:guest@{RABBITMQ_HOST}/{vhost}"


@pytest.fixture
def prefix() -> str:
    """A prefix that makes this test's queue and app names unique."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def broker(url: str) -> AsyncIterator[Broker]:
    """A raw connection to the test vhost; queues it declared are deleted afterwards."""
    connection = await aio_pika.connect(url)
    helper = Broker(connection, await connection.channel())
    yield helper
    await connection.close()
    async with await aio_pika.connect(url) as cleanup:  # the test may have closed the first
        await Broker(cleanup, await cleanup.channel()).delete(helper.leftovers())


@pytest.fixture
async def make_transport(
    url: str, broker: Broker
) -> AsyncIterator[Callable[..., RabbitMQTransport]]:
    """Make transports on the test vhost; stopped, and their queues deleted, afterwards."""
    made: list[RabbitMQTransport] = []

    def make(**options: Any) -> RabbitMQTransport:
        transport = RabbitMQTransport(url, **options)
        made.append(transport)
        broker.watch(transport)
        return transport

    yield make
    for transport in made:
        await transport.stop()
