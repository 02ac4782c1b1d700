"""A graceful stop says what it waits for and how it ended: one line before, one after."""

import asyncio
import logging
import re
from dataclasses import dataclass

import pytest

from mersal import App
from mersal.messages import Envelope, Header
from mersal.waiting import type_of
from tests.support import eventually


@dataclass
class Ping:
    n: int


@dataclass
class Pong:
    n: int


async def slow(message: object) -> None:
    await asyncio.sleep(0.3)


async def hang(message: object) -> None:
    await asyncio.Event().wait()


def said(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "mersal.app"]


async def test_a_stop_says_which_handlers_it_waits_for_and_that_they_all_finished(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = App("orders", grace_period=5.0)
    app.register(Ping, slow)
    app.register(Pong, slow)
    await app.start()
    for message in (Ping(1), Ping(2), Pong(3)):
        await app.send_local(message)
    await eventually(lambda: len(app.worker.handling()) == 3 if app.worker else False, "3 running")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mersal.app"):
        await app.stop()

    (first_level, first), (last_level, last) = said(caplog)
    assert (first_level, first) == (
        "INFO",
        "stopping app 'orders': waiting up to 5 s for 3 handlers in flight (Ping x2, Pong)",
    )
    assert last_level == "INFO"
    assert re.fullmatch(r"app 'orders' stopped in 0\.[1-9] s", last), last


async def test_a_stop_that_gives_up_says_how_many_still_ran_and_that_they_come_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = App("orders", grace_period=0.1)
    app.register(Ping, hang)
    await app.start()
    await app.send_local(Ping(1))
    await eventually(lambda: app.in_flight == 1, "the handler running")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mersal.app"):
        await app.stop()

    (first_level, first), (last_level, last) = said(caplog)
    assert (first_level, first) == (
        "INFO",
        "stopping app 'orders': waiting up to 0.1 s for 1 handler in flight (Ping)",
    )
    assert last_level == "WARNING"
    assert re.fullmatch(
        r"app 'orders' stopped in 0\.\d s: gave up after 0\.1 s with 1 handler still running; "
        r"their messages go back to the queue and will be redelivered",
        last,
    ), last


async def test_a_stop_with_nothing_in_flight_says_so_in_one_short_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = App("orders")
    app.register(Ping, slow)
    await app.start()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mersal.app"):
        await app.stop()

    assert said(caplog) == [
        ("INFO", "stopping app 'orders': nothing in flight"),
        ("INFO", "app 'orders' stopped in 0.0 s"),
    ]


def test_a_type_name_the_app_does_not_know_is_shown_escaped() -> None:
    app = App("orders")
    app.register(Ping, slow)

    known = type_of(app.types, Envelope({Header.TYPE: app.types.name_of(Ping)}, b"{}"))
    unknown = type_of(app.types, Envelope({Header.TYPE: "Evil\nINFO app 'x' stopped"}, b"{}"))

    assert (known, unknown) == ("Ping", r"Evil\nINFO\x20app\x20'x'\x20stopped")
