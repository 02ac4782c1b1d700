"""What the dashboard shows of one app: its queues, outbox, dead-letter store and sagas.

A `Source` is an app as the dashboard reaches it (its broker, its database). `Sampler` looks at
every source every few seconds, keeps the last minutes of figures for the overview and its
chart, and (unless told not to) ingests the error queue into the store as it goes. Pages read
the samples and the tables; only the operator's actions change anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import msgspec
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from mersal.app import App
from mersal.dead_letters import DeadLetters
from mersal.errors import MersalError
from mersal.inspection import QueueInspector, QueueStatus, StorageStatus
from mersal.messages import Header, stored_key
from mersal.outbox import Relay
from mersal.plugins import transport_from
from mersal.status import query_for
from mersal.transport import Transport
from mersal.urls import mask
from mersal_sqlalchemy.counts import storage_status
from mersal_sqlalchemy.dead_letters import DeadLetterStore
from mersal_sqlalchemy.engines import database_url, make_engine, seconds_since
from mersal_sqlalchemy.outbox import SqlOutboxStore
from mersal_sqlalchemy.storage import SqlStorage
from mersal_sqlalchemy.tables import DEFAULT_INBOX, DEFAULT_OUTBOX, Tables, make_tables

log = logging.getLogger("mersal.dashboard")

HISTORY = 150
"""Samples kept per app: five minutes at the default interval."""

SAMPLE_DEADLINE = 5.0
"""Seconds a look at the broker or the database may take, at least, before it is given up."""

FORGET_EVERY = 3600.0
"""Seconds between drops of the store's old tombstones (`DeadLetterStore.forget`)."""


@dataclass(frozen=True)
class SagaCount:
    """Sagas of one type in flight: how many, and the age of the oldest."""

    saga: str
    count: int
    oldest_age: float | None


@dataclass
class Sample:
    """What the dashboard saw of one app at one moment."""

    at: float
    queues: list[QueueStatus] = field(default_factory=list)
    storage: StorageStatus | None = None
    failures: int | None = None
    sagas: list[SagaCount] = field(default_factory=list)
    rates: dict[str, float] = field(default_factory=dict)
    """Messages per second by series: `in`, `handled`, `failed` (from the management API)."""
    problems: list[str] = field(default_factory=list)
    """What could not be seen, masked, one line each."""
    notes: list[str] = field(default_factory=list)
    """What is not known yet, such as counts the broker has not made."""


@dataclass
class Source:
    """One app the dashboard shows, as it reaches it: a broker, a database, or both."""

    app: App
    transport: Transport | None
    database: str | None
    tables: Tables
    management: str | None = None
    engine: AsyncEngine | None = None
    history: deque[Sample] = field(default_factory=lambda: deque(maxlen=HISTORY))
    started: bool = False
    forgotten_at: float = 0.0
    """When the store's old tombstones were last dropped (time.monotonic())."""

    @property
    def name(self) -> str:
        """The app's name, which its rows carry."""
        return self.app.name

    @property
    def error_queue(self) -> str:
        """The app's error queue."""
        return self.app.retry.error_queue

    @property
    def broker(self) -> str | None:
        """The broker's URL with its password masked."""
        return None if self.transport is None else mask(self.transport.address)

    @property
    def shown_database(self) -> str | None:
        """The database URL with its password masked."""
        return None if self.database is None else mask(self.database)

    @property
    def store(self) -> DeadLetterStore | None:
        """The app's dead-letter store, when it has a database."""
        if self.engine is None:
            return None
        return DeadLetterStore(self.engine, self.tables, self.name)

    @property
    def last(self) -> Sample | None:
        """The latest sample, if any was taken."""
        return self.history[-1] if self.history else None

    async def start(self) -> None:
        """Open the database engine and the broker connection."""
        if self.database is not None:
            self.engine = make_engine(database_url(self.database))
        if self.transport is not None:
            await self.transport.start()
        self.started = True

    async def stop(self) -> None:
        """Close what `start` opened."""
        if self.transport is not None and self.started:
            with contextlib.suppress(Exception):
                await self.transport.stop()
        if self.engine is not None:
            await self.engine.dispose()
        self.started = False

    async def send_outbox(self) -> int:
        """Send the app's outbox rows now (a retry's), when the broker is known; how many."""
        if self.engine is None or self.transport is None:
            return 0
        outbox = SqlOutboxStore(self.engine, self.tables.outbox, self.name)
        return await Relay(outbox, self.transport).flush()


