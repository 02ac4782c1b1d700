"""Fixtures for the telemetry tests: in-memory providers, a database, a RabbitMQ vhost."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import pytest

from mersal import App
from mersal_rabbitmq import RabbitMQTransport
from tests.mersal.telemetry.support import Recorder
from tests.support import RABBITMQ_HOST


@pytest.fixture
def otel() -> Iterator[Recorder]:
    """Providers recording in memory, shut down after the test."""
    recorder = Recorder()
    yield recorder
    recorder.shutdown()


@dataclass
class RabbitMQ:
    """Apps on the session's vhost; the queues they declare are deleted after the test."""

    url: str
    transports: list[RabbitMQTransport] = field(default_factory=list)

    def app(self, name: str, **options: Any) -> App:
        """An app on this vhost."""
        app = App(name, transport=self.url, **options)
        assert isinstance(app.transport, RabbitMQTransport)
        self.transports.append(app.transport)
        return app

    async def clean(self) -> None:
        """Delete every queue the apps declared."""
        names = {name for transport in self.transports for name in transport.queues}
        async with await aio_pika.connect(self.url) as connection:
            channel = await connection.channel()
            for name in names:
                await channel.queue_delete(name)


@pytest.fixture
async def rabbitmq(vhost: str) -> AsyncIterator[RabbitMQ]:
    """Apps on the session's RabbitMQ vhost, their queues deleted afterwards."""
    broker = RabbitMQ(f"amqp://guest:guest@{RABBITMQ_HOST}/{vhost}")
    yield broker
    await broker.clean()
