"""Handler timeouts (mersal/timeouts.py): a handler that swallows its cancellation is cancelled
again and dead-lettered, and the watchdog's clock keeps no message context alive."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from dataclasses import dataclass

import pytest

from mersal import (
    App,
    Header,
    MessageContext,
    RetryPolicy,
)
from tests.mersal.support import ERROR_QUEUE, broker_of, in_queue, settled
from tests.support import eventually

pytestmark = pytest.mark.timeout(60)


FAIL_FAST = RetryPolicy(immediate=0, delayed=[], error_queue=ERROR_QUEUE)
"""One attempt, then the error queue."""


@dataclass
class Job:
    n: int


class Marker:
    """An object only a message's context holds (MessageContext itself takes no weakref)."""


async def test_a_handler_that_swallows_its_timeout_is_cancelled_again_and_dead_lettered(
    memory_url: str,
) -> None:
    calls = 0
    swallowed = 0
    finished = False

    async def handle(message: Job) -> None:
        nonlocal calls, swallowed, finished
        calls += 1
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            swallowed += 1
        await asyncio.sleep(30)  # and awaits again
        finished = True

    app = App(
        "swallow",
        transport=memory_url,
        retry=FAIL_FAST,
        handler_timeout=0.2,
        grace_period=0.5,
    )
    app.register(Job, handle)
    app.route(Job, "swallow")
    async with app:
        broker = broker_of(app)
        started = time.monotonic()
        await app.send(Job(1))
        await eventually(
            lambda: bool(broker.queues[ERROR_QUEUE].ready), "the dead letter", timeout=3
        )
        took = time.monotonic() - started
        await eventually(lambda: settled(broker, "swallow"), "the delivery settled")
        [dead] = in_queue(broker, ERROR_QUEUE)

    assert dead.headers[Header.ERROR_TYPE] == "mersal.timeouts.HandlerTimeout"
    assert (calls, swallowed, finished) == (1, 1, False)
    assert took < 2.0


async def test_the_handler_clock_keeps_no_message_context_alive(memory_url: str) -> None:
    markers: list[weakref.ref[Marker]] = []

    async def handle(message: Job, context: MessageContext) -> None:
        marker = Marker()
        context.items["marker"] = marker
        markers.append(weakref.ref(marker))

    app = App("clock", transport=memory_url, handler_timeout=1.0)
    app.register(Job, handle)
    app.route(Job, "clock")
    async with app:
        broker = broker_of(app)
        await app.send(Job(1))
        await eventually(
            lambda: len(markers) == 1 and settled(broker, "clock"),
            "the message handled and settled",
        )

        def collected() -> bool:
            gc.collect()
            return markers[0]() is None

        # The clock's watchdog is still running; it must not hold the first message's context.
        await eventually(collected, "the first message's context collected", timeout=2)
        assert app.running
