"""The embedded default holds up: many writers on one SQLite file.

An App on `memory://` with `database=sqlite+aiosqlite:///<file>` and 32 concurrent handlers that
sleep 50-200 ms and add one ORM row (the workload of `bench/sqlite.py`): writers queue in the
process, so no attempt fails with "database is locked", nothing is dead-lettered, every message
leaves exactly one row, and the handlers overlap (400 messages one at a time would take 50 s;
overlapping, under 2 s; the bound of 25 s is about correctness, not speed). The inbox row is
written at commit on SQLite: a copy of a handled message is skipped, and two copies handled at
the same time leave one row (the second's commit finds the first's inbox row).
"""

from __future__ import annotations

import asyncio
import logging
import random
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncSession

from bench.sqlite import (
    LOCKED,
    LONGEST,
    SHORTEST,
    Job,
    Progress,
    RecordJob,
    Row,
    count_rows,
    create_table,
)
from mersal import App, Header, RetryPolicy
from mersal.transport.memory import MemoryQueue, MemoryTransport
from mersal_sqlalchemy.engines import make_engine
from tests.support import eventually

MESSAGES = 400
CONCURRENCY = 32
SEED = 12
OVERLAP_BOUND = 25.0
"""Seconds: 400 handlers of 125 ms on average take 50 s one at a time, 1.6 s 32 at a time
(half of one at a time, so that a loaded machine still shows the overlap)."""


def sqlite_app(path: Path, **options: object) -> App:
    """An app of its own on a private memory broker and the SQLite file at `path`."""
    tag = uuid.uuid4().hex[:8]
    return App(
        f"sqlite-writers-{tag}",
        transport=f"memory://sqlite-writers-{tag}",
        database=f"sqlite+aiosqlite:///{path}",
        retry=RetryPolicy(immediate=2, delayed=[0.1, 0.5]),  # a lock failure is retried, seen
        grace_period=2.0,
        **options,  # type: ignore[arg-type]
    )


def queues_of(app: App) -> tuple[MemoryQueue, MemoryQueue]:
    """The app's input queue and its error queue on the memory broker."""
    transport = app.transport
    assert isinstance(transport, MemoryTransport)
    queues = transport.broker.queues
    return queues[app.name], queues[app.retry.error_queue]


def failures_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every failed attempt `mersal.retry` logged (WARNING: retried, ERROR: dead-lettered)."""
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "mersal.retry" and record.levelno >= logging.WARNING
    ]


@pytest.mark.timeout(60)
async def test_32_writers_queue_without_lock_errors_and_overlap(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    path = tmp_path / "writers.db"
    await create_table(path)
    rng = random.Random(SEED)
    progress = Progress([rng.uniform(SHORTEST, LONGEST) for _ in range(MESSAGES)])
    app = sqlite_app(path, concurrency=CONCURRENCY)
    app.register(Job, RecordJob)
    app.route(Job, app.name)
    app.handlers.provide(Progress, lambda context: progress)
    async with app:
        started = time.perf_counter()
        for n in range(MESSAGES):
            await app.send(Job(n))
        try:
            async with asyncio.timeout(OVERLAP_BOUND):
                await progress.done.wait()
        except TimeoutError:
            pass
        elapsed = time.perf_counter() - started
        completed = len(progress.committed)
        _, errors = queues_of(app)
        dead = len(errors)
    rows = await count_rows(path)
    failures = failures_logged(caplog)
    locked = [text for text in caplog.messages if LOCKED in text]

    assert locked == [], f"{len(locked)} lock failure(s), e.g. {locked[0]}"
    assert failures == [], f"{len(failures)} failed attempt(s), e.g. {failures[0]}"
    assert completed == MESSAGES, (
        f"{completed} of {MESSAGES} messages committed within {OVERLAP_BOUND:g}s: the writers "
        "do not overlap"
    )
    assert elapsed < OVERLAP_BOUND
    assert dead == 0
    assert rows == MESSAGES
    assert progress.calls == MESSAGES


class Gate:
    """Lets handlers through once `expected` of them are inside at the same time (or after 5 s)."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.inside = 0
        self.peak = 0
        self.calls = 0
        self.full = asyncio.Event()

    async def enter(self) -> None:
        """Wait here until the others arrived."""
        self.calls += 1
        self.inside += 1
        self.peak = max(self.peak, self.inside)
        if self.inside >= self.expected:
            self.full.set()
        try:
            async with asyncio.timeout(5):
                await self.full.wait()
        except TimeoutError:
            pass  # alone: go on, the assertions on `peak` tell
        finally:
            self.inside -= 1


class GatedRow:
    """Waits at the gate, then adds one row in the message's session."""

    def __init__(self, session: AsyncSession, gate: Gate) -> None:
        self.session = session
        self.gate = gate

    async def __call__(self, job: Job) -> None:
        await self.gate.enter()
        self.session.add(Row(job=job.n, note="gated"))


async def start_gated(path: Path, gate: Gate) -> App:
    """A started app whose Job handler waits at `gate`, on the SQLite file at `path`."""
    await create_table(path)
    app = sqlite_app(path, concurrency=4)
    app.register(Job, GatedRow)
    app.route(Job, app.name)
    app.handlers.provide(Gate, lambda context: gate)
    await app.start()
    return app


