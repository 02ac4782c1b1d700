"""Fixtures for the AMQP 1.0 transport's tests: the session's vhost as `url`, transports, apps.

The tests share the session's vhost (tests/conftest.py), name their queues with their own
`prefix`, and look at what the broker holds over 0-9-1 with the `broker` fixture, which deletes
the queues that the transports' 0-9-1 side declared once the test is over.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from mersal import App, RetryPolicy
from mersal_amqp10 import Amqp10Transport
from tests.mersal_amqp10.support import rabbitmq_side
from tests.support import RABBITMQ_HOST, Broker


@pytest.fixture
def url(vhost: str) -> str:
    """The amqp10:// URL of the session's vhost, reconnecting quickly after a loss."""
    return f"amqp10://guest:guest@{RABBITMQ_HOST}/{vhost}?reconnect_interval=0.2"


@pytest.fixture
async def make_transport(url: str, broker: Broker) -> AsyncIterator[Callable[..., Amqp10Transport]]:
    """Make transports on the test vhost; stopped, and their queues deleted, afterwards."""
    made: list[Amqp10Transport] = []

    def make(**options: Any) -> Amqp10Transport:
        transport = Amqp10Transport(url, **options)
        made.append(transport)
        broker.watch(rabbitmq_side(transport))
        return transport

    yield make
    for transport in made:
        await transport.stop()


@pytest.fixture
def make_app(url: str, broker: Broker) -> Callable[..., App]:
    """Make apps on amqp10:// (error queue NAME.error); stopped, their queues deleted, after."""

    def make(name: str, **options: Any) -> App:
        retry = options.pop("retry", None) or RetryPolicy(error_queue=f"{name}.error")
        app = App(name, transport=url, retry=retry, **options)
        assert isinstance(app.transport, Amqp10Transport), app.transport
        broker.apps.append(app)
        broker.watch(rabbitmq_side(app.transport))
        return app

    return make
