"""Sagas on RabbitMQ + PostgreSQL, against the same transactions written by hand on asyncpg.

One run, in one process, in two parts, each on a PostgreSQL database and a RabbitMQ vhost of
its own, made for the part and dropped at its end. The saga (`Stepping`) is started by its
event `Step` (correlation: `Step.saga`); each Step appends its number to the saga's data and
sends a `Stepped` through the outbox, so each event commits the saga row, an outbox row and
the inbox row together.

- Spread. `SAGAS` sagas x `STEPS` events each: the `SAGAS * STEPS` events wait in the app's
  queue before it starts, interleaved (every saga's first event, then every saga's second,
  ...), so the events of one saga are `SAGAS` apart and the first of each starts it. Events
  per second run from the app's start to the last event's commit; the CPU time of this
  process per event is reported beside it. The hand-written side (`RawSagas`): the same
  events in a queue of its own (declared as the app's), consumed with aio-pika at the app's
  default prefetch and concurrency with manual acks; per event one asyncpg transaction (a
  pool of `CONCURRENCY`) writes the inbox row (a copy handled already is acked with nothing
  written), loads the saga row `SELECT ... FOR UPDATE`, inserts it when missing (`ON CONFLICT
  DO NOTHING`; the loser of a race locks the winner's row and updates it), or updates its
  JSON data, and writes the outbox row; then commit, ack. Its tables are Mersal's under other
  names (same columns and keys). Timed the same way: from connecting to the last event's
  commit.
- Hot saga. `HOT_EVENTS` events for one saga, waiting in one queue, consumed by two App
  objects of the same name in this process (one queue, one database), optimistic (the
  default) and then pessimistic (`register_saga(..., pessimistic=True)`); the saga method's
  runs past `HOT_EVENTS` are the reruns conflicts caused. Each instance's engine has a pool of
  `HOT_POOL` connections (as the saga tests' two instances do: two default pools would take
  most of a default server's 100 connections). The hand-written side: two `RawSagas`
  consumers (their own AMQP connection and asyncpg pool of that size each) on one queue;
  FOR UPDATE serializes them. Each side's final data must hold each event number exactly
  once (a `RuntimeError` otherwise).

Only the handling is timed: each app's outbox relay is stopped as soon as the app has started
(a few rows may go before, to a queue that takes them), since the hand-written side has none;
bench.outbox measures the relay. Successive runs alternate which side goes first (in the hot
part: the app's two sides, then the raw one, or the other way round).

`python -m bench.sagas spread|app-spread|raw-spread|hot` runs one part (or side) alone and
prints its figures: the thing to profile.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import asyncpg  # type: ignore[import-untyped]
import msgspec
from aio_pika.abc import AbstractIncomingMessage
from lagom import Container
from sqlalchemy import text
from sqlalchemy.pool import NullPool

from bench.outbox import private_database
from bench.support import CONCURRENCY, PREFETCH, Phase, Tally, asyncpg_dsn, private_vhost
from mersal import App, MessageContext, loop, message
from mersal.sagas import Saga
from mersal_sqlalchemy import SqlStorage, attach, make_engine, make_tables

SAGAS = 1_000
STEPS = 10
"""The spread part: SAGAS sagas, STEPS events each."""
HOT_EVENTS = 200
"""The hot part: events for one saga, on two instances."""
HOT_POOL = 20
"""Connections in each hot-part instance's pool (app engine and raw asyncpg pool alike)."""
IN_FLIGHT = 128
"""Seeding sends outstanding at once."""


SAGA_NAME = "bench.Stepping"
SPREAD_APP = "sagas-spread"
RAW_SPREAD = "raw-sagas-spread"
SINK = "sagas-sink"
"""Where the sagas' Stepped messages go (the app's rows and the raw side's alike)."""

RAW_TABLES = make_tables("raw_outbox", "raw_inbox")
"""The hand-written side's outbox, inbox and saga tables: Mersal's, under other names."""
RAW_SAGAS = RAW_TABLES.sagas.name

INSERT_INBOX = (
    "INSERT INTO raw_inbox (app, message_id) VALUES ($1, $2) "
    "ON CONFLICT DO NOTHING RETURNING message_id"
)
LOCK_SAGA = (
    f"SELECT data FROM {RAW_SAGAS} WHERE app = $1 AND saga = $2 AND correlation = $3 FOR UPDATE"
)
INSERT_SAGA = (
    f"INSERT INTO {RAW_SAGAS} (app, saga, correlation, id, revision, data) "
    "VALUES ($1, $2, $3, $4, 1, $5) ON CONFLICT DO NOTHING RETURNING id"
)
UPDATE_SAGA = (
    f"UPDATE {RAW_SAGAS} SET data = $4, revision = revision + 1, updated_at = now() "
    "WHERE app = $1 AND saga = $2 AND correlation = $3"
)
INSERT_OUTBOX = (
    "INSERT INTO raw_outbox (app, address, publish, headers, body) VALUES ($1, $2, false, $3, $4)"
)

