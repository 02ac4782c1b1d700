"""Fixtures of the SQL storage tests: a raw RabbitMQ connection that watches what an app sends."""

from collections.abc import AsyncIterator

import aio_pika
import pytest

from tests.mersal_rabbitmq.support import Broker
from tests.mersal_sqlalchemy.support import Raw


@pytest.fixture
async def raw(amqp_url: str) -> AsyncIterator[Raw]:
    """The test's raw connection; the queues it knows of are deleted afterwards."""
    connection = await aio_pika.connect(amqp_url)
    helper = Raw(amqp_url, connection, await connection.channel())
    try:
        yield helper
    finally:
        for app in helper.apps:
            await app.stop()
        await connection.close()
        async with await aio_pika.connect(amqp_url) as cleanup:
            await Broker(cleanup, await cleanup.channel()).delete(sorted(helper.leftovers()))
