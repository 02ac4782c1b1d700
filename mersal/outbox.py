"""The outbox contracts (storage, rows) and the relay that moves committed rows to the broker."""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from mersal.errors import ConfigurationError, Unsendable
from mersal.messages import describe
from mersal.transaction import Transaction
from mersal.transport import Outgoing, Transport, mask

if TYPE_CHECKING:
    from mersal.app import App

log = logging.getLogger("mersal.outbox")


@dataclass(slots=True)
class OutboxRow:
    """A committed outgoing message waiting in the outbox."""

    id: int
    outgoing: Outgoing
    attempts: int = 0


class OutboxStore(Protocol):
    """Where committed outgoing messages wait until the broker confirms them."""

    async def claim(self, limit: int) -> list[OutboxRow]:
        """Lease up to `limit` unsent rows, oldest first, so that no other relay takes them."""
        ...

    async def delete(self, ids: Sequence[int]) -> None:
        """Forget rows the broker confirmed."""
        ...

    async def release(self, ids: Sequence[int]) -> None:
        """Give back the lease on rows that could not be sent now, to be tried again."""
        ...

    async def park(self, row_id: int, reason: str) -> None:
        """Set a row aside that can never be sent as it is, with the reason."""
        ...


class Storage(Protocol):
    """What `App(database=...)` plugs in: unit of work, inbox, outbox writes and the relay."""

    async def start(self) -> None:
        """Connect, check the tables, start the relay (the transport is already started)."""
        ...

    async def stop(self) -> None:
        """Stop the relay and disconnect."""
        ...

    def transaction(self, session: Any) -> AbstractAsyncContextManager[Transaction]:
        """Bind sends to the caller's session: outbox rows in its transaction, then commit."""
        ...

    async def pending(self) -> int:
        """How many committed messages still wait in the outbox to be sent."""
        ...


def attach_storage(app: App) -> Storage:
    """The storage for `app.database`, from the adapter package that handles its URL."""
    assert app.database is not None
    try:
        adapter = importlib.import_module("mersal_sqlalchemy")
    except ImportError as error:
        raise ConfigurationError(
            f"App(database={mask(app.database)!r}) needs the SQL adapter: "
            f"pip install 'mersal[sqlalchemy]' ({error})"
        ) from None
    attach: Callable[[App], Storage] | None = getattr(adapter, "attach", None)
    if attach is None:
        raise ConfigurationError("the installed mersal_sqlalchemy has no attach(app)")
    return attach(app)


class Relay:
    """Publishes committed outbox rows with confirms and deletes them once confirmed.

    It runs when woken (a local commit, a notification from another process) and on a slow
    poll as the safety net. A row the broker refuses for good (unroutable, too large) is parked
    with its reason; a transient failure gives the rows back and backs off.
    """

    def __init__(
        self,
        store: OutboxStore,
        transport: Transport,
        *,
        batch: int = 500,
        poll_interval: float = 5.0,
        max_backoff: float = 30.0,
    ) -> None:
        self.store = store
        self.transport = transport
        self.batch = batch
        self.poll_interval = poll_interval
        self.max_backoff = max_backoff
        self.published = 0
        self.parked = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def wake(self) -> None:
        """Look for rows now (called after a commit, or on a notification)."""
        self._wake.set()

    def start(self) -> None:
        """Run the relay loop in the background."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="mersal-relay")

    async def stop(self) -> None:
        """Stop the loop; rows not yet confirmed stay in the outbox."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def flush(self) -> int:
        """Relay until the outbox has no claimable rows; returns how many were published."""
        total = 0
        while True:
            rows = await self.store.claim(self.batch)
            if not rows:
                return total
            total += await self._relay(rows)

    async def _run(self) -> None:
        backoff = 0.0
        while True:
            self._wake.clear()
            try:
                await self.flush()
                backoff = 0.0
            except Exception as error:
                backoff = min(self.max_backoff, max(0.1, backoff * 2))
                log.warning(
                    "outbox relay failed (%s: %s); trying again in %.1fs",
                    type(error).__name__,
                    error,
                    backoff,
                )
            if backoff:
                await asyncio.sleep(backoff)
            else:
                await self._idle()

    async def _idle(self) -> None:
        try:
            async with asyncio.timeout(self.poll_interval):
                await self._wake.wait()
        except TimeoutError:
            pass

    async def _relay(self, rows: list[OutboxRow]) -> int:
        try:
            await self.transport.send([row.outgoing for row in rows])
        except Unsendable:
            return await self._relay_one_by_one(rows)
        except BaseException:
            await asyncio.shield(self.store.release([row.id for row in rows]))
            raise
        await self.store.delete([row.id for row in rows])
        self.published += len(rows)
        return len(rows)

    async def _relay_one_by_one(self, rows: list[OutboxRow]) -> int:
        sent: list[int] = []
        remaining = list(rows)
        try:
            while remaining:
                row = remaining[0]
                try:
                    await self.transport.send([row.outgoing])
                except Unsendable as error:
                    log.error(
                        "parking outbox row %d (%s): %s",
                        row.id,
                        describe(row.outgoing.envelope.headers),
                        error,
                    )
                    await self.store.park(row.id, f"{type(error).__name__}: {error}")
                    self.parked += 1
                else:
                    sent.append(row.id)
                remaining.pop(0)
        except BaseException:
            await asyncio.shield(self.store.release([row.id for row in remaining]))
            raise
        finally:
            if sent:
                await asyncio.shield(self.store.delete(sent))
                self.published += len(sent)
        return len(sent)