_runs = itertools.count()
"""Runs so far in this process: even runs time the app first, odd ones the raw side."""


@message("bench.SagaStep.v1")
@dataclass
class Step:
    """An event of one saga: it starts the saga when none runs for `saga` yet."""

    saga: str
    number: int


@message("bench.SagaStepped.v1")
@dataclass
class Stepped:
    """What the saga sends for each event it takes, through the outbox."""

    saga: str
    number: int


@dataclass
class Steps:
    """The saga's data: its correlation value and the numbers of the events it took."""

    key: str = ""
    numbers: list[int] = field(default_factory=list)


class RawSteps(msgspec.Struct):
    """The saga data as the hand-written side reads and writes it (the same JSON)."""

    key: str
    numbers: list[int]


class RawStep(msgspec.Struct):
    """A Step as the hand-written side reads it."""

    saga: str
    number: int


JSON = msgspec.json.Encoder()
STEP_JSON = msgspec.json.Decoder(RawStep)
STEPS_JSON = msgspec.json.Decoder(RawSteps)


class Probe:
    """What the saga did in one phase: its events committed, and its method's runs."""

    def __init__(self, expected: int) -> None:
        self.tally = Tally(expected, "saga events committed")
        self.runs = 0

    async def committed(self) -> None:
        """An event's transaction committed (an after-commit hook)."""
        self.tally.record(None)


class Stepping(Saga[Steps], name=SAGA_NAME):
    """Appends each event's number to its data and sends a Stepped, in one transaction."""

    started_by = (Step,)
    correlation = {Step: "saga"}

    def __init__(self, app: App, context: MessageContext, probe: Probe) -> None:
        self.app, self.context, self.probe = app, context, probe

    async def step(self, event: Step) -> None:
        """Take one event; count its commit once the transaction has committed."""
        self.probe.runs += 1
        self.data.key = event.saga
        self.data.numbers.append(event.number)
        await self.app.send(Stepped(event.saga, event.number))
        self.context.transaction.after_commit(self.probe.committed)


@dataclass
class Hot:
    """What one side of the hot part measured."""

    rate: float
    reruns_per_event: float


async def run() -> dict[str, float | int]:
    """Both parts, each on a database and a vhost of its own; the app's side first on even runs."""
    app_first = next(_runs) % 2 == 0
    spread_figures = figures_of_spread(*await spread(app_first=app_first))
    return {**spread_figures, **figures_of_hot(*await hot(app_first=app_first))}


def figures_of_spread(app: Phase, raw: Phase) -> dict[str, float | int]:
    """The spread part's figures: each side's rate and CPU per event, and their ratio."""
    return {
        "sagas_spread_events_per_s": app.rate,
        "sagas_spread_cpu_us_per_event": app.cpu_seconds * 1e6,
        "raw_sagas_spread_events_per_s": raw.rate,
        "raw_sagas_spread_cpu_us_per_event": raw.cpu_seconds * 1e6,
        "sagas_spread_ratio": app.rate / raw.rate,
    }


def figures_of_hot(optimistic: Hot, pessimistic: Hot, raw: Hot) -> dict[str, float | int]:
    """The hot part's figures: each way's rate and reruns per event, against the raw rate."""
    return {
        "sagas_hot_optimistic_events_per_s": optimistic.rate,
        "sagas_hot_optimistic_conflict_reruns_per_event": optimistic.reruns_per_event,
        "sagas_hot_pessimistic_events_per_s": pessimistic.rate,
        "sagas_hot_pessimistic_conflict_reruns_per_event": pessimistic.reruns_per_event,
        "raw_sagas_hot_events_per_s": raw.rate,
        "sagas_hot_optimistic_ratio": optimistic.rate / raw.rate,
        "sagas_hot_pessimistic_ratio": pessimistic.rate / raw.rate,
    }


# The spread part.


