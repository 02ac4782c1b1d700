"""The fixtures every suite shares: brokers, vhosts and databases of a test's own, transports.

A memory broker, a RabbitMQ vhost (the session's, or one of the test's own) and a database (a
PostgreSQL database or a SQLite file) are each private to the test that asks for them, so that
tests running side by side never meet, and each is removed afterwards.
"""

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest

from mersal.transport import Transport
from mersal.transport.memory import MemoryTransport
from mersal_rabbitmq import RabbitMQTransport
from tests.support import (
    BACKENDS,
    RABBITMQ_HOST,
    Broker,
    add_vhost,
    delete_vhost,
    postgres_database,
    private_vhost,
    sqlite_file,
)

NewTransport = Callable[[], Transport]
MakeTransport = Callable[[], Awaitable[Transport]]


@pytest.fixture(scope="session")
def vhost() -> Iterator[str]:
    """A RabbitMQ vhost of this test session's own, with guest allowed everything."""
    name = f"mersal-test-{uuid4().hex[:8]}"
    add_vhost(name)
    try:
        yield name
    finally:
        delete_vhost(name)


@pytest.fixture
def amqp_url(vhost: str) -> str:
    """The AMQP URL of the session's RabbitMQ vhost."""
    return f"amqp://guest:guest@{RABBITMQ_HOST}/{vhost}"


@pytest.fixture
async def broker(amqp_url: str) -> AsyncIterator[Broker]:
    """The test's own connection to the session vhost; what it watched or declared goes after."""
    async with Broker.open(amqp_url) as helper:
        yield helper


@pytest.fixture
def prefix() -> str:
    """A prefix that makes this test's app (queue) names unique on the shared vhost."""
    return f"t{uuid4().hex[:10]}"


@pytest.fixture
def own_vhost(request: pytest.FixtureRequest) -> Iterator[str]:
    """The AMQP URL of a RabbitMQ vhost of this test's own, deleted afterwards."""
    with private_vhost(f"mersal-{request.node.module.__name__.rpartition('.')[2]}") as url:
        yield url


@pytest.fixture
def memory_url() -> str:
    """A memory transport URL whose broker no other test shares."""
    return f"memory://test-{uuid4().hex}"


@pytest.fixture
async def postgres_url() -> AsyncIterator[str]:
    """A migrated PostgreSQL database of this test's own, dropped afterwards."""
    async with postgres_database(migrate=True) as url:
        yield url


@pytest.fixture
async def empty_postgres_url() -> AsyncIterator[str]:
    """An empty PostgreSQL database of this test's own, dropped afterwards."""
    async with postgres_database(migrate=False) as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A SQLite file of this test's own (an app creates its tables at start)."""
    return sqlite_file(tmp_path)


@asynccontextmanager
async def a_database(backend: str, directory: Path, *, tables: str) -> AsyncIterator[str]:
    """A database of one test's own on `backend`, with our tables as `tables` says: "none",
    "upgraded" (by `mersal db upgrade`), or "app" (PostgreSQL upgraded; a SQLite file left for
    the app to create them at start)."""
    if backend == "sqlite":
        url = sqlite_file(directory)
        if tables == "upgraded":
            from mersal_sqlalchemy.cli import upgrade

            await asyncio.to_thread(upgrade, url)
        yield url
        return
    async with postgres_database(migrate=tables != "none") as url:
        yield url


@pytest.fixture(params=BACKENDS)
async def database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A database an app can use: a SQLite file (the app creates its tables), or a migrated
    PostgreSQL database."""
    async with a_database(request.param, tmp_path, tables="app") as url:
        yield url


@pytest.fixture(params=BACKENDS)
async def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A database without our tables: an empty PostgreSQL database, or a new SQLite file."""
    async with a_database(request.param, tmp_path, tables="none") as url:
        yield url


@pytest.fixture(params=BACKENDS)
async def migrated_database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A database with our tables made by `mersal db upgrade`: a SQLite file or PostgreSQL."""
    async with a_database(request.param, tmp_path, tables="upgraded") as url:
        yield url


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


@asynccontextmanager
async def amqp10_namespace(request: pytest.FixtureRequest) -> AsyncIterator[NewTransport]:
    """Unstarted AMQP 1.0 transports on the session's vhost (tests use unique queue names)."""
    amqp10 = pytest.importorskip("mersal_amqp10", reason="the amqp10 extra is not installed")
    url = f"amqp10://guest:guest@{RABBITMQ_HOST}/{request.getfixturevalue('vhost')}"
    yield lambda: amqp10.Amqp10Transport(url)


NAMESPACES: dict[
    str, Callable[[pytest.FixtureRequest], AbstractAsyncContextManager[NewTransport]]
] = {
    "amqp10": amqp10_namespace,
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


LEDGER = "chaos ledger"
"""The name under which a test's report carries its scenarios' ledger lines."""
ledger_lines: list[str] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    """Carry ledger lines in the report, and captured text that xdist can send (no surrogates)."""
    report = yield
    from tests.chaos.ledger import LEDGER_LINES  # imported late: it needs asyncpg

    while LEDGER_LINES:
        report.user_properties.append((LEDGER, LEDGER_LINES.pop(0)))
    report.sections = [(name, _sendable(text)) for name, text in report.sections]
    return report


def _sendable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Collect the ledger lines of each test, from this process or an xdist worker."""
    ledger_lines.extend(value for name, value in report.user_properties if name == LEDGER)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The ledger line of each chaos or cluster scenario that got as far as counting."""
    if ledger_lines:
        terminalreporter.section(LEDGER)
        for line in ledger_lines:
            terminalreporter.write_line(line)
