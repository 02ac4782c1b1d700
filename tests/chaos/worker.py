"""The chaos programs, each run as an OS process of its own by the ledger harness.

    python -m tests.chaos.worker drive --database URL --transport URL --intents N [options]
    python -m tests.chaos.worker work --database URL --transport URL [options]

`drive` is the producer: an App ("chaos.driver") whose `app.transaction(session)` commits, per
intent, a business row `intents(id)` and a `Work(id)` message through the real outbox; its relay
publishes them to the "chaos.work" queue. Intents committed by an earlier driver are skipped,
so a restarted driver finishes what a killed one began.

`work` is the consumer: the App "chaos.work", run by `mersal.cli.serve` as `mersal run` runs it.
A step before the pipeline's first appends each delivery to the raw log `deliveries` through a
connection of its own (autocommit, so the entry survives rollbacks and kills); the handler
appends its own entry, then upserts `effects(message_id)` through the message's AsyncSession,
so the effect commits with the inbox row, and counts re-applications in `effects.applied`.

Both print READY once their app runs, then run until SIGTERM or SIGINT, and stop by themselves
when the process that started them goes away. Faults come from options:

    --die-in-handler-at K      SIGKILL itself inside the handler of its K-th Work message,
                               after the effect row was written and before the commit
    --die-after-commit-at K    SIGKILL itself after the K-th Work message committed, before its ack
    --die-before-commit-at K   SIGKILL itself when the K-th Work message is about to commit: every
                               handler ran and wrote (a saga's row too), nothing committed
    --die-before-send-at K     (drive) SIGKILL itself when the relay is about to publish the
                               batch that reaches K messages: committed, leased, not published
    --die-after-send-at K      (drive) SIGKILL itself once K messages were confirmed by the
                               broker, before the relay deletes their rows
    --handler-delay S          every handler sleeps S seconds (inside its transaction)
    --sleep-in-database        ... in a `SELECT pg_sleep(S)` on its session: a statement in flight
    --slow S --slow-every K    the handler of every K-th intent sleeps S seconds instead
    --doom D                   (drive) first commit a burst of D `Doom` messages, in one
                               transaction; the worker's Doom handler always fails
    --saga MODE                Work goes to the saga `Tally` (MODE: optimistic or pessimistic)
                               instead of the Work handler: one saga per key (the intent's
                               number mod SAGA_KEYS), whose data lists the intents it took; its
                               method writes the effect as the handler does (and dies as it
                               does with --die-in-handler-at). Each attempt that ends in a
                               ConcurrencyConflict (rerun at once) is logged as stage "conflict"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from lagom import Container
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from mersal import App, Header, MessageContext, Outgoing, RetryPolicy, message
from mersal.cli.run import serve
from mersal.errors import ConcurrencyConflict
from mersal.pipeline import Next
from mersal.plugins import transport_from
from mersal.retry import attempts_made
from mersal.sagas import Saga
from mersal.transport import Transport
from mersal_sqlalchemy import attach, make_engine
from tests.support import DelegatingTransport

log = logging.getLogger("chaos")

WORK_QUEUE = "chaos.work"
DRIVER_QUEUE = "chaos.driver"
ERROR_QUEUE = "chaos.error"
WORK_TYPE = "chaos.Work.v1"
DOOM_TYPE = "chaos.Doom.v1"
SAGA_NAME = "chaos.Tally"
SAGA_KEYS = 12
"""How many Tally sagas a run has: intent number n goes to the saga of key n mod SAGA_KEYS."""
OPTIMISTIC = "optimistic"
PESSIMISTIC = "pessimistic"


@message(WORK_TYPE)
@dataclass
class Work:
    """One intent to carry out: the worker records its effect."""

    id: str


@message(DOOM_TYPE)
@dataclass
class Doom:
    """A message whose handler always fails."""

    id: str


class Doomed(Exception):
    """What the Doom handler raises, every time."""


def intent_id(number: int) -> str:
    """The id of the intent numbered `number`."""
    return f"i-{number:06d}"


def saga_key(intent: str) -> str:
    """The correlation value of the Tally saga that takes the intent `intent` ("i-000123")."""
    return f"tally-{int(intent[2:]) % SAGA_KEYS:02d}"


def die(why: str) -> None:
    """SIGKILL this process now: no cleanup, no ack, no rollback sent, as after `kill -9`."""
    log.warning("chaos: dying (%s)", why)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def asyncpg_dsn(database: str) -> str:
    """The plain libpq URL asyncpg takes for a SQLAlchemy `postgresql+asyncpg://` URL."""
    _, sep, rest = database.partition("://")
    return f"postgresql{sep}{rest}" if sep else database


# The raw delivery log.

RAW_INSERT = (
    "INSERT INTO deliveries (message_id, intent_id, kind, stage, pid, redelivered, attempt, at)"
    " VALUES ($1, $2, $3, $4, $5, $6, $7, to_timestamp($8))"
)


class RawLog:
    """Appends to `deliveries` on connections of its own, outside any message's transaction.

    An append that cannot reach the database (it is being restarted) is kept and written with
    the next one; only a kill in between loses it.
    """

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.pid = os.getpid()
        self.pending: list[tuple[Any, ...]] = []
        self.failures = 0

    @classmethod
    async def open(cls, database: str) -> RawLog:
        """Connect (two connections are plenty: one short insert per append)."""
        pool = await asyncpg.create_pool(asyncpg_dsn(database), min_size=1, max_size=2, timeout=10)
        return cls(pool)

    async def append(
        self,
        message_id: str,
        intent: str | None,
        kind: str,
        stage: str,
        redelivered: bool | None,
        attempt: str | None,
    ) -> None:
        """Record one entry now (or with the next append, if the database is away)."""
        self.pending.append(
            (message_id, intent, kind, stage, self.pid, redelivered, attempt, time.time())
        )
        await self.flush()

    async def flush(self) -> None:
        """Write every pending entry; keep them if the database cannot be reached."""
        rows, self.pending = self.pending, []
        if not rows:
            return
        try:
            async with asyncio.timeout(5):
                async with self.pool.acquire() as connection:
                    await connection.executemany(RAW_INSERT, rows)
        except (Exception, TimeoutError) as error:
            self.pending[:0] = rows
            self.failures += 1
            if self.failures % 50 == 1:
                log.warning(
                    "raw log: %d entries wait (%s: %s)",
                    len(self.pending),
                    type(error).__name__,
                    error,
                )

    async def close(self) -> None:
        """Write what is pending (briefly), then disconnect."""
        with contextlib.suppress(Exception, TimeoutError):
            async with asyncio.timeout(5):
                await self.flush()
        if self.pending:
            log.warning("raw log: %d entries never written", len(self.pending))
        with contextlib.suppress(Exception, TimeoutError):
            async with asyncio.timeout(5):
                await self.pool.close()


def kind_of(type_name: str | None) -> str:
    """'work', 'doom' or 'other', from the wire type name."""
    return {WORK_TYPE: "work", DOOM_TYPE: "doom"}.get(type_name or "", "other")


def intent_of(body: bytes) -> str | None:
    """The intent id in a Work or Doom body, without trusting it to be well formed."""
    try:
        value = json.loads(body).get("id")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


# The worker.


class Chaos:
    """The worker's fault settings and counters, shared by its handlers and steps."""

    def __init__(self, args: argparse.Namespace, raw: RawLog) -> None:
        self.raw = raw
        self.die_in_handler_at: int = args.die_in_handler_at
        self.die_after_commit_at: int = args.die_after_commit_at
        self.die_before_commit_at: int = args.die_before_commit_at
        self.handler_delay: float = args.handler_delay
        self.slow: float = args.slow
        self.slow_every: int = args.slow_every
        self.sleep_in_database: bool = args.sleep_in_database
        self.handled = 0
        self.committing = 0
        self.committed = 0

    def delay_for(self, intent: str) -> float:
        """How long the handler of `intent` sleeps."""
        if self.slow_every and int(intent[2:]) % self.slow_every == 0:
            return self.slow
        return self.handler_delay

    async def log_delivery(self, context: MessageContext, next: Next[MessageContext]) -> None:
        """The first incoming step: every delivery the worker takes goes to the raw log (at its
        first attempt; the step runs again for each immediate retry and conflict rerun)."""
        headers = context.headers
        if context.attempt > attempts_made(context.envelope) + 1 or context.conflicts:
            await next(context)
            return
        await self.raw.append(
            context.message_id,
            intent_of(context.envelope.body),
            kind_of(headers.get(Header.TYPE)),
            "received",
            context.delivery.redelivered,
            headers.get(Header.ATTEMPT),
        )
        await next(context)

    async def log_conflict(self, context: MessageContext, next: Next[MessageContext]) -> None:
        """Inside the retry loop, per attempt: an attempt that lost a race goes to the raw log."""
        try:
            await next(context)
        except ConcurrencyConflict:
            headers = context.headers
            await self.raw.append(
                context.message_id,
                intent_of(context.envelope.body),
                kind_of(headers.get(Header.TYPE)),
                "conflict",
                context.delivery.redelivered,
                headers.get(Header.ATTEMPT),
            )
            raise

    async def before_commit(self, context: MessageContext, next: Next[MessageContext]) -> None:
        """A step between the handlers and the commit: the place to die with every write made
        (effect, saga row, inbox row) and none committed, the saga's row locked."""
        if context.message_type is Work:
            self.committing += 1
            if self.committing == self.die_before_commit_at:
                die(f"message {self.committing} handled and written, about to commit")
        await next(context)

    async def after_commit(self, context: MessageContext, next: Next[MessageContext]) -> None:
        """A step between commit and ack: the place to die with the effect committed, unacked."""
        if context.message_type is Work:
            self.committed += 1
            if self.committed == self.die_after_commit_at:
                die(f"after the commit of message {self.committed}, before its ack")
        await next(context)