async def spread(*, app_first: bool) -> tuple[Phase, Phase]:
    """The app's and the raw side's spread phases, on one fresh database and vhost."""
    async with private_database() as database, private_vhost("mersal-bench-sagas") as transport:
        await create_raw_tables(database)
        sides: dict[str, Callable[[str, str], Awaitable[Phase]]] = {
            "app": app_spread,
            "raw": raw_spread,
        }
        order = ("app", "raw") if app_first else ("raw", "app")
        phases = {side: await sides[side](database, transport) for side in order}
    return phases["app"], phases["raw"]


def spread_steps() -> list[Step]:
    """Every saga's events, interleaved: each saga's first, then each one's second, ..."""
    return [Step(f"saga-{saga}", step) for step in range(STEPS) for saga in range(SAGAS)]


async def app_spread(database: str, transport: str) -> Phase:
    """The spread events wait in the app's queue; time a fresh app through them."""
    probe = Probe(SAGAS * STEPS)
    app, storage = saga_app(SPREAD_APP, transport, database, probe)
    await seed(transport, SPREAD_APP, spread_steps())
    gc.collect()
    started, cpu = time.perf_counter(), time.process_time()
    async with app:
        await stop_relay(storage)
        await probe.tally.wait()
    check_count(probe.tally, "the app")
    await check_spread(database, "mersal_sagas", SPREAD_APP)
    return probe.tally.phase(started, cpu)


async def raw_spread(database: str, transport: str) -> Phase:
    """The spread events wait in the raw queue; time one `RawSagas` through them."""
    tally = Tally(SAGAS * STEPS, "raw saga events committed")
    await seed(transport, RAW_SPREAD, spread_steps())
    gc.collect()
    started, cpu = time.perf_counter(), time.process_time()
    async with raw_sagas(asyncpg_dsn(database), transport, RAW_SPREAD, tally, CONCURRENCY):
        await tally.wait()
    check_count(tally, "the raw side")
    await check_spread(database, RAW_SAGAS, RAW_SPREAD)
    return tally.phase(started, cpu)


async def check_spread(database: str, table: str, app: str) -> None:
    """A `RuntimeError` unless every spread saga holds each of its events' numbers once."""
    rows = await saga_rows(database, table, app)
    wrong = [key for key, numbers in rows.items() if sorted(numbers) != list(range(STEPS))]
    if len(rows) != SAGAS or wrong:
        raise RuntimeError(
            f"{app}: {len(rows)} sagas of {SAGAS}; {len(wrong)} without each of their "
            f"{STEPS} numbers exactly once (such as {wrong[:3]})"
        )


# The hot part.


async def hot(*, app_first: bool) -> tuple[Hot, Hot, Hot]:
    """The optimistic, pessimistic and raw sides on one saga, on one fresh database and vhost."""
    async with private_database() as database, private_vhost("mersal-bench-sagas") as transport:
        await create_raw_tables(database)
        sides: dict[str, Callable[[], Awaitable[Hot]]] = {
            "optimistic": lambda: app_hot(database, transport, pessimistic=False),
            "pessimistic": lambda: app_hot(database, transport, pessimistic=True),
            "raw": lambda: raw_hot(database, transport),
        }
        order = ["optimistic", "pessimistic", "raw"]
        results = {side: await sides[side]() for side in (order if app_first else order[::-1])}
    return results["optimistic"], results["pessimistic"], results["raw"]


def hot_steps(key: str) -> list[Step]:
    """`HOT_EVENTS` events of the one saga `key`."""
    return [Step(key, number) for number in range(HOT_EVENTS)]


async def app_hot(database: str, transport: str, *, pessimistic: bool) -> Hot:
    """Two instances of one app take the hot saga's events, which wait in their queue."""
    name = "hot-pessimistic" if pessimistic else "hot-optimistic"
    probe = Probe(HOT_EVENTS)
    options = {"pool_size": HOT_POOL, "max_overflow": 0}
    instances = [
        saga_app(name, transport, database, probe, pessimistic=pessimistic, engine=options)
        for _ in range(2)
    ]
    await seed(transport, name, hot_steps(name))
    gc.collect()
    started = time.perf_counter()
    try:
        await asyncio.gather(*(app.start() for app, _ in instances))
        await asyncio.gather(*(stop_relay(storage) for _, storage in instances))
        await probe.tally.wait()
        data = await instances[0][0].saga_data(Stepping, name)
    finally:
        await asyncio.gather(*(app.stop() for app, _ in instances))
    check_count(probe.tally, name)
    check_hot(name, None if data is None else data.numbers)
    phase = probe.tally.phase(started, 0.0)
    return Hot(phase.rate, (probe.runs - HOT_EVENTS) / HOT_EVENTS)


