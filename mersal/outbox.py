"""The outbox contracts (storage, rows) and the relay that moves committed rows to the broker."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from mersal import plugins
from mersal.errors import MersalError, Unroutable, Unsendable
from mersal.messages import Header, describe
from mersal.pipeline import StorageSteps
from mersal.settle import Failure, run_to_end
from mersal.transaction import Transaction
from mersal.transport import Outgoing, Transport
from mersal.urls import mask

if TYPE_CHECKING:
    from mersal.app import App
    from mersal.telemetry import Telemetry

log = logging.getLogger("mersal.outbox")

MAX_TRACKED_FAILURES = 10_000


@dataclass(slots=True)
class OutboxRow:
    """A committed outgoing message waiting in the outbox.

    `problem` says why a row read from the database cannot become a message (its headers are
    not a JSON object of strings, say): the relay parks it without trying.
    """

    id: int
    outgoing: Outgoing
    attempts: int = 0
    problem: str | None = None


class OutboxStore(Protocol):
    """Where committed outgoing messages wait until the broker confirms them."""

    async def claim(self, limit: int) -> list[OutboxRow]:
        """Lease up to `limit` unsent rows, oldest first, so that no other relay takes them."""
        ...

    async def delete(self, ids: Sequence[int]) -> None:
        """Forget rows the broker confirmed."""
        ...

    async def release(self, ids: Sequence[int], delay: float = 0.0) -> None:
        """Give back the lease on rows that could not be sent now: claimable after `delay` s."""
        ...

    async def park(self, row_id: int, reason: str) -> None:
        """Set a row aside that can never be sent as it is, with the reason."""
        ...

    async def count_parked(self) -> int:
        """How many rows are parked, waiting for an operator."""
        ...


class Storage(StorageSteps, Protocol):
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

    @property
    def parked(self) -> int:
        """How many of the app's outbox rows are parked, as last counted."""
        ...

    @property
    def relay(self) -> Relay | None:
        """The outbox relay, while the storage runs."""
        ...


def attach_storage(app: App) -> Storage:
    """The storage for `app.database`, from the installed adapter for its URL's scheme."""
    assert app.database is not None
    return plugins.storage_for(app, mask(app.database))


