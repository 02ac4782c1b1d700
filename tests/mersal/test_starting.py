"""`App.start(wait=...)`: an app started inside a web server waits for its broker as `mersal run`.

The broker URLs point at a port nothing listens on (unreachable), then at a forwarder to the
real RabbitMQ that opens while the app waits.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from uuid import uuid4

import aio_pika
import pytest

from mersal import App, message
from mersal.errors import ConfigurationError, Unreachable
from tests.support import RABBITMQ_HOST, eventually, forwarding, free_port


def unreachable_app(port: int) -> App:
    return App(f"starting-{uuid4().hex[:8]}", transport=f"amqp://guest:secret@127.0.0.1:{port}/")


async def test_without_wait_an_unreachable_broker_fails_the_first_try(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = unreachable_app(free_port())
    started = time.monotonic()
    with pytest.raises(Unreachable) as raised:
        await app.start()
    assert time.monotonic() - started < 5
    assert str(raised.value).startswith("cannot connect to RabbitMQ at amqp://guest:***@127.0.0.1:")
    assert "waited" not in str(raised.value)
    assert not [r for r in caplog.records if "trying again in" in r.getMessage()]
    assert not app.running


async def test_with_wait_an_unreachable_broker_is_tried_again_then_fails_saying_how_long(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="mersal.app")
    app = unreachable_app(free_port())
    started = time.monotonic()
    with pytest.raises(Unreachable) as raised:
        await app.start(wait=1.5)
    took = time.monotonic() - started
    assert 1.5 <= took < 6, took
    text = str(raised.value)
    assert text.startswith("cannot connect to RabbitMQ at amqp://guest:***@127.0.0.1:")
    assert text.endswith(" (waited 1.5s; start(wait=SECONDS) to wait longer)")
    assert "secret" not in text
    tries = [r for r in caplog.records if r.name == "mersal.app" and "trying again in" in r.msg]
    assert len(tries) >= 2
    assert tries[0].getMessage().endswith("; trying again in 0.5s")
    assert tries[1].getMessage().endswith("; trying again in 1.0s")
    assert all(r.levelname == "WARNING" for r in tries)
    assert not app.running


async def cancel_the_task(app: App, start: asyncio.Task[None]) -> None:
    start.cancel()


async def stop_the_app(app: App, start: asyncio.Task[None]) -> None:
    await app.stop()
    assert start.done()


@pytest.mark.parametrize("end", [cancel_the_task, stop_the_app])
async def test_a_waiting_start_ended_by_cancel_or_stop_leaves_the_app_not_running(
    end: Callable[[App, asyncio.Task[None]], Awaitable[None]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="mersal.app")
    app = unreachable_app(free_port())
    start = asyncio.create_task(app.start(wait=60))
    await eventually(
        lambda: any("trying again in" in r.getMessage() for r in caplog.records),
        "a try that found no broker",
        timeout=10,
    )
    async with asyncio.timeout(10):
        await end(app, start)
        with pytest.raises(asyncio.CancelledError):
            await start
    assert not app.running


@pytest.mark.parametrize("wait", [-1, math.nan, True, "30"])
async def test_a_wait_that_is_no_number_of_seconds_is_refused(wait: object) -> None:
    app = unreachable_app(free_port())

    with pytest.raises(ConfigurationError) as raised:
        await app.start(wait=wait)  # type: ignore[arg-type]

    assert str(raised.value) == (
        f"start(wait={wait!r}) must be a number of seconds >= 0 (0: do not wait)"
    )
    assert not app.running


@pytest.mark.integration
async def test_with_wait_a_broker_that_comes_up_meanwhile_is_used(
    caplog: pytest.LogCaptureFixture, vhost: str
) -> None:
    caplog.set_level(logging.WARNING, logger="mersal.app")
    port = free_port()
    name = f"starting-late-{uuid4().hex[:8]}"
    app = App(name, transport=f"amqp://guest:guest@127.0.0.1:{port}/{vhost}")
    app.register(Ping, ignore)
    start = asyncio.create_task(app.start(wait=30))
    try:
        await eventually(
            lambda: any("trying again in" in r.getMessage() for r in caplog.records),
            "a try that found no broker",
            timeout=10,
        )
        assert not start.done()
        async with forwarding(port, 5672):
            async with asyncio.timeout(20):
                await start
            assert app.running
            await app.stop()
    finally:
        start.cancel()
        async with await aio_pika.connect(
            f"amqp://guest:guest@{RABBITMQ_HOST}/{vhost}"
        ) as connection:
            await (await connection.channel()).queue_delete(name)


@message("starting.Ping.v1")
@dataclass
class Ping:
    """A message the late app handles (its queue is declared at start)."""

    n: int


async def ignore(ping: Ping) -> None:
    return None