async def raw_hot(database: str, transport: str) -> Hot:
    """Two `RawSagas` consumers take the hot saga's events, which wait in their queue."""
    name = "raw-hot"
    tally = Tally(HOT_EVENTS, "raw hot saga events committed")
    await seed(transport, name, hot_steps(name))
    dsn = asyncpg_dsn(database)
    gc.collect()
    started = time.perf_counter()
    async with AsyncExitStack() as stack:
        for _ in range(2):
            await stack.enter_async_context(raw_sagas(dsn, transport, name, tally, HOT_POOL))
        await tally.wait()
    check_count(tally, name)
    check_hot(name, (await saga_rows(database, RAW_SAGAS, name)).get(name))
    return Hot(tally.phase(started, 0.0).rate, 0.0)


def check_hot(side: str, numbers: list[int] | None) -> None:
    """A `RuntimeError` unless the hot saga holds each of its events' numbers exactly once."""
    if numbers is None or sorted(numbers) != list(range(HOT_EVENTS)):
        found = (
            "no saga"
            if numbers is None
            else f"{len(numbers)} numbers, {len(set(numbers))} distinct"
        )
        raise RuntimeError(
            f"{side}: the hot saga does not hold each of {HOT_EVENTS} numbers once ({found})"
        )


# The app's side.


def saga_app(
    name: str,
    transport: str,
    database: str,
    probe: Probe,
    *,
    pessimistic: bool = False,
    engine: dict[str, Any] | None = None,
) -> tuple[App, SqlStorage]:
    """An instance of the saga app on `database`, with its storage; `engine`: pool options."""
    container = Container()
    container[Probe] = probe
    app = App(name, transport=transport, database=database, container=container)
    app.register_saga(Stepping, pessimistic=pessimistic)
    app.route(Step, name)
    app.route(Stepped, SINK)
    return app, attach(app, engine_options=engine)


async def stop_relay(storage: SqlStorage) -> None:
    """Stop the started app's relay: the outbox rows stay (the raw side has no relay)."""
    if storage.relay is not None:
        await storage.relay.stop()


# The hand-written side.


@asynccontextmanager
async def raw_sagas(
    dsn: str, transport: str, queue: str, tally: Tally, pool_size: int
) -> AsyncIterator[RawSagas]:
    """A `RawSagas` consuming `queue`; once its handlers are done, stopped and disconnected."""
    async with AsyncExitStack() as stack:
        pool = await asyncpg.create_pool(dsn, min_size=pool_size, max_size=pool_size)
        stack.push_async_callback(pool.close)
        connection = await aio_pika.connect(transport)
        stack.push_async_callback(connection.close)
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=PREFETCH)
        sagas = RawSagas(pool, queue, tally)
        await (await channel.get_queue(queue)).consume(sagas.handle)
        stack.push_async_callback(sagas.drain)
        yield sagas


class RawSagas:
    """The saga by hand: each event in one asyncpg transaction, then its ack.

    An event (at most `CONCURRENCY` at once): the inbox row (a copy handled already is acked
    with nothing written), the saga row locked, inserted or updated, the Stepped outbox row;
    commit, count, ack. A failure nacks it back to the queue.
    """

    def __init__(self, pool: Any, app: str, tally: Tally) -> None:
        self.pool = pool
        self.app = app
        self.tally = tally
        self.slots = asyncio.Semaphore(CONCURRENCY)
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    async def handle(self, message: AbstractIncomingMessage) -> None:
        """One event: commit it, count it, ack; nack (requeue) if the transaction fails."""
        self.in_flight += 1
        self.idle.clear()
        try:
            async with self.slots:
                try:
                    await self.commit(message)
                except Exception:
                    await message.nack(requeue=True)
                    raise
                self.tally.record(None)
                await message.ack()
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self.idle.set()

    async def drain(self) -> None:
        """Until no event is being handled (its ack sent)."""
        await self.idle.wait()

    async def commit(self, message: AbstractIncomingMessage) -> None:
        """The inbox row, the saga's new data and the outbox row, in one transaction."""
        step = STEP_JSON.decode(message.body)
        async with self.pool.acquire() as connection, connection.transaction():
            if await connection.fetchval(INSERT_INBOX, self.app, message.message_id) is None:
                return  # a copy of an event handled already
            await self.save(connection, step)
            headers, body = stepped_row(step, message, self.app)
            await connection.execute(INSERT_OUTBOX, self.app, SINK, headers, body)

    async def save(self, connection: Any, step: RawStep) -> None:
        """Append the step's number to its saga, locked; create the saga if none runs."""
        data = await connection.fetchval(LOCK_SAGA, self.app, SAGA_NAME, step.saga)
        if data is None:
            new = JSON.encode(RawSteps(step.saga, [step.number])).decode()
            saga_id = str(uuid.uuid4())
            created = await connection.fetchval(
                INSERT_SAGA, self.app, SAGA_NAME, step.saga, saga_id, new
            )
            if created is not None:
                return
            # Another event created it meanwhile: its row is committed now, lock it.
            data = await connection.fetchval(LOCK_SAGA, self.app, SAGA_NAME, step.saga)
        steps = STEPS_JSON.decode(data)
        steps.numbers.append(step.number)
        await connection.execute(
            UPDATE_SAGA, self.app, SAGA_NAME, step.saga, JSON.encode(steps).decode()
        )


