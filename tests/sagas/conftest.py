"""Fixtures for the saga tests: RabbitMQ seen from outside, and unique app names.

The databases come from tests/conftest.py (a database per test, dropped afterwards); the
RabbitMQ tests use the session's vhost and delete every queue their apps declared once the
test ends.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import aio_pika
import pytest

from mersal import App
from mersal_rabbitmq import RabbitMQTransport
from tests.support import RABBITMQ_HOST


class Rabbit:
    """A raw connection to the test vhost: count and publish, and delete the apps' queues."""

    def __init__(self, url: str, connection: aio_pika.abc.AbstractConnection) -> None:
        self.url = url
        self.connection = connection
        self.transports: list[RabbitMQTransport] = []

    def watch(self, app: App) -> App:
        """Delete the queues `app` declares (wait queues included) after the test."""
        transport = app.transport
        assert isinstance(transport, RabbitMQTransport)
        self.transports.append(transport)
        return app

    async def count(self, queue: str) -> int:
        """How many messages are ready in `queue` (0 if it does not exist)."""
        channel = await self.connection.channel()
        try:
            declared = await channel.declare_queue(queue, passive=True)
            return int(declared.declaration_result.message_count or 0)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return 0
        finally:
            if not channel.is_closed:
                await channel.close()

    async def publish(self, queue: str, message: aio_pika.Message) -> None:
        """Publish a raw message to `queue` through the default exchange."""
        channel = await self.connection.channel()
        try:
            await channel.default_exchange.publish(message, routing_key=queue)
        finally:
            await channel.close()

    async def cleanup(self) -> None:
        """Delete every queue the watched transports declared."""
        names = {name for transport in self.transports for name in transport.queues}
        channel = await self.connection.channel()
        try:
            for name in sorted(names):
                await channel.queue_delete(name)
        finally:
            await channel.close()


@pytest.fixture
async def rabbit(vhost: str) -> AsyncIterator[Rabbit]:
    """The test vhost's URL and a raw connection; the watched apps' queues go afterwards."""
    url = f"amqp://guest:guest@{RABBITMQ_HOST}/{vhost}"
    connection = await aio_pika.connect(url)
    helper = Rabbit(url, connection)
    try:
        yield helper
    finally:
        try:
            await helper.cleanup()
        finally:
            await connection.close()


@pytest.fixture
def prefix() -> str:
    """A prefix that makes this test's app (queue) names unique on the shared vhost."""
    return f"saga{uuid.uuid4().hex[:10]}"
