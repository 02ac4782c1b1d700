"""Handler timeouts: one watchdog per app cancels the handlers that run past their time.

A timer per message costs more than the rest of a small message's trip through the app; the
watchdog looks at the running handlers a few times per timeout instead, so a handler is
stopped between 1 and 1.1 times its timeout after it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
import weakref
from collections.abc import Iterator
from typing import Any

from mersal.errors import MersalError

CHECKS_PER_TIMEOUT = 10
MIN_CHECK_INTERVAL = 0.01

_clocks: weakref.WeakSet[HandlerClock] = weakref.WeakSet()


class HandlerTimeout(MersalError):
    """A handler did not finish within the app's `handler_timeout`."""


class HandlerClock:
    """Watches running handlers and cancels those past `timeout` seconds (None: never)."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self._deadlines: dict[asyncio.Task[Any], float] = {}
        self._expired: dict[asyncio.Task[Any], int] = {}
        self._watchdog: asyncio.Task[None] | None = None

    def start(self) -> asyncio.Task[Any] | None:
        """Start timing the running task's handlers; returns the task to pass to `finish`."""
        if self.timeout is None:
            return None
        task = asyncio.current_task()
        assert task is not None
        self._deadlines[task] = time.monotonic() + self.timeout
        if self._watchdog is None:  # in a context of its own, not this message's
            _clocks.add(self)
            self._watchdog = asyncio.create_task(
                self._watch(), name="mersal-handler-clock", context=contextvars.Context()
            )
        return task

    def finish(self, task: asyncio.Task[Any] | None) -> bool:
        """Stop timing; True if the handlers ran out of time (their task was cancelled for it)."""
        if task is None:
            return False
        self._deadlines.pop(task, None)
        if not self._expired:
            return False
        cancels = self._expired.pop(task, 0)
        for _ in range(cancels):
            task.uncancel()
        return bool(cancels)

    @staticmethod
    async def absorb(task: asyncio.Task[Any] | None) -> None:
        """Take back the watchdog's cancellation if the handlers ended before it reached them.

        Else it would hit whatever the task awaits next. A stop's cancellation is left alone.
        """
        if task is not None and not task.cancelling():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0)

    async def stop(self) -> None:
        """Stop watching (the app stopped)."""
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)

    async def _watch(self) -> None:
        assert self.timeout is not None
        interval = max(MIN_CHECK_INTERVAL, self.timeout / CHECKS_PER_TIMEOUT)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            late = [task for task, deadline in self._deadlines.items() if deadline <= now]
            for task in late:  # a handler that swallows the cancellation gets it again
                self._deadlines[task] = now + interval
                self._expired[task] = self._expired.get(task, 0) + 1
                task.cancel()


@contextlib.contextmanager
def not_counted() -> Iterator[None]:
    """Time the running handlers spend in the block does not count against their timeout.

    For a wait on something the app shares among its messages (a pooled database connection),
    which says how busy the app is, not how slow the handler is.
    """
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running loop
        task = None
    clock = None if task is None else next((c for c in _clocks if task in c._deadlines), None)
    if clock is None or task is None:
        yield
        return
    left = clock._deadlines.pop(task) - time.monotonic()
    try:
        yield
    finally:
        clock._deadlines.setdefault(task, time.monotonic() + max(left, 0.0))
