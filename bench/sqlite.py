"""The embedded default: an App on `memory://` with a SQLite file, against raw aiosqlite.

One run, on two fresh temporary SQLite files (removed afterwards):

- Raw aiosqlite (the baseline): `CONCURRENCY` workers, each with a connection of its own (WAL,
  a 30 s busy timeout, as Mersal's engines have), take message indices from an asyncio.Queue of
  `MESSAGES` items, sleep that message's precomputed delay, then insert one row in a short
  transaction of its own (BEGIN IMMEDIATE; INSERT; COMMIT).
- Mersal: an App on `memory://<unique name>` with `database="sqlite+aiosqlite:///<file>"`,
  concurrency `CONCURRENCY` and `RetryPolicy(immediate=2, delayed=[0.1, 0.5])`, so that lock
  failures are retried and counted rather than lost. `MESSAGES` `Job(n)` commands are sent to
  the app's own queue right after it starts. The handler class gets the message's AsyncSession
  injected, sleeps the same delay for message `n`, and adds one ORM `Row`; a message counts as
  completed when its transaction has committed (an after-commit hook the handler registers).
  The `bench_rows` table is created on the file before the app starts.

Each message's delay is drawn once per run, uniform in 50-200 ms from `random.Random(7)`, and
indexed by the message's `n`, so both sides and successive runs sleep the same schedule.

Figures: messages per second from the first send (or queue fill) until the last commit, for
both, and their ratio (`sqlite_ratio_to_raw`, Mersal / raw); the number of "database is
locked" failures (records of logger `mersal.retry` at WARNING or above that mention it), all
failed attempts logged there, handler calls, dead letters (length of the memory broker's error
queue after the run), and the rows in the table once the app has stopped (equal to
`MESSAGES` when every message completed).

Size and time: `MERSAL_BENCH_SQLITE_N` sets `MESSAGES` (default 2,000; 2,000 x 125 ms on
average / 32 takes about 8 s when the handlers overlap). Each side gets at most
`MERSAL_BENCH_SQLITE_TIMEOUT` seconds (default 40) from its first send; a side that runs out
of time does not hang or fail: it reports what completed by then (`..._completed` below
`sqlite_messages`) and its rate over completions in the time it had. An app that timed out is
then stopped with a grace period of `GRACE` seconds, so `sqlite_rows` (counted after the stop)
can exceed `sqlite_completed` by the messages that committed during the stop. A run therefore
stays well under a minute whatever the code under test does with the write lock (at about
8 messages per second, where a message's transaction holds SQLite's write lock through its
handler, 2,000 messages would take over four minutes: the default run then times out).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import sqlite3
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiosqlite
from sqlalchemy import String, func, select
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from mersal import App, MessageContext, RetryPolicy, message
from mersal.transport.memory import MemoryTransport

MESSAGES = int(os.environ.get("MERSAL_BENCH_SQLITE_N", "2000"))
TIMEOUT = float(os.environ.get("MERSAL_BENCH_SQLITE_TIMEOUT", "40"))
"""Seconds each side may take from its first send before it reports what completed."""
CONCURRENCY = 32
SEED = 7
SHORTEST, LONGEST = 0.05, 0.2
"""The handler's sleep, in seconds."""
GRACE = 10.0
"""The app's grace period at stop: in-flight messages may finish (and commit) that long."""
BUSY_TIMEOUT_MS = 30_000
"""The baseline's busy timeout: what `mersal_sqlalchemy.make_engine` sets."""
NOTE = "a small note"
LOCKED = "database is locked"


@message("bench.SqliteJob.v1")
@dataclass
class Job:
    """One unit of work: its index picks the handler's sleep."""

    n: int


class Base(DeclarativeBase):
    """The benchmark's business table."""


class Row(Base):
    """The row each message adds."""

    __tablename__ = "bench_rows"

    id: Mapped[int] = mapped_column(primary_key=True)
    job: Mapped[int]
    note: Mapped[str] = mapped_column(String(64))


@dataclass
class Side:
    """What one side measured."""

    completed: int
    seconds: float

    @property
    def rate(self) -> float:
        """Completions per second (0 for none)."""
        return self.completed / self.seconds if self.completed and self.seconds > 0 else 0.0


class Progress:
    """The delays, and the messages whose transaction committed (what the handler reports)."""

    def __init__(self, delays: list[float]) -> None:
        self.delays = delays
        self.calls = 0
        self.committed: set[int] = set()
        self.finished_at = 0.0
        self.done = asyncio.Event()

    def commit(self, n: int) -> None:
        """Count message `n` as completed."""
        self.committed.add(n)
        if len(self.committed) == len(self.delays) and not self.done.is_set():
            self.finished_at = time.perf_counter()
            self.done.set()


class RecordJob:
    """The handler: sleep, then add one ORM row in the message's session."""

    def __init__(self, session: AsyncSession, context: MessageContext, progress: Progress) -> None:
        self.session = session
        self.context = context
        self.progress = progress

    async def __call__(self, job: Job) -> None:
        progress = self.progress
        progress.calls += 1
        await asyncio.sleep(progress.delays[job.n])
        self.session.add(Row(job=job.n, note=NOTE))

        async def committed() -> None:
            progress.commit(job.n)

        self.context.transaction.after_commit(committed)


