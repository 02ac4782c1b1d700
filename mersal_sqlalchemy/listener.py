"""PostgreSQL LISTEN: wakes the relay when another process commits outbox rows for this app."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

log = logging.getLogger("mersal.sqlalchemy")


class Listener:
    """A connection of the engine's, taken out of its pool, that LISTENs on a channel.

    `wake` runs for every notification whose payload is `app`, and after each (re)connect,
    since notifications sent while disconnected are lost. A lost connection is replaced after
    `retry_interval` seconds.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        channel: str,
        app: str,
        wake: Callable[[], None],
        *,
        retry_interval: float = 5.0,
    ) -> None:
        self.engine = engine
        self.channel = channel
        self.app = app
        self.wake = wake
        self.retry_interval = retry_interval
        self._task: asyncio.Task[None] | None = None
        self._listening = asyncio.Event()
        self._first_attempt = asyncio.Event()

    @property
    def listening(self) -> bool:
        """Whether the LISTEN is in place now."""
        return self._listening.is_set()

    async def start(self, timeout: float = 5.0) -> None:
        """Start listening in the background, after the first attempt (up to `timeout`)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"mersal-listen-{self.app}")
        try:
            async with asyncio.timeout(timeout):
                await self._first_attempt.wait()
        except TimeoutError:
            pass
        if not self.listening:
            log.warning("no LISTEN on %r yet; the relay polls until there is", self.channel)

    async def stop(self) -> None:
        """Stop listening and close the connection."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await self._listen_until_lost()
            except Exception as error:
                log.warning(
                    "LISTEN on %r failed (%s: %s); trying again in %gs",
                    self.channel,
                    type(error).__name__,
                    error,
                    self.retry_interval,
                )
            finally:
                self._listening.clear()
                self._first_attempt.set()
            await asyncio.sleep(self.retry_interval)

    async def _listen_until_lost(self) -> None:
        async with self.engine.connect() as connection:
            pooled = await connection.get_raw_connection()
            driver: Any = pooled.driver_connection
            pooled.detach()  # ours now: closed when we are done, never back in the pool
            lost = asyncio.Event()
            driver.add_termination_listener(lambda _connection: lost.set())
            await driver.add_listener(self.channel, self._notified)
            self._listening.set()
            self._first_attempt.set()
            self.wake()
            await lost.wait()
            log.warning("the LISTEN connection on %r was closed; reconnecting", self.channel)

    def _notified(self, connection: Any, pid: int, channel: str, payload: str) -> None:
        if payload == self.app:
            self.wake()
