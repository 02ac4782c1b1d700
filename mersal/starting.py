"""Starting an app once its broker and database answer, trying again with growing pauses.

`mersal run --wait SECONDS` and `App.start(wait=SECONDS)` (an app started inside a web server's
lifespan) both start this way: each try that finds the broker or the database unreachable is
logged at WARNING with the pause before the next, until the time is up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

from mersal.errors import Unreachable

FIRST_PAUSE = 0.5
MAX_PAUSE = 5.0
ATTEMPT_TIMEOUT = 15.0
"""Seconds one start may take (at least) before its broker or database counts as unreachable."""
CANCEL_WAIT = 5.0
"""Seconds a cancelled start may take to clean up before it is left behind."""
CLIENT_LOGGERS = ("aiormq.connection",)
"""The broker client's loggers that report each failed connect of a start."""


class Startable(Protocol):
    """An app, as far as starting it goes."""

    @property
    def name(self) -> str:
        """The app's name."""
        ...

    async def start(self) -> None:
        """Connect and start, or raise (`Unreachable` when the broker or database is down)."""
        ...


async def start_when_reachable(
    app: Startable,
    wait: float,
    stopping: asyncio.Event | None = None,
    *,
    hint: str = "--wait SECONDS",
    log: logging.Logger,
) -> bool:
    """Start `app`, trying again while its broker or database does not answer, up to `wait` s.

    False when `stopping` is set meanwhile; the last `Unreachable` once the time is up, saying
    how long it waited and `hint`, the setting that waits longer.
    """
    with _quiet(CLIENT_LOGGERS):
        return await _start_patiently(app, wait, stopping or asyncio.Event(), hint, log)


async def _start_patiently(
    app: Startable, wait: float, stopping: asyncio.Event, hint: str, log: logging.Logger
) -> bool:
    running = asyncio.get_running_loop()
    deadline = running.time() + wait
    pause = FIRST_PAUSE
    while True:
        try:
            limit = max(deadline - running.time(), ATTEMPT_TIMEOUT)
            return await start_once(app, limit, stopping)
        except Unreachable as error:
            left = deadline - running.time()
            if left <= 0:
                if wait <= 0:
                    raise
                raise Unreachable(f"{error} (waited {wait:g}s; {hint} to wait longer)") from error
            pause = min(pause, left)
            log.warning("%s; trying again in %.1fs", error, pause)
            if await set_within(stopping, pause):
                return False
            pause = min(pause * 2, MAX_PAUSE)


@contextmanager
def _quiet(names: Sequence[str]) -> Iterator[None]:
    """Keep the named loggers' records below DEBUG out while the block runs.

    The broker client logs each failed connect itself (aiormq at ERROR); while the start
    waits, its own WARNING says the same once per try.
    """
    keep = _BelowDebugOnly()
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addFilter(keep)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(keep)


class _BelowDebugOnly(logging.Filter):
    """Passes a record only when DEBUG logging is on (`--log-level DEBUG` shows everything)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return logging.getLogger().isEnabledFor(logging.DEBUG)


async def start_once(app: Startable, limit: float, stopping: asyncio.Event) -> bool:
    """Start `app` within `limit` seconds: True once started, False if told to stop first.

    An attempt that outlasts `limit` (a broker or database that takes the connection but
    never answers) is cancelled and counts as `Unreachable`; cancelling the caller cancels the
    attempt too.
    """
    attempt = asyncio.ensure_future(app.start())
    stop = asyncio.ensure_future(stopping.wait())
    try:
        done, _ = await asyncio.wait(
            {attempt, stop}, timeout=limit, return_when=asyncio.FIRST_COMPLETED
        )
    except asyncio.CancelledError:
        attempt.cancel()
        await asyncio.wait({attempt}, timeout=CANCEL_WAIT)
        raise
    finally:
        stop.cancel()
    if attempt in done:
        attempt.result()
        return True
    attempt.cancel()
    await asyncio.wait({attempt}, timeout=CANCEL_WAIT)
    if stop in done:
        return False
    raise Unreachable(
        f"app {app.name!r} could not start within {limit:g}s: its broker or database took "
        "the connection but did not answer"
    )


async def set_within(event: asyncio.Event, limit: float) -> bool:
    """Whether `event` is set within `limit` seconds."""
    try:
        async with asyncio.timeout(limit):
            await event.wait()
    except TimeoutError:
        return False
    return True
