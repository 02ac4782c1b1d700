"""Fixtures for the RabbitMQ transport's tests: the session's vhost as `url`, transports.

The tests share the session's vhost (tests/conftest.py), name their queues with their own
`prefix` and delete them afterwards (the `broker` fixture of tests/conftest.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from mersal_rabbitmq import RabbitMQTransport
from tests.support import Broker


@pytest.fixture
def url(amqp_url: str) -> str:
    """The AMQP URL of the session's vhost (`amqp_url`), as these tests call it."""
    return amqp_url


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