EFFECT = text(
    "INSERT INTO effects (message_id, intent_id, pid) VALUES (:message_id, :intent_id, :pid) "
    "ON CONFLICT (message_id) DO UPDATE SET applied = effects.applied + 1, "
    "last_pid = excluded.pid, last_at = clock_timestamp()"
)


class WorkHandler:
    """Records the intent's effect in the message's transaction."""

    def __init__(self, session: AsyncSession, context: MessageContext, chaos: Chaos) -> None:
        self.session = session
        self.context = context
        self.chaos = chaos

    async def __call__(self, message: Work) -> None:
        """Log the run, write the effect, maybe die or dawdle."""
        chaos, context = self.chaos, self.context
        await chaos.raw.append(
            context.message_id, message.id, "work", "handled", context.delivery.redelivered, None
        )
        await self.session.execute(
            EFFECT,
            {"message_id": context.message_id, "intent_id": message.id, "pid": chaos.raw.pid},
        )
        chaos.handled += 1
        if chaos.handled == chaos.die_in_handler_at:
            await self.session.flush()
            die(f"inside the handler of message {chaos.handled}, effect written, not committed")
        delay = chaos.delay_for(message.id)
        if delay and chaos.sleep_in_database:
            await self.session.execute(text("SELECT pg_sleep(:s)"), {"s": delay})
        elif delay:
            await asyncio.sleep(delay)


