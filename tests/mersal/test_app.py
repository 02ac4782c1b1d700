"""The app's life (mersal/app.py): before start it sends nothing and says to start it, after start
it takes no more handlers, routes or subscriptions; every configuration error is a MersalError."""

import asyncio
import logging
from dataclasses import dataclass

import pytest

from mersal import App, ConfigurationError, MersalError, NotRunning
from mersal.testing import Harness


@dataclass
class PlaceOrder:
    order_id: str


async def noop(message: object) -> None:
    pass


async def test_send_before_start_raises_not_running() -> None:
    app = App("a")
    app.route(PlaceOrder, "orders")
    for call in (app.send, app.send_local, app.publish):
        with pytest.raises(NotRunning) as raised:
            await call(PlaceOrder("o-1"))
        assert "app.start()" in str(raised.value)
    with pytest.raises(NotRunning):
        await app.defer(1.0, PlaceOrder("o-1"))
    with pytest.raises(NotRunning):
        async with app.transaction():
            pass
    assert issubclass(NotRunning, MersalError)


async def test_registering_after_start_is_refused() -> None:
    app = App("a")
    async with Harness(app):
        with pytest.raises(ConfigurationError) as raised:
            app.register(PlaceOrder, noop)
        assert "before app 'a' starts" in str(raised.value)
        with pytest.raises(ConfigurationError, match="before app 'a' starts"):
            app.route(PlaceOrder, "orders")
        with pytest.raises(ConfigurationError, match="before app 'a' starts"):
            app.subscribe(PlaceOrder)


def test_every_configuration_error_is_a_mersal_error() -> None:
    assert issubclass(ConfigurationError, MersalError)


@dataclass
class Note:
    n: int


async def test_two_stops_at_once_both_return_once_the_app_stopped(memory_url: str) -> None:
    app = App("twice", transport=memory_url)
    await app.start()

    await asyncio.gather(app.stop(), app.stop())

    assert not app.running


async def test_message_logging_turned_on_while_running_logs_the_next_messages(
    memory_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mersal.handled")
    app = App("logged", transport=memory_url)
    seen: list[int] = []

    async def handle(message: Note) -> None:
        seen.append(message.n)

    app.register(Note, handle)
    app.route(Note, "logged")
    async with Harness(app) as bus:
        await app.send(Note(1))
        await bus.idle(10)
        app.log_messages = True
        await app.send(Note(2))
        await bus.idle(10)

    lines = [r.getMessage() for r in caplog.records if r.name == "mersal.handled"]
    assert seen == [1, 2]
    assert len(lines) == 1
    assert lines[0].startswith("handled ")
    assert ".Note (" in lines[0]