def source_of(
    app: App,
    *,
    transport: Transport | None = None,
    database: str | None = None,
    management: str | None = None,
    outbox_table: str | None = None,
    inbox_table: str | None = None,
) -> Source:
    """The source for `app`: its own broker and database unless others are given."""
    database = database or app.settings.database
    storage = app.storage
    if isinstance(storage, SqlStorage) and outbox_table is None and inbox_table is None:
        tables = storage.tables
    else:
        tables = make_tables(outbox_table or DEFAULT_OUTBOX, inbox_table or DEFAULT_INBOX)
    # A transport of its own: starting and stopping the app's would start and stop the app's.
    transport = transport or transport_from(app.transport.address)
    return Source(app, transport, database, tables, management)


class Sampler:
    """Looks at every source each `interval` seconds; ingests their error queues if asked."""

    def __init__(self, sources: Sequence[Source], interval: float, *, ingest: bool) -> None:
        self.sources = list(sources)
        self.interval = interval
        self.ingest = ingest
        self.rounds = 0
        self.deadline = max(SAMPLE_DEADLINE, 2 * interval)
        """Seconds each part of a look may take before it counts as not answering."""
        self._woken = asyncio.Event()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Sampler]:
        """Sample in the background while the block runs (the first round done before it)."""
        await self.sample_all()
        task = asyncio.create_task(self._loop(), name="mersal-dashboard-sampler")
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def wake(self) -> None:
        """Take the next sample now (after an action changed something)."""
        self._woken.set()

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self._woken.wait()
            self._woken.clear()
            await self.sample_all()

    async def sample_all(self) -> None:
        """One round: every source looked at (and ingested) side by side."""
        await asyncio.gather(*(self.sample(source) for source in self.sources))
        self.rounds += 1

    async def sample(self, source: Source) -> Sample:
        """Look at one source, record what was seen and what could not be."""
        sample = Sample(at=time.time())
        if self.ingest:
            await _guarded(sample, "ingesting the error queue", ingest(source), self.deadline)
        await asyncio.gather(
            _guarded(sample, "the broker", _broker(source, sample), self.deadline),
            _guarded(sample, "the database", _database(source, sample), self.deadline),
        )
        source.history.append(sample)
        return sample


async def _guarded(sample: Sample, what: str, work: Any, deadline: float) -> None:
    """Run `work`; a failure becomes a problem line of the sample, masked, not an exception."""
    try:
        async with asyncio.timeout(deadline):
            await work
    except TimeoutError:
        sample.problems.append(f"{what}: no answer within {deadline:g}s (down, or reconnecting)")
    except MersalError as error:
        sample.problems.append(f"{what}: {error}")
    except Exception as error:  # the dashboard stays up whatever one source does
        log.debug("sampling %s failed", what, exc_info=True)
        sample.problems.append(f"{what}: {type(error).__name__}: {mask(str(error))}")


async def ingest(source: Source) -> int:
    """Move what the error queue holds into the store (acked once stored); rows stored.

    Once an hour, the tombstones of failures resolved long ago are dropped too.
    """
    store = source.store
    if store is None or source.transport is None or not source.app.settings.consume:
        return 0
    stored = await store.ingest_all(DeadLetters(source.transport, source.error_queue))
    if time.monotonic() - source.forgotten_at > FORGET_EVERY:
        await store.forget()
        source.forgotten_at = time.monotonic()
    return stored


async def _broker(source: Source, sample: Sample) -> None:
    transport = source.transport
    if transport is None or not isinstance(transport, QueueInspector):
        return
    query = query_for(source.app, transport=transport, management=source.management)
    report = await transport.queue_status(
        [name for name, _ in query.queues],
        waits_of=query.waits_of,
        delays=query.delays,
        management=source.management,
    )
    roles = dict(query.queues)
    sample.queues = [
        replace(queue, role=roles.get(queue.name, queue.role)) for queue in report.queues
    ]
    if report.note:
        sample.notes.append(f"unacked counts: {report.note.removesuffix(': run again')}")
    sample.rates = await _rates(source)


async def _rates(source: Source) -> dict[str, float]:
    """Messages per second into the input queue, acked from it, into the error queue."""
    api_of = getattr(source.transport, "management_api", None)
    if api_of is None or not source.app.settings.consume:
        return {}
    api = api_of(source.management)
    try:
        own, errors = await asyncio.gather(api.queue(source.name), api.queue(source.error_queue))
    except MersalError:
        return {}
    return {
        "in": _rate(own, "publish_details"),
        "handled": _rate(own, "ack_details"),
        "failed": _rate(errors, "publish_details"),
    }