@dataclass
class TallyData:
    """A Tally saga's data: its key, and every intent it took, in commit order."""

    key: str = ""
    ids: list[str] = field(default_factory=list)


class Tally(Saga[TallyData], name=SAGA_NAME):
    """One saga per key, started and found by Work: the intents of its key, each once.

    Its method adds the intent to the saga's data, then does what the Work handler does (raw
    log, effect row, maybe die), so a kill there leaves changed data and an effect row
    written, neither committed.
    """

    started_by = (Work,)
    correlation = {Work: lambda work: saga_key(work.id)}

    def __init__(self, session: AsyncSession, context: MessageContext, chaos: Chaos) -> None:
        self.session = session
        self.context = context
        self.chaos = chaos

    async def tally(self, work: Work) -> None:
        """Add the intent to the data, then do what the Work handler does (log, effect, die)."""
        self.data.key = saga_key(work.id)
        self.data.ids.append(work.id)
        await WorkHandler(self.session, self.context, self.chaos)(work)


class DoomHandler:
    """Fails, every time."""

    def __init__(self, context: MessageContext, chaos: Chaos) -> None:
        self.context = context
        self.chaos = chaos

    async def __call__(self, message: Doom) -> None:
        """Log the attempt and fail."""
        context = self.context
        await self.chaos.raw.append(
            context.message_id, message.id, "doom", "handled", context.delivery.redelivered, None
        )
        raise Doomed(f"{message.id} always fails")