def stepped_row(step: RawStep, cause: AbstractIncomingMessage, app: str) -> tuple[str, bytes]:
    """The Stepped outbox row's headers (JSON text, as Mersal's) and body for an event."""
    message_id = str(uuid.uuid4())
    headers = {
        "message-id": message_id,
        "type": "bench.SagaStepped.v1",
        "correlation-id": cause.correlation_id or message_id,
        "causation-id": cause.message_id or "",
        "sent-at": f"{time.time():.6f}",
        "content-type": "application/json",
        "source": app,
        "reply-to": app,
    }
    return JSON.encode(headers).decode(), JSON.encode(RawStep(step.saga, step.number))


# What both sides share.


async def seed(transport: str, queue: str, steps: Iterable[Step]) -> None:
    """The steps, in order (`IN_FLIGHT` sends outstanding), into `queue`, declared as an app's."""
    frontend = App(f"{queue}-frontend", transport=transport, consume=False)
    frontend.route(Step, queue)
    pending = iter(steps)

    async def sender() -> None:
        for step in pending:
            await frontend.send(step)

    async with frontend:
        await frontend.transport.declare(queue)
        await frontend.transport.declare(SINK)
        await asyncio.gather(*(sender() for _ in range(IN_FLIGHT)))


def check_count(tally: Tally, side: str) -> None:
    """A `RuntimeError` if more events committed than were sent (one committed twice)."""
    if tally.arrived != tally.expected:
        raise RuntimeError(f"{side}: {tally.arrived} events committed, {tally.expected} sent")


async def create_raw_tables(database: str) -> None:
    """The hand-written side's outbox, inbox and saga tables."""
    engine = make_engine(database, poolclass=NullPool)
    try:
        async with engine.begin() as connection:
            await connection.run_sync(RAW_TABLES.metadata.create_all)
    finally:
        await engine.dispose()


async def saga_rows(database: str, table: str, app: str) -> dict[str, list[int]]:
    """Each committed saga of `app` in `table`: its correlation value and its numbers."""
    engine = make_engine(database, poolclass=NullPool)
    query = text(f"SELECT correlation, data FROM {table} WHERE app = :app AND saga = :saga")
    try:
        async with engine.connect() as connection:
            result = await connection.execute(query, {"app": app, "saga": SAGA_NAME})
            rows = result.all()
    finally:
        await engine.dispose()
    return {row.correlation: STEPS_JSON.decode(row.data).numbers for row in rows}


# Parts alone, to profile.


async def spread_only() -> dict[str, float | int]:
    """The spread part, the app first."""
    return figures_of_spread(*await spread(app_first=True))


async def side_only(side: Callable[[str, str], Awaitable[Phase]]) -> dict[str, float | int]:
    """One side of the spread part on a database and a vhost of its own."""
    async with private_database() as database, private_vhost("mersal-bench-sagas") as transport:
        await create_raw_tables(database)
        phase = await side(database, transport)
    return {"events_per_s": phase.rate, "cpu_us_per_event": phase.cpu_seconds * 1e6}


async def hot_only() -> dict[str, float | int]:
    """The hot part, the app first."""
    return figures_of_hot(*await hot(app_first=True))


def main(argv: list[str]) -> int:
    """`spread`, `app-spread`, `raw-spread` or `hot`: that part (or side) alone."""
    parts: dict[str, Callable[[], Coroutine[Any, Any, dict[str, float | int]]]] = {
        "spread": spread_only,
        "app-spread": lambda: side_only(app_spread),
        "raw-spread": lambda: side_only(raw_spread),
        "hot": hot_only,
    }
    if len(argv) == 1 and argv[0] in parts:
        for key, value in loop.run(parts[argv[0]]()).items():
            print(f"{key}={value:.4g}", flush=True)
        return 0
    print("usage: python -m bench.sagas " + " | ".join(parts), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