def _rate(queue: dict[str, Any] | None, key: str) -> float:
    stats = (queue or {}).get("message_stats") or {}
    details = stats.get(key) if isinstance(stats, dict) else None
    rate = details.get("rate") if isinstance(details, dict) else None
    return float(rate) if isinstance(rate, int | float) else 0.0


async def _database(source: Source, sample: Sample) -> None:
    engine = source.engine
    if engine is None or source.database is None:
        return
    sample.storage = await storage_status(engine, source.tables, source.database, source.name)
    sample.failures = sample.storage.failures
    sample.sagas = await saga_counts(engine, source.tables, source.name)


async def saga_counts(engine: AsyncEngine, tables: Tables, app: str) -> list[SagaCount]:
    """The app's sagas in flight by type, with the age of the oldest."""
    t = tables.sagas
    statement = (
        select(t.c.saga, func.count(), seconds_since(engine, func.min(t.c.created_at)))
        .where(t.c.app == app)
        .group_by(t.c.saga)
        .order_by(t.c.saga)
    )
    async with engine.connect() as connection:
        rows = (await connection.execute(statement)).all()
    return [SagaCount(str(saga), int(count), _age(age)) for saga, count, age in rows]


@dataclass(frozen=True)
class SagaRow:
    """One saga in the table: its type, correlation, id, revision, data and times."""

    saga: str
    correlation: str
    id: str
    revision: int
    data: str
    created_at: datetime | None
    updated_at: datetime | None


async def find_sagas(
    engine: AsyncEngine,
    tables: Tables,
    app: str,
    *,
    saga: str | None = None,
    correlation: str | None = None,
    saga_id: str | None = None,
    limit: int = 50,
) -> list[SagaRow]:
    """The app's sagas of a type, by correlation value or id, the most recently changed first."""
    t = tables.sagas
    condition = t.c.app == app
    if saga:
        condition = condition & (t.c.saga == saga)
    if correlation:
        condition = condition & (t.c.correlation == stored_key(correlation))
    if saga_id:
        condition = condition & (t.c.id == saga_id)
    statement = (
        select(t.c.saga, t.c.correlation, t.c.id, t.c.revision, t.c.data)
        .add_columns(t.c.created_at, t.c.updated_at)
        .where(condition)
        .order_by(t.c.updated_at.desc())
        .limit(limit)
    )
    async with engine.connect() as connection:
        rows = (await connection.execute(statement)).all()
    return [SagaRow(*row) for row in rows]


@dataclass(frozen=True)
class PendingTimeout:
    """A saga's timeout still in the outbox: committed, not yet handed to the broker."""

    row_id: int
    type_name: str | None
    deliver_at: str | None
    parked_reason: str | None


async def pending_timeouts(
    engine: AsyncEngine, tables: Tables, app: str, saga_id: str
) -> list[PendingTimeout]:
    """The timeouts saga `saga_id` requested that the outbox still holds.

    Once relayed, a timeout waits in the broker's wait queues, which can only be read by taking
    from them: those are not listed.
    """
    t = tables.outbox
    marker = _outbox_headers.encode({Header.SAGA_ID: saga_id})[1:-1].decode()
    pattern = "%" + marker.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    statement = (
        select(t.c.id, t.c.headers, t.c.parked_reason)
        .where((t.c.app == app) & t.c.headers.like(pattern, escape="\\"))
        .order_by(t.c.id)
        .limit(100)
    )
    async with engine.connect() as connection:
        rows = (await connection.execute(statement)).all()
    found = []
    for row_id, text, parked_reason in rows:
        headers = _outbox_header_map(text)
        if headers.get(Header.SAGA_ID) == saga_id:
            found.append(
                PendingTimeout(
                    row_id, headers.get(Header.TYPE), headers.get(Header.DELIVER_AT), parked_reason
                )
            )
    return found


def _outbox_header_map(text: str) -> dict[str, str]:
    try:
        return _outbox_header_decoder.decode(text)
    except msgspec.DecodeError:
        return {}


_outbox_headers = msgspec.json.Encoder()
_outbox_header_decoder = msgspec.json.Decoder(dict[str, str])


def _age(seconds: Any) -> float | None:
    return None if seconds is None else max(0.0, float(seconds))