class RetryLog(logging.Handler):
    """Counts the failed attempts `mersal.retry` logs, and those that were lock failures."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.failures = 0
        self.locked = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.failures += 1
        if LOCKED in record.getMessage():
            self.locked += 1


async def run() -> dict[str, float | int]:
    """Time raw aiosqlite and the app on the same schedule, each on a fresh file."""
    rng = random.Random(SEED)
    delays = [rng.uniform(SHORTEST, LONGEST) for _ in range(MESSAGES)]
    with tempfile.TemporaryDirectory(prefix="mersal-bench-sqlite-") as directory:
        raw = await through_aiosqlite(Path(directory) / "raw.db", delays)
        app = await through_app(Path(directory) / "app.db", delays)
    return {
        "sqlite_messages": MESSAGES,
        "sqlite_completed": app.side.completed,
        "sqlite_msgs_per_s": app.side.rate,
        "sqlite_locked": app.locked,
        "sqlite_failed_attempts": app.failures,
        "sqlite_handler_calls": app.calls,
        "sqlite_dead_lettered": app.dead_lettered,
        "sqlite_rows": app.rows,
        "raw_sqlite_completed": raw.completed,
        "raw_sqlite_msgs_per_s": raw.rate,
        "sqlite_ratio_to_raw": app.side.rate / raw.rate if raw.rate else 0.0,
    }


async def create_table(path: Path) -> None:
    """Create `bench_rows` on the file (the app's own tables it creates at start)."""
    engine = create_async_engine(f"sqlite+aiosqlite:///{path}")
    try:
        async with engine.begin() as connection:
            await connection.run_sync(Base.metadata.create_all)
    finally:
        await engine.dispose()


async def count_rows(path: Path) -> int:
    """The rows in `bench_rows`."""
    engine = create_async_engine(f"sqlite+aiosqlite:///{path}")
    try:
        async with engine.connect() as connection:
            return int(
                (await connection.execute(select(func.count()).select_from(Row))).scalar_one()
            )
    finally:
        await engine.dispose()


@dataclass
class AppResult:
    """What the Mersal side measured."""

    side: Side
    locked: int
    failures: int
    calls: int
    dead_lettered: int
    rows: int


async def through_app(path: Path, delays: list[float]) -> AppResult:
    """Send every job to an app on `path` and wait (at most TIMEOUT) for their commits."""
    await create_table(path)
    progress = Progress(delays)
    app = App(
        f"bench-sqlite-{uuid.uuid4().hex[:8]}",
        transport=f"memory://bench-sqlite-{uuid.uuid4().hex}",
        database=f"sqlite+aiosqlite:///{path}",
        retry=RetryPolicy(immediate=2, delayed=[0.1, 0.5]),
        concurrency=CONCURRENCY,
        grace_period=GRACE,
    )
    app.register(Job, RecordJob)
    app.route(Job, app.name)
    app.handlers.provide(Progress, lambda context: progress)
    retry_log = RetryLog()
    logger = logging.getLogger("mersal.retry")
    logger.addHandler(retry_log)
    try:
        async with app:
            started = time.perf_counter()
            for n in range(len(delays)):
                await app.send(Job(n))
            try:
                async with asyncio.timeout(TIMEOUT):
                    await progress.done.wait()
            except TimeoutError:
                side = Side(len(progress.committed), time.perf_counter() - started)
            else:
                side = Side(len(progress.committed), progress.finished_at - started)
    finally:
        logger.removeHandler(retry_log)
    transport = app.transport
    assert isinstance(transport, MemoryTransport)
    error_queue = transport.broker.queues.get(app.retry.error_queue)
    return AppResult(
        side=side,
        locked=retry_log.locked,
        failures=retry_log.failures,
        calls=progress.calls,
        dead_lettered=len(error_queue) if error_queue is not None else 0,
        rows=await count_rows(path),
    )


async def through_aiosqlite(path: Path, delays: list[float]) -> Side:
    """The same work without the framework: workers, a queue, one short transaction per row."""
    await create_table(path)
    connections = [await connect(path) for _ in range(CONCURRENCY)]
    queue: asyncio.Queue[int] = asyncio.Queue()
    completed = 0
    finished_at = 0.0

    async def work(connection: aiosqlite.Connection) -> None:
        nonlocal completed, finished_at
        while True:
            try:
                n = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await asyncio.sleep(delays[n])
            await connection.execute("BEGIN IMMEDIATE")
            try:
                await connection.execute(
                    "INSERT INTO bench_rows (job, note) VALUES (?, ?)", (n, NOTE)
                )
                await connection.execute("COMMIT")
            except BaseException:
                await asyncio.shield(rollback(connection))
                raise
            completed += 1
            finished_at = time.perf_counter()

    try:
        started = time.perf_counter()
        for n in range(len(delays)):
            queue.put_nowait(n)
        workers = [asyncio.create_task(work(connection)) for connection in connections]
        try:
            async with asyncio.timeout(TIMEOUT):
                await asyncio.gather(*workers)
        except TimeoutError:
            finished_at = time.perf_counter()
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
    finally:
        for connection in connections:
            await connection.close()
    return Side(completed, finished_at - started)


async def rollback(connection: aiosqlite.Connection) -> None:
    """End a failed transaction, keeping the error that led here rather than one from this."""
    with contextlib.suppress(sqlite3.Error):
        await connection.execute("ROLLBACK")


async def connect(path: Path) -> aiosqlite.Connection:
    """A connection tuned as Mersal tunes its engine's: WAL, a busy timeout, explicit BEGIN."""
    connection = await aiosqlite.connect(path, isolation_level=None)
    try:
        await connection.execute("PRAGMA journal_mode=WAL")
        await connection.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    except sqlite3.Error:
        await connection.close()
        raise
    return connection
