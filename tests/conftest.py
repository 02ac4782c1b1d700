"""Shared fixtures: transports of every kind the contract suite runs against."""

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from uuid import uuid4

import pytest

from mersal.transport import Transport
from mersal.transport.memory import MemoryTransport

NewTransport = Callable[[], Transport]
MakeTransport = Callable[[], Awaitable[Transport]]


def unique(prefix: str) -> str:
    """A queue (or topic) name no other test uses."""
    return f"{prefix}-{uuid4().hex[:12]}"


@asynccontextmanager
async def memory_namespace() -> AsyncIterator[NewTransport]:
    """Unstarted memory transports that all talk to one broker private to this test."""
    url = f"memory://contract-{uuid4().hex}"
    yield lambda: MemoryTransport(url)


# One entry per transport kind; RabbitMQ adds `"rabbitmq": rabbitmq_namespace` here.
NAMESPACES: dict[str, Callable[[], AbstractAsyncContextManager[NewTransport]]] = {
    "memory": memory_namespace,
}


@pytest.fixture(params=sorted(NAMESPACES))
async def transport_factory(request: pytest.FixtureRequest) -> AsyncIterator[MakeTransport]:
    """`await make()` gives a new started transport on this test's broker namespace."""
    made: list[Transport] = []
    async with NAMESPACES[request.param]() as new:

        async def make() -> Transport:
            transport = new()
            await transport.start()
            made.append(transport)
            return transport

        try:
            yield make
        finally:
            for transport in reversed(made):
                await transport.stop()


@pytest.fixture
async def transport(transport_factory: MakeTransport) -> Transport:
    """One started transport from the factory."""
    return await transport_factory()