def worker_app(args: argparse.Namespace, chaos: Chaos) -> App:
    """The "chaos.work" app, with the raw-log step first and the after-commit step before ack."""
    container = Container()
    container[Chaos] = chaos
    app = App(
        WORK_QUEUE,
        transport=args.transport,
        database=args.database,
        retry=RetryPolicy(immediate=args.immediate, delayed=args.delayed, error_queue=ERROR_QUEUE),
        concurrency=args.concurrency,
        container=container,
    )
    attach(
        app,
        poll_interval=1.0,
        engine_options={"pool_size": args.concurrency + 2, "max_overflow": 4},
    )
    app.incoming.insert_before("decode", "chaos_raw_log", chaos.log_delivery)
    if args.saga:
        app.register_saga(Tally, pessimistic=args.saga == PESSIMISTIC)
        app.incoming.insert_after("chaos_raw_log", "chaos_conflicts", chaos.log_conflict)
    else:
        app.register(Work, WorkHandler)
    app.register(Doom, DoomHandler)
    app.incoming.insert_before("commit", "chaos_before_commit", chaos.before_commit)
    app.incoming.insert_after("commit", "chaos_after_commit", chaos.after_commit)
    return app


async def work(args: argparse.Namespace) -> None:
    """Run the worker app like `mersal run` does, until SIGTERM or SIGINT."""
    raw = await RawLog.open(args.database)
    try:
        app = worker_app(args, Chaos(args, raw))
        server = asyncio.create_task(serve(app))
        while not app.running:
            if server.done():
                await server  # it failed to start: raise its error
                return
            await asyncio.sleep(0.01)
        print("READY", flush=True)
        watchdog = asyncio.create_task(stop_when_orphaned(terminate_self))
        try:
            await server
        finally:
            watchdog.cancel()
    finally:
        await raw.close()


# The driver.


class FaultyTransport(DelegatingTransport):
    """The driver's transport: the real RabbitMQ transport, and a kill around the relay's sends."""

    def __init__(self, inner: Transport, die_before: int, die_after: int) -> None:
        super().__init__(inner)
        self.die_before = die_before
        self.die_after = die_after
        self.sent = 0

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        """Publish with confirms; die just before, or just after, as configured."""
        if self.die_before and self.sent + len(messages) >= self.die_before:
            die(f"relay: {len(messages)} committed message(s) claimed, about to publish")
        results = await self.inner.send_each(messages)
        self.sent += results.count(None)
        if self.die_after and self.sent >= self.die_after:
            die(f"relay: {self.sent} message(s) confirmed, their rows not deleted")
        return results


INSERT_INTENT = text("INSERT INTO intents (id, kind) VALUES (:id, :kind)")


class Committer:
    """Commits the intents not committed yet, each with its message, in its own transaction."""

    def __init__(self, app: App, engine: AsyncEngine, args: argparse.Namespace) -> None:
        self.app = app
        self.engine = engine
        self.intents: int = args.intents
        self.doom: int = args.doom
        self.concurrency: int = args.commit_concurrency
        self.rate: float = args.rate
        self.committed = 0
        self._next_at = 0.0

    async def run(self) -> None:
        """Commit the Doom burst (if any), then every Work intent still missing."""
        while True:
            try:
                async with self.engine.connect() as connection:
                    rows = await connection.execute(text("SELECT id, kind FROM intents"))
                    existing = {(row.id, row.kind) for row in rows}
                break
            except Exception as error:
                log.warning("reading the intents failed (%s: %s)", type(error).__name__, error)
                await asyncio.sleep(0.5)
        doom = [f"d-{n:06d}" for n in range(self.doom) if (f"d-{n:06d}", "doom") not in existing]
        if doom:
            await self._commit([(d, "doom") for d in doom])
        todo = [intent_id(n) for n in range(self.intents)]
        todo = [i for i in reversed(todo) if (i, "work") not in existing]
        self._next_at = time.monotonic()
        await asyncio.gather(*(self._commit_from(todo) for _ in range(self.concurrency)))
        print(f"COMMITTED {self.committed}", flush=True)

    async def _commit_from(self, todo: list[str]) -> None:
        while todo:
            intent = todo.pop()
            if self.rate:
                self._next_at += 1.0 / self.rate
                pause = self._next_at - time.monotonic()
                if pause > 0:
                    await asyncio.sleep(pause)
            await self._commit([(intent, "work")])

    async def _commit(self, intents: list[tuple[str, str]]) -> None:
        """One transaction: the intent rows and their messages; again until it is known."""
        while True:
            try:
                async with (
                    AsyncSession(self.engine) as session,
                    self.app.transaction(session),
                ):
                    for intent, kind in intents:
                        await session.execute(INSERT_INTENT, {"id": intent, "kind": kind})
                        await self.app.send(Work(intent) if kind == "work" else Doom(intent))
            except IntegrityError:
                return  # a commit whose outcome we missed went through after all
            except Exception as error:
                log.warning(
                    "committing %s failed (%s: %s)", intents[0][0], type(error).__name__, error
                )
                await asyncio.sleep(0.2)
            else:
                self.committed += len(intents)
                return


