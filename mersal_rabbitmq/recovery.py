"""Bringing one lost object back: one attempt at a time, given up after a bounded number.

aio-pika retries a restore that fails for ever, or not at all; Mersal gives each object that can
be lost a `Recovery` of its own: a consumer whose channel closed or whose consumer the broker
cancelled, and the topology after a reconnect. Asked while the connection is down, it waits for
the connection to come back, and a failure while the connection is down is the connection's,
not the object's: it is not counted. A restore that keeps failing while connected is tried again
after each of its delays; then `lost` hears of it, and the recovery takes no more asks. An ask
that comes while a restore runs is followed by one more restore, never by two at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from mersal_rabbitmq import patches
from mersal_rabbitmq.connection import Connection

log = logging.getLogger("mersal.rabbitmq")

Restore = Callable[[], Awaitable[None]]
"""Brings one object back on the current connection; raises if it cannot."""
Lost = Callable[[Exception, int], None]
"""Hears that a restore failed for good: the last error and the number of attempts."""
DOWN_PAUSE = 0.1
"""Seconds between the attempts made while the connection is down."""


class Recovery:
    """Restores one object in the background when asked: one run at a time, bounded."""

    def __init__(
        self,
        connection: Connection,
        what: str,
        restore: Restore,
        *,
        delays: Sequence[float] = (),
        lost: Lost | None = None,
    ) -> None:
        self.what = what
        """What is restored, for the logs ("consuming 'orders'")."""
        self._connection = connection
        self._restore = restore
        self._delays = delays
        self._lost = lost
        self._task: asyncio.Task[None] | None = None
        self._again = False
        self._ended = False

    @property
    def ended(self) -> bool:
        """Whether the recovery takes no more asks (cancelled, or given up)."""
        return self._ended

    def ask(self) -> None:
        """Restore in the background, once connected; once more after a restore under way."""
        if self._ended:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(
                self._run(), name=f"mersal-rabbitmq {self.what}", context=patches.own_context()
            )
        else:
            self._again = True

    async def cancel(self) -> None:
        """Take no more asks, and stop a restore under way."""
        self._ended = True
        task = self._task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            self._again = False
            if not await self._attempts() or not self._again:
                return

    async def _attempts(self) -> bool:
        """Restore, trying again while connected; False once it gave up."""
        failures = 0
        while True:
            await self._connection.ready()
            try:
                await self._restore()
            except Exception as error:
                if not self._connection.connected:
                    await asyncio.sleep(DOWN_PAUSE)
                    continue
                if failures == len(self._delays):
                    self._give_up(error, failures + 1)
                    return False
                log.warning(
                    "%s again failed (%s: %s); retrying in %gs",
                    self.what,
                    type(error).__name__,
                    error,
                    self._delays[failures],
                )
                await asyncio.sleep(self._delays[failures])
                failures += 1
            else:
                return True

    def _give_up(self, error: Exception, attempts: int) -> None:
        self._ended = True
        if self._lost is not None:
            self._lost(error, attempts)
        else:
            log.error("%s again failed: %s: %s", self.what, type(error).__name__, error)
