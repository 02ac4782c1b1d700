"""Failover between nodes listed with `;`, against one real node and ports nobody listens on.

The cluster itself is `make cluster-test` (tests/cluster); these run in `make test`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mersal import App, ConfigurationError, MersalError, RetryPolicy
from mersal.errors import Unreachable
from mersal_rabbitmq import RabbitMQTransport, connection
from tests.mersal_rabbitmq.support import rabbitmqctl, relay
from tests.support import Broker, eventually

pytestmark = pytest.mark.integration

DEAD = "amqp://guest:guest@127.0.0.1:5699"
"""A node that does not answer (nothing listens on that port)."""


def vhost_of(url: str) -> str:
    """The path of a test URL: the vhost."""
    return url.rsplit("/", 1)[1]


async def test_the_transport_connects_to_the_first_node_that_answers(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    dead = f"{DEAD}/{vhost_of(url)}"
    transport = RabbitMQTransport(f"{dead};{url}")
    await transport.start()
    try:
        assert transport.node.endswith(url.rpartition("@")[2])
        assert "5699" in caplog.text and "trying the next node" in caplog.text
    finally:
        await transport.stop()


@contextlib.asynccontextmanager
async def silent_node() -> AsyncIterator[int]:
    """A port that takes TCP connections and never sends a byte back."""
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in held:
            writer.close()


async def test_a_silent_node_met_while_reconnecting_is_passed_over(
    url: str, vhost: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mersal.rabbitmq")
    monkeypatch.setattr(connection, "CONNECT_TIMEOUT", 1.0)
    async with silent_node() as port:
        silent = f"amqp://guest:guest@127.0.0.1:{port}/{vhost}"
        transport = RabbitMQTransport(f"{url};{silent};{url}")
        await transport.start()
        try:
            await asyncio.to_thread(rabbitmqctl, "close_all_connections", "-p", vhost, "test")
            await eventually(lambda: f":{port}/" in caplog.text, "trying the silent node")
            await eventually(lambda: transport.connected, "connected again", timeout=15)
            assert transport.node.endswith(url.rpartition("@")[2])
        finally:
            await transport.stop()


async def test_a_node_that_takes_the_connection_and_never_answers_is_passed_over(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connection, "CONNECT_TIMEOUT", 1.0)
    async with silent_node() as port:
        silent = f"amqp://guest:guest@127.0.0.1:{port}/{vhost_of(url)}"
        transport = RabbitMQTransport(f"{silent};{url}")
        try:
            started = asyncio.get_running_loop().time()
            await asyncio.wait_for(transport.start(), 10)
            assert asyncio.get_running_loop().time() - started < 5
            assert transport.node.endswith(url.rpartition("@")[2])
        finally:
            await transport.stop()


async def test_a_silent_node_is_reported_as_not_answering_in_time(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connection, "CONNECT_TIMEOUT", 0.5)
    async with silent_node() as port:
        transport = RabbitMQTransport(f"amqp://guest:guest@127.0.0.1:{port}/{vhost_of(url)}")
        with pytest.raises(Unreachable, match=r"no answer within 0\.5 s") as caught:
            await transport.start()
    assert "TimeoutError" not in str(caught.value)


async def test_with_every_node_down_reconnects_back_off_saying_one_line_a_round(
    url: str, vhost: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="aiormq")
    caplog.set_level(logging.INFO, logger="mersal.rabbitmq")
    monkeypatch.setattr(connection, "MAX_PAUSE", 0.4)
    query = "?reconnect_interval=0.1"
    async with relay(url) as node:
        transport = RabbitMQTransport(f"{node.url(vhost, query)};{DEAD}/{vhost}{query}")
        await transport.start()
        try:
            caplog.clear()
            await node.die()

            def rounds() -> list[logging.LogRecord]:
                return [r for r in caplog.records if "RabbitMQ nodes failed" in r.getMessage()]

            await eventually(lambda: len(rounds()) >= 5, "five rounds", timeout=10)
            await node.start()
            await eventually(lambda: transport.connected, "connected again", timeout=10)
        finally:
            await transport.stop()
    failed = rounds()
    pauses = [float(r.getMessage().rsplit("next round in ", 1)[1].split()[0]) for r in failed]
    assert pauses[:5] == [0.1, 0.2, 0.4, 0.4, 0.4]
    gaps = [later.created - earlier.created for earlier, later in itertools.pairwise(failed)]
    assert all(gap >= pause * 0.9 for gap, pause in zip(gaps, pauses, strict=False))
    assert all(r.levelno == logging.WARNING for r in failed)
    assert ":5699" in failed[0].getMessage() and f":{node.port}/" in failed[0].getMessage()
    said = [
        r
        for r in caplog.records
        if r.levelno >= logging.INFO and r.name.startswith(("mersal", "aiormq", "aio_pika"))
    ]
    lost = next(n for n, r in enumerate(said) if "lost the connection" in r.getMessage())
    assert said[lost + 1 : said.index(failed[-1]) + 1] == failed  # nothing else: no client line
    lines = [r.getMessage() for r in said]
    assert not any("trying the next node" in line for line in lines)
    assert "reconnected to RabbitMQ" in caplog.text


async def test_no_node_answering_is_unreachable_naming_each(url: str) -> None:
    vhost = vhost_of(url)
    transport = RabbitMQTransport(f"{DEAD}/{vhost};amqp://guest:guest@127.0.0.1:5698/{vhost}")
    with pytest.raises(Unreachable, match="any of 2 RabbitMQ nodes") as caught:
        await transport.start()
    assert "5699" in str(caught.value) and "5698" in str(caught.value)


async def test_a_node_refusing_the_login_is_a_configuration_error_even_after_a_dead_one(
    url: str,
) -> None:
    wrong = url.replace("guest:guest@", "guest:wrong@")
    transport = RabbitMQTransport(f"{DEAD}/{vhost_of(url)};{wrong}")
    with pytest.raises(ConfigurationError, match="refused the login") as caught:
        await transport.start()
    assert "wrong" not in str(caught.value)


async def test_a_lost_connection_moves_to_the_next_node_and_the_app_goes_on(
    url: str, vhost: str, broker: Broker, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mersal.rabbitmq")
    # node 0 and node 2 are the one real node: after it drops, the next try is the dead one
    app = App(
        f"{prefix}.orders",
        transport=f"{url};{DEAD}/{vhost};{url}",
        retry=RetryPolicy(error_queue=f"{prefix}.orders.error"),
    )
    broker.watch(app)
    got: list[int] = []

    async def handle(number: Number) -> None:
        got.append(number.n)

    app.register(Number, handle)
    app.route(Number, app.name)
    async with app:
        await app.send(Number(1))
        await eventually(lambda: got == [1], "the first handled")
        await asyncio.to_thread(rabbitmqctl, "close_all_connections", "-p", vhost, "test")
        await eventually(
            lambda: "reconnected to RabbitMQ" in caplog.text, "reconnected", timeout=20
        )
        for _ in range(100):
            try:
                await app.send(Number(2))
                break
            except MersalError:  # outcome unknown while it switches: send again
                await asyncio.sleep(0.1)
        await eventually(lambda: got == [1, 2], "the second handled after the switch", timeout=20)
    assert "passed over amqp://guest:***@127.0.0.1:5699" in caplog.text


@dataclass
class Number:
    """A message with a number."""

    n: int


def test_failover_reconnects_through_no_private_name_of_aio_pika() -> None:
    # The connection reconnects by itself over aio-pika's public Connection: an override of a
    # name-mangled method of RobustConnection went silently unused where aio-pika lacked it.
    sources = (Path(connection.__file__).parent).glob("*.py")
    found = {path.name for path in sources if "RobustConnection" in path.read_text()}
    assert found == set()