def duplicates_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The "duplicate ... skipped" lines of the SQL storage."""
    return [text for text in caplog.messages if "duplicate" in text and "skipped" in text]


@pytest.mark.timeout(30)
async def test_a_copy_of_a_handled_message_is_skipped_on_sqlite(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    path = tmp_path / "copies.db"
    gate = Gate(expected=1)
    app = await start_gated(path, gate)
    try:
        home, errors = queues_of(app)
        headers = {Header.MESSAGE_ID: f"once-{uuid.uuid4().hex}"}
        await app.send(Job(1), headers=headers)
        await eventually(lambda: gate.calls == 1 and home.idle, "the first copy was handled")
        await eventually(lambda: app.in_flight == 0, "the first copy was committed")
        await app.send(Job(1), headers=headers)
        await eventually(lambda: duplicates_logged(caplog) != [], "the copy is skipped")
        await eventually(lambda: home.idle and app.in_flight == 0, "the copy is acked")
        dead = len(errors)
    finally:
        await app.stop()
    assert gate.calls == 1
    assert dead == 0
    assert await count_rows(path) == 1
    assert failures_logged(caplog) == []


@pytest.mark.timeout(30)
async def test_two_copies_handled_at_once_on_sqlite_leave_one_row(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    path = tmp_path / "concurrent.db"
    gate = Gate(expected=2)
    app = await start_gated(path, gate)
    try:
        home, errors = queues_of(app)
        headers = {Header.MESSAGE_ID: f"twice-{uuid.uuid4().hex}"}
        await app.send(Job(2), headers=headers)
        await app.send(Job(2), headers=headers)
        await eventually(lambda: gate.calls == 2, "both copies reach the handler")
        await eventually(lambda: home.idle and app.in_flight == 0, "both copies are acked")
        dead = len(errors)
    finally:
        await app.stop()
    assert gate.peak == 2, "the copies were not handled at the same time"
    assert dead == 0
    assert await count_rows(path) == 1
    assert len(duplicates_logged(caplog)) == 1
    assert failures_logged(caplog) == []


SLOW_COUNT = (
    "SELECT started() + (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c "
    "WHERE x < 2000000) SELECT count(*) FROM c)"
)
"""A read that signals when it runs, then takes about a second, inside BEGIN IMMEDIATE."""


class UsersConnection(sqlite3.Connection):
    """A connection class of the user's own, given in connect_args; counts its connections."""

    made = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        UsersConnection.made += 1


@pytest.mark.parametrize("factory", [None, UsersConnection], ids=["ours", "the user's"])
async def test_a_query_cancelled_while_it_runs_does_not_keep_the_write_lock(
    tmp_path: Path, factory: type[sqlite3.Connection] | None
) -> None:
    """A cancelled query's connection is closed while its traceback still holds its cursor.

    Since Python 3.11 SQLite then keeps that connection open as a zombie, with the write lock
    its BEGIN IMMEDIATE took, for as long as the traceback lives (here: the task is kept):
    every other writer waited the 30 s busy timeout, then failed. It must roll back on close.
    """
    made = UsersConnection.made
    options = {"connect_args": {"factory": factory}} if factory else {}
    engine = make_engine(f"sqlite+aiosqlite:///{tmp_path / 'locks.db'}", **options)
    started = threading.Event()

    @event.listens_for(engine.sync_engine, "connect")
    def connect(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.create_function("started", 0, lambda: started.set() or 0)

    async def slow_count() -> int:
        async with engine.connect() as connection:
            return int((await connection.execute(text(SLOW_COUNT))).scalar_one())

    try:
        async with engine.begin() as connection:
            await connection.execute(text("CREATE TABLE marks (n INTEGER)"))
        reader = asyncio.create_task(slow_count())
        await eventually(started.is_set, "the slow read runs")
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        async with asyncio.timeout(10):  # the read ends within a second; the busy timeout is 30 s
            async with engine.begin() as connection:
                await connection.execute(text("INSERT INTO marks VALUES (1)"))
        async with engine.connect() as connection:
            marks = (await connection.execute(text("SELECT n FROM marks"))).scalars().all()
        assert marks == [1]
        assert reader.cancelled()  # kept alive until here, with its traceback
        assert (UsersConnection.made > made) == (factory is not None)
    finally:
        await engine.dispose()


class Handled(list[int]):
    """The jobs whose handler ran to its end."""


class ReadThenWork:
    """Reads through the message's session (taking the one connection), then works a while."""

    def __init__(self, session: AsyncSession, handled: Handled) -> None:
        self.session = session
        self.handled = handled

    async def __call__(self, job: Job) -> None:
        await self.session.execute(text("SELECT 1"))
        await asyncio.sleep(0.2)
        self.handled.append(job.n)


async def test_a_wait_for_the_one_connection_does_not_count_against_the_handler_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    handled = Handled()
    app = sqlite_app(tmp_path / "waits.db", concurrency=4, handler_timeout=0.3)
    app.register(Job, ReadThenWork)
    app.route(Job, app.name)
    app.handlers.provide(Handled, lambda context: handled)
    async with app:
        for n in range(4):  # each holds the connection 0.2 s: the last waits 0.6 s for it
            await app.send(Job(n))
        await eventually(lambda: len(handled) == 4, "every job handled", timeout=10)
        _, errors = queues_of(app)
        dead = len(errors)

    assert failures_logged(caplog) == []
    assert sorted(handled) == [0, 1, 2, 3]
    assert dead == 0