class Relay:
    """Publishes committed outbox rows with confirms and deletes them once confirmed.

    It runs when woken (a local commit, a notification from another process) and on a slow
    poll as the safety net. Each row of a batch has its own outcome: confirmed rows are
    deleted, a row the broker can never take (unroutable, too large, bad headers) is parked
    with its reason, a row whose outcome is unknown is given back to be sent again, and a row
    that keeps failing with an error nobody classified is parked after `max_failures` tries.
    Nothing the broker confirmed is sent again by the relay.
    """

    def __init__(
        self,
        store: OutboxStore,
        transport: Transport,
        *,
        batch: int = 500,
        poll_interval: float = 5.0,
        max_backoff: float = 30.0,
        max_failures: int = 5,
        retry_delay: float = 1.0,
        telemetry: Telemetry | None = None,
        measure_backlog: Callable[[], Awaitable[tuple[int, float]]] | None = None,
        retry_command: Callable[[int], str] | None = None,
    ) -> None:
        self.store = store
        self.transport = transport
        self.telemetry = telemetry
        """Told of each publish, and of the backlog when `measure_backlog` is given."""
        self.measure_backlog = measure_backlog
        """The pending rows and the oldest one's age in seconds, for `telemetry`."""
        self.retry_command = retry_command or default_retry_command
        """The command that un-parks a row, named in the log line that parks it."""
        self.batch = batch
        self.poll_interval = poll_interval
        self.max_backoff = max_backoff
        self.max_failures = max_failures
        self.retry_delay = retry_delay
        self.published = 0
        self.parked = 0
        self.dropped = 0
        self.parked_rows = 0
        """The parked rows as last counted (at start, after parking, once per poll interval)."""
        self.failing: Failure | None = None
        """Why the relay's last round failed, until a round succeeds."""
        self._behind_since: float | None = None
        self._batch_since: float | None = None
        self._failures: dict[int, int] = {}
        self._parked_seen = 0
        self._counted_at = -math.inf
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    def wake(self) -> None:
        """Look for rows now (called after a commit, or on a notification)."""
        self._wake.set()

    @property
    def running(self) -> bool:
        """Whether the relay loop is running (started, not stopped, not crashed)."""
        return self._task is not None and not self._task.done()

    @property
    def lag(self) -> float:
        """Seconds since the relay last had every claimable row in hand (0 when it has)."""
        if self._behind_since is None:
            return 0.0
        return time.monotonic() - self._behind_since

    @property
    def batch_time(self) -> float:
        """Seconds the relay's current batch has taken so far (0 between batches)."""
        if self._batch_since is None:
            return 0.0
        return time.monotonic() - self._batch_since

    def start(self) -> None:
        """Run the relay loop in the background."""
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(self._run(), name="mersal-relay")

    async def stop(self, drain: float = 0.0) -> None:
        """Stop after sending what waits, for at most `drain` seconds (then after this batch).

        The batch in hand always runs to its end (at most the transport's publish timeout):
        confirmed rows are deleted, the others' leases are released, so that the next start
        (or another instance) sends them at once and never sends a confirmed row again.
        """
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping = True
        self._wake.set()
        if drain > 0:
            await asyncio.wait([task], timeout=drain)
        if not task.done():
            if drain > 0:
                log.warning("the outbox relay did not drain within %gs; stopping it", drain)
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def flush(self) -> int:
        """Relay until the outbox has no claimable rows; returns how many were published."""
        total = 0
        while True:
            await self._count_parked_when_due()
            sent = await run_to_end(self._batch())
            if sent is None:
                self._failures.clear()  # the rows they counted are gone (or leased elsewhere)
                return total
            total += sent

    async def _count_parked_when_due(self) -> None:
        """Recount the parked rows after parking and once per poll interval, busy or not.

        An operator purges or retries parked rows from another process: an app that always
        has rows to send must notice too. The backlog, when observed, is measured with them.
        """
        now = asyncio.get_running_loop().time()
        if self.parked != self._parked_seen or now - self._counted_at >= self.poll_interval:
            self._parked_seen, self._counted_at = self.parked, now
            self.parked_rows = await self.store.count_parked()
            if self.telemetry is not None and self.measure_backlog is not None:
                self.telemetry.outbox_measured(*await self.measure_backlog())

    async def _batch(self) -> int | None:
        """Claim a batch and see each row to its end; None when there was none.

        It runs to its end even when the relay is stopped meanwhile (at most the transport's
        publish timeout): rows the broker confirmed are deleted, not sent again by the next
        start, and no claimed row keeps its lease.
        """
        self._batch_since = time.monotonic()
        try:
            return await self._claim_and_send()
        finally:
            self._batch_since = None

    async def _claim_and_send(self) -> int | None:
        rows = await self.store.claim(self.batch)
        self._note_backlog(len(rows))
        if not rows:
            return None
        messages = [row.outgoing for row in rows if not row.problem]
        try:
            if self.telemetry is None:
                results = await self.transport.send_each(messages)
            else:
                results = await self.telemetry.send_each(self.transport, messages)
        except BaseException:  # nothing is known of these: give them back, to be sent again
            await self.store.release([row.id for row in rows])
            raise
        return await self._settle(rows, results)

    def _note_backlog(self, claimed: int) -> None:
        """A full batch means rows may wait behind it: the relay is behind until one is not."""
        if claimed < self.batch:
            self._behind_since = None
        elif self._behind_since is None:
            self._behind_since = time.monotonic()

    async def _run(self) -> None:
        backoff = 0.0
        self._counted_at = -math.inf
        while True:
            self._wake.clear()
            try:
                await self.flush()
                backoff = 0.0
                self.failing = None
            except Exception as error:
                self.failing = Failure.of(error)
                backoff = min(self.max_backoff, max(0.1, backoff * 2))
                log.warning(
                    "outbox relay failed (%s); trying again in %.1fs", self.failing, backoff
                )
            if self._stopping and not backoff:
                return
            await self._idle(backoff or self.poll_interval)

    async def _idle(self, seconds: float) -> None:
        """Wait until woken or `seconds` passed."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()

    async def _settle(self, rows: list[OutboxRow], results: list[Exception | None]) -> int:
        """Delete, park or give back each row as its result says; how many were sent."""
        sent = iter(results)
        plan = _Plan()
        for row in rows:
            result = f"cannot read the row: {row.problem}" if row.problem else next(sent)
            self._judge(row, result, plan)
        await self._carry_out(plan)
        if plan.retry:
            raise plan.retry_error or MersalError("outbox rows could not be sent")
        return len(plan.sent)

    def _judge(self, row: OutboxRow, result: Exception | str | None, plan: _Plan) -> None:
        """Decide what becomes of one row of a batch."""
        if result is None:
            plan.sent.append(row.id)
        elif isinstance(result, str):
            plan.park.append((row, result))
        elif unreachable_reply(row.outgoing, result):
            plan.dropped.append(row.id)
        elif isinstance(result, Unsendable):
            plan.park.append((row, f"{type(result).__name__}: {Failure.of(result).message}"))
        elif isinstance(result, MersalError):  # the broker's state, not the row: try again
            plan.retry.append(row.id)
            plan.retry_error = plan.retry_error or result
        else:
            failures = self._failures.get(row.id, 0) + 1
            if failures >= self.max_failures:
                plan.park.append((row, f"failed {failures} times: {Failure.of(result)}"))
            else:
                if len(self._failures) >= MAX_TRACKED_FAILURES:  # rows gone elsewhere linger
                    self._failures.clear()
                self._failures[row.id] = failures
                plan.retry.append(row.id)
                plan.retry_error = plan.retry_error or result

    async def _carry_out(self, plan: _Plan) -> None:
        done = [*plan.sent, *plan.dropped]
        if done:
            await self.store.delete(done)
        for row, reason in plan.park:
            log.error(
                "parking outbox row %d (%s to %r): %s; after fixing the cause, send it again "
                "with %s",
                row.id,
                describe(row.outgoing.envelope.headers),
                row.outgoing.address,
                reason,
                self.retry_command(row.id),
            )
            await self.store.park(row.id, reason)
        if plan.retry:  # later (unless stopping), so that the rows behind them go meanwhile
            await self.store.release(plan.retry, 0.0 if self._stopping else self.retry_delay)
        for row_id in (*done, *(row.id for row, _ in plan.park)):
            self._failures.pop(row_id, None)
        self.published += len(plan.sent)
        self.dropped += len(plan.dropped)
        self.parked += len(plan.park)


@dataclass
class _Plan:
    """What a batch's rows come to: deleted (sent or dropped), parked, or tried again."""

    sent: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    park: list[tuple[OutboxRow, str]] = field(default_factory=list)
    retry: list[int] = field(default_factory=list)
    retry_error: Exception | None = None


def default_retry_command(row_id: int) -> str:
    """`mersal outbox retry ID`, for a relay that was not told its database's options."""
    return f"`mersal outbox retry {row_id}`"


def unreachable_reply(outgoing: Outgoing, error: Exception) -> bool:
    """Whether a send failed only because it is a reply to a temporary queue now gone (logged)."""
    headers = outgoing.envelope.headers
    if not isinstance(error, Unroutable) or headers.get(Header.TEMPORARY_REPLY_TO) != "true":
        return False
    log.warning(
        "dropping %s: it replies to the temporary queue %r, which is gone (its requester "
        "stopped), so there is no one to reach",
        describe(headers),
        outgoing.address,
    )
    return True