async def drive(args: argparse.Namespace) -> None:
    """Commit the intents, keep relaying until SIGTERM or SIGINT, then stop gracefully."""
    transport = FaultyTransport(
        transport_from(args.transport), args.die_before_send_at, args.die_after_send_at
    )
    app = App(DRIVER_QUEUE, transport=transport, database=args.database, concurrency=1)
    attach(
        app,
        lease=args.lease,
        poll_interval=1.0,
        engine_options={"pool_size": 2, "max_overflow": 2},
    )
    app.route(Work, WORK_QUEUE)
    app.route(Doom, WORK_QUEUE)
    engine = make_engine(args.database, pool_size=args.commit_concurrency, max_overflow=0)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    try:
        async with app:
            print("READY", flush=True)
            committer = asyncio.create_task(Committer(app, engine, args).run())
            watchdog = asyncio.create_task(stop_when_orphaned(stopping.set))
            await stopping.wait()
            for task in (committer, watchdog):
                task.cancel()
            await asyncio.gather(committer, watchdog, return_exceptions=True)
    finally:
        await engine.dispose()


def terminate_self() -> None:
    """SIGTERM this process: `serve` stops the app gracefully."""
    os.kill(os.getpid(), signal.SIGTERM)


async def stop_when_orphaned(stop: Any) -> None:
    """Stop when the process that started this one is gone: nothing is left behind."""
    parent = os.getppid()
    while True:
        await asyncio.sleep(1.0)
        if os.getppid() != parent:
            break
    log.warning("chaos: the harness went away; stopping")
    stop()


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.worker", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("work", "drive"):
        command = commands.add_parser(name)
        command.add_argument("--database", required=True)
        command.add_argument("--transport", required=True)
        command.add_argument("--log-level", default="INFO")
    work_ = commands.choices["work"]
    work_.add_argument("--concurrency", type=int, default=8)
    work_.add_argument("--immediate", type=int, default=2)
    work_.add_argument(
        "--delayed",
        type=lambda s: [float(x) for x in s.split(",") if x],
        default=[0.5, 1.0, 2.0, 5.0, 10.0, 20.0],
    )
    work_.add_argument("--die-in-handler-at", type=int, default=0)
    work_.add_argument("--die-after-commit-at", type=int, default=0)
    work_.add_argument("--die-before-commit-at", type=int, default=0)
    work_.add_argument("--handler-delay", type=float, default=0.0)
    work_.add_argument("--slow", type=float, default=0.0)
    work_.add_argument("--slow-every", type=int, default=0)
    work_.add_argument("--sleep-in-database", action="store_true")
    work_.add_argument("--saga", choices=(OPTIMISTIC, PESSIMISTIC), default=None)
    drive_ = commands.choices["drive"]
    drive_.add_argument("--intents", type=int, required=True)
    drive_.add_argument("--doom", type=int, default=0)
    drive_.add_argument("--commit-concurrency", type=int, default=4)
    drive_.add_argument("--rate", type=float, default=0.0, help="intents per second (0: no cap)")
    drive_.add_argument("--lease", type=float, default=3.0)
    drive_.add_argument("--die-before-send-at", type=int, default=0)
    drive_.add_argument("--die-after-send-at", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen program."""
    args = parse(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {os.getpid()} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("aiormq").setLevel(logging.WARNING)
    logging.getLogger("aio_pika").setLevel(logging.WARNING)
    asyncio.run(work(args) if args.command == "work" else drive(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
