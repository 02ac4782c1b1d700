"""Shared fixtures: transports of every kind the contract suite runs against."""

import os
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from uuid import uuid4

import pytest

from mersal.transport import Transport
from mersal.transport.memory import MemoryTransport
from mersal_rabbitmq import RabbitMQTransport
from tests.support import rabbitmqctl

RABBITMQ_HOST = os.environ.get("MERSAL_TEST_RABBITMQ_HOST", "127.0.0.1")

NewTransport = Callable[[], Transport]
MakeTransport = Callable[[], Awaitable[Transport]]


def unique(prefix: str) -> str:
    """A queue (or topic) name no other test uses."""
    return f"{prefix}-{uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def vhost() -> Iterator[str]:
    """A RabbitMQ vhost of this test session's own, with guest allowed everything."""
    name = f"mersal-test-{uuid4().hex[:8]}"
    try:
        rabbitmqctl("add_vhost", name)
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        pytest.skip(f"RabbitMQ is not available here: {error}")
    try:
        rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        yield name
    finally:
        rabbitmqctl("delete_vhost", name)


@asynccontextmanager
async def memory_namespace(request: pytest.FixtureRequest) -> AsyncIterator[NewTransport]:
    """Unstarted memory transports that all talk to one broker private to this test."""
    url = f"memory://contract-{uuid4().hex}"
    yield lambda: MemoryTransport(url)


@asynccontextmanager
async def rabbitmq_namespace(request: pytest.FixtureRequest) -> AsyncIterator[NewTransport]:
    """Unstarted RabbitMQ transports on the session's vhost (tests use unique queue names)."""
    url = f"amqp://guest:guest@{RABBITMQ_HOST}/{request.getfixturevalue('vhost')}"
    yield lambda: RabbitMQTransport(url)


NAMESPACES: dict[
    str, Callable[[pytest.FixtureRequest], AbstractAsyncContextManager[NewTransport]]
] = {
    "memory": memory_namespace,
    "rabbitmq": rabbitmq_namespace,
}


@pytest.fixture(params=sorted(NAMESPACES))
async def transport_factory(request: pytest.FixtureRequest) -> AsyncIterator[MakeTransport]:
    """`await make()` gives a new started transport on this test's broker namespace."""
    made: list[Transport] = []
    async with NAMESPACES[request.param](request) as new:

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


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The ledger line of each chaos or cluster scenario that got as far as counting."""
    from tests.chaos.ledger import LEDGER_LINES  # imported late: it needs asyncpg

    if LEDGER_LINES:
        terminalreporter.section("chaos ledger")
        for line in LEDGER_LINES:
            terminalreporter.write_line(line)
