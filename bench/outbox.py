"""Order chains through the SQL outbox on RabbitMQ + PostgreSQL, and the relay against aio-pika.

One run, in one process (plus two child processes for the last part), on a PostgreSQL database
and a RabbitMQ vhost of its own, both made for the run and dropped at its end:

- The chain. A "frontend" App sends `CHAINS` PlaceOrder commands (`IN_FLIGHT` sends always
  outstanding) to an "orders" App with `database=`: its handler class gets the message's
  AsyncSession injected, adds an ORM `Order` row and publishes OrderPlaced through the outbox.
  A "billing" App (no database) subscribes to OrderPlaced and counts. Chains per second run
  from the first send to the last OrderPlaced handled; the CPU time of this process per chain
  is reported beside it (every App and the relay run here).
- Latency: the orders handler registers an after-commit hook on the message's transaction
  that stamps `time.perf_counter()` under the OrderPlaced message id; billing takes now - stamp.
  So this is commit to second handler: relay wake-up, claim, confirmed publish, delivery.
  Measured at full load, at half of the rate full load reached (a paced schedule that does not
  drift, `HALF_LOAD_MESSAGES` at most, for `HALF_LOAD_SECONDS` at most), and idle: one chain at
  a time, `IDLE_PAUSE` apart, `IDLE_SAMPLES` times (a relay that waits for its poll shows here).
- The relay alone. A "relay" App's relay is stopped; `RELAY_ROWS` rows are written through
  `app.transaction()` blocks (real headers, the OrderPlaced body, sent to a durable queue);
  then `relay.flush()` is timed until it finds no row left (claim, confirmed publishes,
  delete). Raw aio-pika in the same run: the same number of persistent, mandatory, confirmed
  publishes of messages with the same headers and body to the same queue, with as many in
  flight as the relay's batch (a window that stays full). Successive runs alternate which goes
  first; the queue is purged between them.
- Two instances. Two processes (`python -m bench.outbox relay-instance NAME`) start an App of
  the same name on the same database (taken from MERSAL_DATABASE / MERSAL_TRANSPORT), each with
  its own relay and LISTEN. Once both are up, this process writes `TWIN_ROWS` outbox rows for
  that app in one transaction with one NOTIFY, which wakes both relays at once; a raw aio-pika
  consumer counts each message id that reaches the queue. Duplicates = deliveries - distinct
  ids (must be 0); missing = rows - distinct ids (must be 0); the smaller share is the part of
  the rows the less busy instance published (both relays took part when it is above 0).
- The pre-seeded chain, against two hand-written chains. On a second database and vhost of
  their own (every side fresh and alike), `SEEDED` PlaceOrder commands are sent to the orders
  queue before the orders App starts; the same orders handler (no after-commit stamp) and a
  billing App that counts. Chains per second run from the orders app's start to the last
  OrderPlaced handled; CPU per chain is this process's over the same interval. The raw chain,
  the physical floor, does the same durable steps with asyncpg and aio-pika and no Mersal code
  on the way (`RawOrders`): the same number of commands waiting in a queue of its own, consumed
  with manual acks at the app's default prefetch and concurrency; per command one transaction
  writes the order, an outbox and an inbox row (tables shaped like ours); a relay claims outbox
  rows with a lease (FOR UPDATE SKIP LOCKED), publishes them persistent, mandatory and
  confirmed, and deletes the confirmed ones; a consumer counts the events, each id once. The
  ORM chain is the raw chain with its business part written with the libraries a user's
  handler uses (`orm_rows`): per command one SQLAlchemy AsyncSession (the asyncpg driver, a
  pool sized like the app's) adds the ORM `Order` row, writes the inbox and outbox rows with
  `session.execute(insert(...))` on the same transaction and commits; its relay, consumer,
  acks, prefetch and concurrency are the raw chain's. Its `Order` rows go to the app's
  `orders` table, so it runs on a third database (the same tables, as fresh). Both are timed
  the same way: from connecting to the last event counted. Successive runs rotate which of the
  three sides goes first.

Environment: MERSAL_BENCH_POSTGRES (default `postgresql+asyncpg://postgres@127.0.0.1:5432`,
a server where that user may create databases) and MERSAL_BENCH_RABBITMQ_HOST (127.0.0.1;
`rabbitmqctl` makes the vhost, so run as root on the RabbitMQ host).

`python -m bench.outbox chain` runs only the setup, a warm-up and the full-load chain, and prints
its figures: the thing to profile. `python -m bench.outbox seeded` (the pre-seeded orders app),
`python -m bench.outbox orm-chain` (the ORM chain) and `python -m bench.outbox raw-chain` (the
raw chain) do the same for one side of the pre-seeded part; `python -m bench.outbox pair` runs
its three sides once and prints the app's ratios to the other two.

- Grown tables. The pre-seeded chain on a fresh database, then again on the same database
  after `GROWN_INBOX` ids of the orders app went into the inbox and `GROWN_BACKLOG` rows of
  another app into the outbox (VACUUM ANALYZE after, as autovacuum would): the grown rate as a
  ratio of the empty one (`python -m bench.outbox grown` alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import itertools
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple

import aio_pika
import aiormq
import asyncpg  # type: ignore[import-untyped]
import msgspec
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractIncomingMessage
from sqlalchemy import String, func, insert, select, table, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.pool import NullPool

from bench.support import (
    CONCURRENCY,
    PHASE_TIMEOUT,
    PREFETCH,
    QUEUE_TYPE,
    Phase,
    Tally,
    asyncpg_dsn,
    percentile_ms,
    private_vhost,
)
from mersal import App, MessageContext, loop, message
from mersal.messages import Envelope, Header
from mersal.transport import Outgoing
from mersal_sqlalchemy import SqlStorage, attach, make_engine, make_tables
from mersal_sqlalchemy.cli import upgrade
from mersal_sqlalchemy.outbox import write_outbox
from mersal_sqlalchemy.storage import engine_defaults

CHAINS = 5_000
IN_FLIGHT = 128
WARM_UP = 300
HALF_LOAD_MESSAGES = 3_000
HALF_LOAD_SECONDS = 20.0
IDLE_SAMPLES = 50
IDLE_PAUSE = 0.05
RELAY_ROWS = 5_000
FILL_PER_TRANSACTION = 500
TWIN_ROWS = 2_000
TWIN_GRACE = 1.0
"""Seconds to keep counting after every id arrived, for copies that come late."""

SEEDED = 2_000
GROWN_INBOX = 1_000_000
GROWN_BACKLOG = 100_000
"""PlaceOrder commands waiting in the queue when the pre-seeded orders app (or raw chain) starts."""

RELAY_BATCH: int = inspect.signature(attach).parameters["relay_batch"].default
LEASE: float = inspect.signature(attach).parameters["lease"].default
POLL_INTERVAL: float = inspect.signature(attach).parameters["poll_interval"].default
APP_POOL: dict[str, Any] = engine_defaults("postgresql", CONCURRENCY)
"""The orders app's engine options on PostgreSQL (its pool), which the ORM chain copies."""
POSTGRES = os.environ.get("MERSAL_BENCH_POSTGRES", "postgresql+asyncpg://postgres@127.0.0.1:5432")
ROOT = Path(__file__).resolve().parent.parent

_runs = itertools.count()
"""Runs so far in this process: odd runs time raw aio-pika before the relay; the pre-seeded
part's sides take turns going first."""


@message("bench.PlaceOrder.v1")
@dataclass
class PlaceOrder:
    """The command that starts a chain."""

    order_id: str
    amount: float


@message("bench.OrderPlaced.v1")
@dataclass
class OrderPlaced:
    """The event the orders handler publishes through the outbox."""

    order_id: str
    amount: float


class Base(DeclarativeBase):
    """The business tables of the benchmark's orders service."""


class Order(Base):
    """One placed order: the business row written beside the outbox row."""

    __tablename__ = "orders"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    amount: Mapped[float]


async def run() -> dict[str, float | int]:
    """Every phase on a database and a vhost of the run's own, gone afterwards."""
    number = next(_runs)
    raw_first = number % 2 == 1
    async with private_database() as database, private_vhost("mersal-bench-outbox") as transport:
        async with Chain(database, transport) as chain:
            await chain.full_load(WARM_UP)
            full = await chain.full_load(CHAINS)
            half_rate = full.rate / 2
            half = await chain.half_load(half_rate)
            idle = await chain.idle(IDLE_SAMPLES)
        relay, raw = await relay_against_raw(database, transport, raw_first=raw_first)
        twins = await two_instances(database, transport)
    sides = await seeded_against_raw(rotation=number)
    empty, grown = await grown_against_empty()
    return {
        "outbox_chain_msgs_per_s": full.rate,
        "outbox_chain_cpu_ms": full.cpu_seconds * 1e3,
        "outbox_full_load_p50_ms": percentile_ms(full.latencies, 50),
        "outbox_full_load_p99_ms": percentile_ms(full.latencies, 99),
        "outbox_half_load_msgs_per_s": half_rate,
        "outbox_half_load_p50_ms": percentile_ms(half.latencies, 50),
        "outbox_half_load_p99_ms": percentile_ms(half.latencies, 99),
        "outbox_idle_p50_ms": percentile_ms(idle.latencies, 50),
        "outbox_idle_p99_ms": percentile_ms(idle.latencies, 99),
        "relay_rows_per_s": relay,
        "raw_publish_confirmed_per_s": raw,
        "relay_ratio_to_raw": relay / raw,
        "two_instances_duplicates": twins.duplicates,
        "two_instances_missing": twins.missing,
        "two_instances_smaller_share": twins.smaller_share,
        **seeded_figures(sides),
        "outbox_grown_chains_per_s": grown.rate,
        "outbox_grown_ratio_to_empty": grown.rate / empty.rate,
    }


# The chain.


class Chain:
    """frontend -> PlaceOrder -> orders (ORM row + OrderPlaced via the outbox) -> billing."""

    def __init__(self, database: str, transport: str) -> None:
        self.commits: dict[str, float] = {}
        """perf_counter() at the orders commit, by OrderPlaced message id."""
        self.tally = Tally(0, "chains reached billing")
        self.orders = App("orders", transport=transport, database=database)
        self.storage = attach(self.orders)
        self.billing = App("billing", transport=transport)
        self.frontend = App("frontend", transport=transport)
        self.orders.register(PlaceOrder, placing_orders(self.commits))
        self.billing.register(OrderPlaced, self.count)
        self.billing.subscribe(OrderPlaced)
        self.frontend.route(PlaceOrder, "orders")
        self._apps = AsyncExitStack()

    async def count(self, message: OrderPlaced, context: MessageContext) -> None:
        """Billing's handler: the chain is complete."""
        committed = self.commits.pop(context.message_id, None)
        now = time.perf_counter()
        self.tally.record(None if committed is None else now - committed)

    async def __aenter__(self) -> Chain:
        async with self.storage.engine.begin() as connection:
            await connection.run_sync(Base.metadata.create_all)
        async with AsyncExitStack() as apps:
            for app in (self.billing, self.orders, self.frontend):
                await apps.enter_async_context(app)
            self._apps = apps.pop_all()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._apps.aclose()

    async def place(self) -> None:
        """Start one chain: a confirmed send of PlaceOrder to the orders queue."""
        await self.frontend.send(PlaceOrder(uuid.uuid4().hex, 9.5))

    async def full_load(self, count: int) -> Phase:
        """`count` chains with `IN_FLIGHT` sends always outstanding."""
        tally = self.tally = Tally(count, "chains reached billing")
        numbers = itertools.count()

        async def sender() -> None:
            while next(numbers) < count:
                await self.place()

        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(sender() for _ in range(min(IN_FLIGHT, count))))
        await tally.wait()
        return tally.phase(started, cpu)

    async def half_load(self, rate: float) -> Phase:
        """Chains started at a steady `rate` per second, on a schedule that does not drift."""
        count = max(1, min(HALF_LOAD_MESSAGES, round(rate * HALF_LOAD_SECONDS)))
        tally = self.tally = Tally(count, "chains reached billing")
        interval = 1.0 / rate
        sends: list[asyncio.Task[None]] = []
        started, cpu = time.perf_counter(), time.process_time()
        due = started
        for _ in range(count):
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sends.append(asyncio.create_task(self.place()))
            due += interval  # from the schedule, not from now: a late send does not shift the rest
        await asyncio.gather(*sends)
        await tally.wait()
        return tally.phase(started, cpu)

    async def idle(self, samples: int) -> Phase:
        """One chain at a time, `IDLE_PAUSE` seconds between the end of one and the next."""
        latencies: list[float] = []
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(samples):
            await asyncio.sleep(IDLE_PAUSE)
            tally = self.tally = Tally(1, "chains reached billing")
            await self.place()
            await tally.wait()
            latencies.extend(tally.latencies)
        elapsed = time.perf_counter() - started
        return Phase(samples / elapsed, latencies, (time.process_time() - cpu) / samples)


def placing_orders(commits: dict[str, float] | None = None) -> type:
    """The orders handler class, stamping its commits into `commits` (if given)."""

    class PlaceOrderHandler:
        """Adds the order row and publishes OrderPlaced: both commit together, or neither."""

        def __init__(self, app: App, context: MessageContext, session: AsyncSession) -> None:
            self.app, self.context, self.session = app, context, session

        async def __call__(self, message: PlaceOrder) -> None:
            self.session.add(Order(id=message.order_id, amount=message.amount))
            message_id = await self.app.publish(OrderPlaced(message.order_id, message.amount))
            if commits is None:
                return

            async def stamp() -> None:
                commits[message_id] = time.perf_counter()

            self.context.transaction.after_commit(stamp)

    return PlaceOrderHandler


# The relay alone, and raw aio-pika.


async def relay_against_raw(
    database: str, transport: str, *, raw_first: bool
) -> tuple[float, float]:
    """Rows per second the relay sends from a full outbox; raw confirmed publishes per second."""
    sink = "relay-sink"
    app = App("relay", transport=transport, database=database)
    storage = attach(app)
    app.route(OrderPlaced, sink)
    connection = await aio_pika.connect(transport)
    try:
        channel = await connection.channel(publisher_confirms=True)
        queue = await channel.declare_queue(
            sink, durable=True, arguments={"x-queue-type": QUEUE_TYPE}
        )
        async with app:
            relay = storage.relay
            assert relay is not None
            await relay.stop()  # the loop would start on the rows as they commit; time flush()
            sample = await fill(app, 100)
            await relay.flush()  # warm-up: the statements and the publishing channel
            await queue.purge()
            rates: dict[str, float] = {}
            for side in ("raw", "relay") if raw_first else ("relay", "raw"):
                if side == "relay":
                    rates[side] = await relay_rate(app, storage)
                else:
                    rates[side] = await raw_rate(channel, sink, sample, RELAY_ROWS)
                await queue.purge()
        return rates["relay"], rates["raw"]
    finally:
        await connection.close()


async def fill(app: App, rows: int) -> Envelope:
    """Commit `rows` OrderPlaced sends as outbox rows (the relay is stopped); the last envelope."""
    last = Envelope({}, b"")
    written = 0
    while written < rows:
        batch = min(FILL_PER_TRANSACTION, rows - written)
        async with app.transaction() as transaction:
            for _ in range(batch):
                await app.send(OrderPlaced(uuid.uuid4().hex, 9.5))
            last = transaction.outgoing[-1].envelope
        written += batch
    return last


async def relay_rate(app: App, storage: SqlStorage) -> float:
    """Fill the outbox with `RELAY_ROWS` rows, then time the (stopped) relay sending them all."""
    relay = storage.relay
    assert relay is not None
    await fill(app, RELAY_ROWS)
    started = time.perf_counter()
    published = await relay.flush()
    elapsed = time.perf_counter() - started
    left = await storage.pending()
    if published != RELAY_ROWS or left:
        raise RuntimeError(f"the relay published {published} of {RELAY_ROWS} rows, {left} left")
    return RELAY_ROWS / elapsed


async def raw_rate(
    channel: aio_pika.abc.AbstractChannel, queue: str, sample: Envelope, count: int
) -> float:
    """Confirmed persistent publishes per second of messages shaped like `sample`."""
    exchange = channel.default_exchange
    headers = sample.headers
    numbers = itertools.count()

    async def publisher() -> None:
        while next(numbers) < count:
            message_id = str(uuid.uuid4())
            amqp = aio_pika.Message(
                sample.body,
                headers={**headers, Header.MESSAGE_ID: message_id},
                message_id=message_id,
                correlation_id=message_id,
                type=headers.get(Header.TYPE),
                reply_to=headers.get(Header.REPLY_TO),
                content_type=headers.get(Header.CONTENT_TYPE),
                timestamp=time.time(),
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
            await exchange.publish(amqp, routing_key=queue, mandatory=True)

    started = time.perf_counter()
    await asyncio.gather(*(publisher() for _ in range(min(RELAY_BATCH, count))))
    return count / (time.perf_counter() - started)


# Two instances of one app on one outbox table.


@dataclass
class Twins:
    """What reached the broker from two relays sharing one outbox table."""

    duplicates: int
    missing: int
    smaller_share: float


async def two_instances(database: str, transport: str) -> Twins:
    """Two processes relay one app's rows from one table; count what reaches the queue."""
    name, sink = "twins", "twins-sink"
    deliveries: Counter[str] = Counter()
    arrived = asyncio.Event()

    async def received(message: AbstractIncomingMessage) -> None:
        deliveries[message.message_id or ""] += 1
        if len(deliveries) >= TWIN_ROWS:
            arrived.set()

    environment = {**os.environ, "MERSAL_DATABASE": database, "MERSAL_TRANSPORT": transport}
    engine = make_engine(database, poolclass=NullPool)
    tables = make_tables()
    connection = await aio_pika.connect(transport)
    instances: list[asyncio.subprocess.Process] = []
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(
            sink, durable=True, arguments={"x-queue-type": QUEUE_TYPE}
        )
        await queue.consume(received, no_ack=True)
        for _ in range(2):
            instances.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "bench.outbox",
                    "relay-instance",
                    name,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    cwd=ROOT,
                    env=environment,
                )
            )
        for instance in instances:
            await expect_line(instance, "ready")
        rows = [twin_row(sink) for _ in range(TWIN_ROWS)]
        async with engine.begin() as database_connection:  # one transaction, one NOTIFY
            await write_outbox(database_connection, tables.outbox, name, rows, tables.channel)
        try:
            async with asyncio.timeout(PHASE_TIMEOUT):
                await arrived.wait()
                await drained(engine, name)
        except TimeoutError:
            pass  # reported as missing
        await asyncio.sleep(TWIN_GRACE)
        published = []
        for instance in instances:
            assert instance.stdin is not None
            instance.stdin.write(b"stop\n")
            await instance.stdin.drain()
        for instance in instances:
            published.append(int((await expect_line(instance, "published")).split()[1]))
            await instance.wait()
        ids = {message_id for message_id in deliveries if message_id}
        return Twins(
            duplicates=sum(deliveries.values()) - len(ids),
            missing=TWIN_ROWS - len(ids),
            smaller_share=min(published) / TWIN_ROWS,
        )
    finally:
        for instance in instances:
            if instance.returncode is None:
                instance.kill()
                await instance.wait()
        await connection.close()
        await engine.dispose()


def twin_row(queue: str) -> Outgoing:
    """An outgoing OrderPlaced to `queue`, with the headers the app would have given it."""
    message_id = str(uuid.uuid4())
    headers = {
        Header.MESSAGE_ID: message_id,
        Header.TYPE: "bench.OrderPlaced.v1",
        Header.CORRELATION_ID: message_id,
        Header.SENT_AT: f"{time.time():.6f}",
        Header.CONTENT_TYPE: "application/json",
        Header.SOURCE: "twins",
        Header.REPLY_TO: "twins",
    }
    return Outgoing(
        queue, Envelope(headers, b'{"order_id":"%s","amount":9.5}' % message_id.encode())
    )


async def drained(engine: AsyncEngine, app: str) -> None:
    """Until none of `app`'s rows is left in the outbox."""
    outbox = make_tables().outbox
    query = select(func.count()).select_from(outbox).where(outbox.c.app == app)
    while True:
        async with engine.connect() as connection:
            if not (await connection.execute(query)).scalar_one():
                return
        await asyncio.sleep(0.05)


async def expect_line(instance: asyncio.subprocess.Process, word: str) -> str:
    """The child's next line, which must start with `word`."""
    assert instance.stdout is not None
    async with asyncio.timeout(60):
        line = (await instance.stdout.readline()).decode().strip()
    if not line.startswith(word):
        raise RuntimeError(f"relay instance {instance.pid} said {line!r}, not {word!r}")
    return line


async def relay_instance(name: str) -> None:
    """A child process: App `name` (database and transport from the environment) relaying.

    Prints `ready` once started, stops when a line (or EOF) arrives on stdin, then prints
    `published N`, how many rows its relay sent.
    """
    app = App(name)
    storage = attach(app)
    async with app:
        relay = storage.relay
        assert relay is not None
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
    print(f"published {relay.published}", flush=True)


# The pre-seeded chain, and the raw chain.

RAW_APP = "raw-orders"
"""The raw chain's command queue, and its name in the outbox and inbox rows."""
RAW_BILLING = "raw-billing"
RAW_EVENTS = "raw.events"
"""The raw chain's topic exchange for events (Mersal's is `mersal.events`)."""
COMMAND_TYPE = "bench.PlaceOrder.v1"
EVENT_TYPE = "bench.OrderPlaced.v1"
RETRY_DELAY = timedelta(seconds=1)
"""How long a row the broker did not confirm waits before the raw relay tries it again."""

RAW_TABLES = make_tables("raw_outbox", "raw_inbox")
"""The raw chain's outbox and inbox: ours, under other names (same columns and indexes)."""
RAW_ORDERS = Base.metadata.tables["orders"].to_metadata(RAW_TABLES.metadata, name="raw_orders")
"""The raw chain's orders table: `orders` under another name, beside the outbox and inbox."""

INSERT_INBOX = (
    "INSERT INTO raw_inbox (app, message_id) VALUES ($1, $2) "
    "ON CONFLICT DO NOTHING RETURNING message_id"
)
INSERT_ORDER = "INSERT INTO raw_orders (id, amount) VALUES ($1, $2)"
INSERT_OUTBOX = (
    "INSERT INTO raw_outbox (app, address, publish, headers, body) VALUES ($1, $2, $3, $4, $5)"
)
CLAIM = """
UPDATE raw_outbox SET lease_until = now() + $3::interval, attempts = attempts + 1
WHERE id IN (
    SELECT id FROM raw_outbox
    WHERE app = $1 AND parked_at IS NULL AND (lease_until IS NULL OR lease_until < now())
    ORDER BY id LIMIT $2
    FOR UPDATE SKIP LOCKED
)
RETURNING id, address, publish, headers, body
"""
ORM_INBOX = (
    postgresql.insert(RAW_TABLES.inbox)
    .on_conflict_do_nothing()
    .returning(RAW_TABLES.inbox.c.message_id)
)
ORM_OUTBOX = insert(RAW_TABLES.outbox)
"""The ORM chain's inserts of the inbox and outbox rows: the raw chain's, as SQLAlchemy Core."""
DELETE_SENT = "DELETE FROM raw_outbox WHERE id = ANY($1::bigint[])"
RELEASE = "UPDATE raw_outbox SET lease_until = now() + $2::interval WHERE id = ANY($1::bigint[])"

PROPERTIES = frozenset(("message-id", "correlation-id", "type", "reply-to", "content-type"))
"""Headers that travel as AMQP properties (as Mersal sends them); the rest as AMQP headers."""


class RawCommand(msgspec.Struct):
    """PlaceOrder as the raw chain reads it."""

    order_id: str
    amount: float


class RawEvent(msgspec.Struct):
    """OrderPlaced as the raw chain writes and reads it."""

    order_id: str
    amount: float


JSON = msgspec.json.Encoder()
COMMAND_JSON = msgspec.json.Decoder(RawCommand)
EVENT_JSON = msgspec.json.Decoder(RawEvent)
HEADERS_JSON = msgspec.json.Decoder(dict[str, str])

Commit = Callable[[AbstractIncomingMessage], Awaitable[None]]
"""One command's rows in one transaction (none for a copy of a command handled already)."""
Rows = Callable[[str], AbstractAsyncContextManager[Commit]]
"""A hand-written chain's business part: its `Commit`, connected to a database (asyncpg DSN)."""
SIDES = ("app", "orm", "raw")
"""The pre-seeded part's sides, in the order the first run takes them."""


class Arrivals:
    """The distinct message ids that reached the end of a chain, and any copies."""

    def __init__(self, expected: int) -> None:
        self.tally = Tally(expected, "chains reached the end")
        self.ids: set[str] = set()
        self.copies = 0

    def record(self, message_id: str) -> None:
        """Count a delivery: a new id completes a chain, a known one is a copy."""
        if message_id in self.ids:
            self.copies += 1
            return
        self.ids.add(message_id)
        self.tally.record(None)

    def phase(self, started: float, cpu: float) -> Phase:
        """The phase's figures; a `RuntimeError` if any event arrived twice."""
        if self.copies:
            raise RuntimeError(f"{self.copies} events arrived more than once")
        return self.tally.phase(started, cpu)


class Seeded(NamedTuple):
    """What the pre-seeded part measured on each side."""

    app: Phase
    orm: Phase
    raw: Phase


async def seeded_against_raw(*, rotation: int) -> Seeded:
    """The pre-seeded orders app, the ORM chain and the raw chain, from `SIDES[rotation % 3]` on."""
    async with (
        private_database() as database,
        private_database() as orm_database,
        private_vhost("mersal-bench-seeded") as transport,
    ):
        await create_business_tables(database)
        await create_business_tables(orm_database)
        chains = {"app": seeded_chain, "orm": orm_chain, "raw": raw_chain}
        databases = {"app": database, "orm": orm_database, "raw": database}
        start = rotation % len(SIDES)
        phases: dict[str, Phase] = {}
        for side in SIDES[start:] + SIDES[:start]:
            phases[side] = await chains[side](databases[side], transport)
    return Seeded(**phases)


def seeded_figures(sides: Seeded) -> dict[str, float | int]:
    """Each side's chains per second and CPU ms per chain, and the app's rate to the others'."""
    return {
        "outbox_seeded_chains_per_s": sides.app.rate,
        "outbox_seeded_cpu_ms_per_chain": sides.app.cpu_seconds * 1e3,
        "orm_chain_per_s": sides.orm.rate,
        "orm_cpu_ms_per_chain": sides.orm.cpu_seconds * 1e3,
        "raw_chain_per_s": sides.raw.rate,
        "raw_cpu_ms_per_chain": sides.raw.cpu_seconds * 1e3,
        "outbox_seeded_ratio_to_orm_chain": sides.app.rate / sides.orm.rate,
        "outbox_seeded_ratio_to_raw_chain": sides.app.rate / sides.raw.rate,
    }


async def create_business_tables(database: str) -> None:
    """The orders table, and the hand-written chains' orders, outbox and inbox tables."""
    engine = make_engine(database, poolclass=NullPool)
    try:
        async with engine.begin() as connection:
            await connection.run_sync(Base.metadata.create_all)
            await connection.run_sync(RAW_TABLES.metadata.create_all)
    finally:
        await engine.dispose()


async def expect_rows(database: str, expected: dict[str, int]) -> None:
    """A `RuntimeError` unless each table holds the expected number of rows."""
    engine = make_engine(database, poolclass=NullPool)
    try:
        async with engine.connect() as connection:
            for name, rows in expected.items():
                query = select(func.count()).select_from(table(name))
                found = (await connection.execute(query)).scalar_one()
                if found != rows:
                    raise RuntimeError(f"table {name} holds {found} rows, not {rows}")
    finally:
        await engine.dispose()


async def expect_sent(database: str, app: str) -> None:
    """A `RuntimeError` if any outbox row of `app` is left."""
    engine = make_engine(database, poolclass=NullPool)
    try:
        async with engine.connect() as connection:
            query = text("SELECT count(*) FROM mersal_outbox WHERE app = :app")
            left = (await connection.execute(query, {"app": app})).scalar_one()
    finally:
        await engine.dispose()
    if left:
        raise RuntimeError(f"{left} outbox rows of {app} were not sent")


async def send_all(send: Callable[[], Awaitable[object]], count: int) -> None:
    """Call `send` `count` times, `IN_FLIGHT` calls always outstanding."""
    numbers = itertools.count()

    async def sender() -> None:
        while next(numbers) < count:
            await send()

    await asyncio.gather(*(sender() for _ in range(min(IN_FLIGHT, count))))


async def delete_queues(transport: str, queues: list[str], exchanges: list[str]) -> None:
    """Delete a phase's queues and exchanges, with whatever they still hold."""
    connection = await aio_pika.connect(transport)
    try:
        channel = await connection.channel()
        for queue in queues:
            await channel.queue_delete(queue)
        for exchange in exchanges:
            await channel.exchange_delete(exchange)
    finally:
        await connection.close()


# The pre-seeded orders app.


async def seeded_chain(database: str, transport: str) -> Phase:
    """`SEEDED` commands wait in the orders queue; time a fresh orders app through them."""
    arrivals = Arrivals(SEEDED)

    async def count(message: OrderPlaced, context: MessageContext) -> None:
        arrivals.record(context.message_id)

    billing = App("billing", transport=transport)
    billing.register(OrderPlaced, count)
    billing.subscribe(OrderPlaced)
    orders = App("orders", transport=transport, database=database)
    orders.register(PlaceOrder, placing_orders())
    queues = [orders.name, billing.name, "frontend", orders.retry.error_queue]
    try:
        async with billing:
            await seed_orders(transport, orders.name)
            gc.collect()
            started, cpu = time.perf_counter(), time.process_time()
            async with orders:
                await arrivals.tally.wait()
    finally:
        await delete_queues(transport, queues, [])
    await expect_rows(database, {"orders": SEEDED})
    await expect_sent(database, "orders")
    return arrivals.phase(started, cpu)


async def seed_orders(transport: str, queue: str) -> None:
    """`SEEDED` PlaceOrder commands sent (confirmed) to `queue`, declared as its app would."""
    frontend = App("frontend", transport=transport)
    frontend.route(PlaceOrder, queue)
    async with frontend:
        await frontend.transport.declare(queue)
        await send_all(lambda: frontend.send(PlaceOrder(uuid.uuid4().hex, 9.5)), SEEDED)


# The hand-written chains: aio-pika and asyncpg (or SQLAlchemy), no Mersal code on the way.


async def raw_chain(database: str, transport: str) -> Phase:
    """The physical floor: `RawOrders` writing its rows on bare asyncpg."""
    return await hand_written_chain(database, transport, asyncpg_rows, RAW_ORDERS.name)


async def orm_chain(database: str, transport: str) -> Phase:
    """`RawOrders` writing its rows as a user's handler would, through a SQLAlchemy session."""
    return await hand_written_chain(database, transport, orm_rows, Order.__tablename__)


async def hand_written_chain(database: str, transport: str, rows: Rows, orders: str) -> Phase:
    """`SEEDED` commands wait in the raw queue; time `RawOrders` on `rows` through them."""
    arrivals = Arrivals(SEEDED)
    dsn = asyncpg_dsn(database)
    connection = await aio_pika.connect(transport)  # the seeding and billing side's
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        await declare_raw_topology(channel)
        await seed_raw(channel)
        counting = await connection.channel()
        await counting.set_qos(prefetch_count=PREFETCH)
        await (await counting.get_queue(RAW_BILLING)).consume(counter(arrivals))
        gc.collect()
        started, cpu = time.perf_counter(), time.process_time()
        async with raw_orders(dsn, transport, rows):
            await arrivals.tally.wait()
    finally:
        await connection.close()
        await delete_queues(transport, [RAW_APP, RAW_BILLING], [RAW_EVENTS])
    await expect_rows(database, {orders: SEEDED, "raw_inbox": SEEDED, "raw_outbox": 0})
    return arrivals.phase(started, cpu)


async def declare_raw_topology(channel: AbstractChannel) -> None:
    """The command queue, the events exchange and the billing queue bound to OrderPlaced."""
    events = await channel.declare_exchange(RAW_EVENTS, aio_pika.ExchangeType.TOPIC, durable=True)
    await channel.declare_queue(RAW_APP, durable=True, arguments={"x-queue-type": QUEUE_TYPE})
    billing = await channel.declare_queue(
        RAW_BILLING, durable=True, arguments={"x-queue-type": QUEUE_TYPE}
    )
    await billing.bind(events, routing_key=EVENT_TYPE)


async def seed_raw(channel: AbstractChannel) -> None:
    """`SEEDED` PlaceOrder commands, persistent, mandatory and confirmed, into the raw queue."""
    exchange = channel.default_exchange

    async def send() -> None:
        message_id = str(uuid.uuid4())
        amqp = aio_pika.Message(
            JSON.encode(RawCommand(uuid.uuid4().hex, 9.5)),
            headers={"sent-at": f"{time.time():.6f}", "source": "frontend"},
            message_id=message_id,
            correlation_id=message_id,
            type=COMMAND_TYPE,
            reply_to="frontend",
            content_type="application/json",
            timestamp=time.time(),
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        await exchange.publish(amqp, routing_key=RAW_APP, mandatory=True)

    await send_all(send, SEEDED)


def counter(arrivals: Arrivals) -> Callable[[AbstractIncomingMessage], Awaitable[None]]:
    """The raw billing consumer: decode the event, count its id, ack."""

    async def count(message: AbstractIncomingMessage) -> None:
        EVENT_JSON.decode(message.body)
        arrivals.record(message.message_id or "")
        await message.ack()

    return count


@asynccontextmanager
async def raw_orders(dsn: str, transport: str, rows: Rows) -> AsyncIterator[RawOrders]:
    """`RawOrders` on `rows`, connected, relaying and consuming; stopped and disconnected after."""
    async with AsyncExitStack() as stack:
        commit = await stack.enter_async_context(rows(dsn))
        relay_connection = await asyncpg.connect(dsn)
        stack.push_async_callback(relay_connection.close)
        connection = await aio_pika.connect(transport)
        stack.push_async_callback(connection.close)
        publishing = await connection.channel(publisher_confirms=True, on_return_raises=True)
        events = await publishing.get_exchange(RAW_EVENTS)
        orders = RawOrders(commit, relay_connection, publishing, events)
        orders.start_relay()
        stack.push_async_callback(orders.stop_relay)
        consuming = await connection.channel()
        stack.push_async_callback(consuming.close)
        await consuming.set_qos(prefetch_count=PREFETCH)
        await (await consuming.get_queue(RAW_APP)).consume(orders.handle)
        yield orders


class RawOrders:
    """The orders service by hand: each command's rows in one transaction, then a relay.

    A command (at most `CONCURRENCY` at once): `commit` writes, in one transaction, the inbox
    row (a copy handled already is acked with nothing written), the order and the OrderPlaced
    outbox row (`asyncpg_rows` or `orm_rows`); then ack, wake the relay. The relay claims up
    to `RELAY_BATCH` rows with a lease, publishes them all with confirms and deletes the
    confirmed ones (the others wait `RETRY_DELAY`), until none is left; then it waits to be
    woken, or `POLL_INTERVAL`.
    """

    def __init__(
        self,
        commit: Commit,
        relay_connection: Any,
        publishing: AbstractChannel,
        events: AbstractExchange,
    ) -> None:
        self.commit = commit
        self.relay_connection = relay_connection
        self.publishing = publishing
        self.events = events
        self.slots = asyncio.Semaphore(CONCURRENCY)
        self.wake = asyncio.Event()
        self.stopping = False
        self.unconfirmed = 0
        self._relay: asyncio.Task[None] | None = None

    async def handle(self, message: AbstractIncomingMessage) -> None:
        """One command: commit its rows, ack, wake the relay; nack (requeue) if that fails."""
        async with self.slots:
            try:
                await self.commit(message)
            except Exception:
                await message.nack(requeue=True)
                raise
            await message.ack()
            self.wake.set()

    def start_relay(self) -> None:
        """Run the relay loop in the background."""
        self._relay = asyncio.create_task(self.relay(), name="raw-relay")

    async def stop_relay(self) -> None:
        """Stop the relay once it has sent what waits."""
        self.stopping = True
        self.wake.set()
        if self._relay is not None:
            await self._relay

    async def relay(self) -> None:
        """Send rows until none is left, whenever woken or every `POLL_INTERVAL` seconds."""
        while True:
            self.wake.clear()
            while rows := await self.claim():
                await self.send(rows)
            if self.stopping:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_INTERVAL):
                    await self.wake.wait()

    async def claim(self) -> list[Any]:
        """Lease up to `RELAY_BATCH` unsent rows (committed at once), oldest first."""
        lease = timedelta(seconds=LEASE)
        rows = await self.relay_connection.fetch(CLAIM, RAW_APP, RELAY_BATCH, lease)
        return sorted(rows, key=itemgetter("id"))

    async def send(self, rows: list[Any]) -> None:
        """Publish the rows at once; delete the confirmed ones, put the others back for later."""
        results = await asyncio.gather(*map(self.publish, rows), return_exceptions=True)
        outcomes = list(zip(rows, results, strict=True))
        sent = [row["id"] for row, result in outcomes if result is None]
        failed = [row["id"] for row, result in outcomes if result is not None]
        if sent:
            await self.relay_connection.execute(DELETE_SENT, sent)
        if failed:
            await self.relay_connection.execute(RELEASE, failed, RETRY_DELAY)
            self.unconfirmed += len(failed)

    async def publish(self, row: Any) -> None:
        """One row, persistent and mandatory; returns once the broker has confirmed it."""
        headers = HEADERS_JSON.decode(row["headers"])
        amqp = aio_pika.Message(
            row["body"],
            headers={key: value for key, value in headers.items() if key not in PROPERTIES},
            message_id=headers.get("message-id"),
            correlation_id=headers.get("correlation-id"),
            type=headers.get("type"),
            reply_to=headers.get("reply-to"),
            content_type=headers.get("content-type"),
            timestamp=float(headers["sent-at"]),
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        exchange = self.events if row["publish"] else self.publishing.default_exchange
        confirmation = await exchange.publish(amqp, routing_key=row["address"], mandatory=True)
        if not isinstance(confirmation, aiormq.spec.Basic.Ack):
            raise RuntimeError(f"outbox row {row['id']} was not confirmed: {confirmation!r}")


@asynccontextmanager
async def asyncpg_rows(dsn: str) -> AsyncIterator[Commit]:
    """The raw chain's rows: three statements on bare asyncpg, a pool of `CONCURRENCY`."""
    pool = await asyncpg.create_pool(dsn, min_size=CONCURRENCY, max_size=CONCURRENCY)

    async def commit(message: AbstractIncomingMessage) -> None:
        """The inbox row, the order and the OrderPlaced outbox row, in one transaction."""
        command = COMMAND_JSON.decode(message.body)
        headers, body = raw_event(command, message)
        async with pool.acquire() as connection, connection.transaction():
            if await connection.fetchval(INSERT_INBOX, RAW_APP, message.message_id) is None:
                return  # a copy of a command handled already
            await connection.execute(INSERT_ORDER, command.order_id, command.amount)
            await connection.execute(INSERT_OUTBOX, RAW_APP, EVENT_TYPE, True, headers, body)

    try:
        yield commit
    finally:
        await pool.close()


@asynccontextmanager
async def orm_rows(dsn: str) -> AsyncIterator[Commit]:
    """The ORM chain's rows: one AsyncSession per command, on an engine pooled like the app's."""
    url = make_url(dsn).set(drivername="postgresql+asyncpg")
    engine = create_async_engine(url, **APP_POOL)
    sessions = async_sessionmaker(engine, expire_on_commit=False)

    async def commit(message: AbstractIncomingMessage) -> None:
        """The inbox row, the ORM order and the OrderPlaced outbox row, on the session's commit."""
        command = COMMAND_JSON.decode(message.body)
        headers, body = raw_event(command, message)
        async with sessions() as session:
            inbox = {"app": RAW_APP, "message_id": message.message_id}
            if (await session.execute(ORM_INBOX, inbox)).first() is None:
                return  # a copy of a command handled already (closing the session rolls back)
            session.add(Order(id=command.order_id, amount=command.amount))
            outbox = {"app": RAW_APP, "address": EVENT_TYPE, "publish": True}
            await session.execute(ORM_OUTBOX, {**outbox, "headers": headers, "body": body})
            await session.commit()

    try:
        yield commit
    finally:
        await engine.dispose()


def raw_event(command: RawCommand, cause: AbstractIncomingMessage) -> tuple[str, bytes]:
    """The OrderPlaced outbox row's headers (JSON text, as ours) and body for a command."""
    message_id = str(uuid.uuid4())
    headers = {
        "message-id": message_id,
        "type": EVENT_TYPE,
        "correlation-id": cause.correlation_id or message_id,
        "causation-id": cause.message_id or "",
        "sent-at": f"{time.time():.6f}",
        "content-type": "application/json",
        "source": RAW_APP,
        "reply-to": RAW_APP,
    }
    return JSON.encode(headers).decode(), JSON.encode(RawEvent(command.order_id, command.amount))


async def grown_against_empty() -> tuple[Phase, Phase]:
    """The pre-seeded chain on empty tables, then on tables grown large, on one database."""
    async with private_database() as database, private_vhost("mersal-bench-grown") as transport:
        await create_business_tables(database)
        empty = await seeded_chain(database, transport)
        await grow_tables(database)
        await drop_orders(database)
        grown = await seeded_chain(database, transport)
    return empty, grown


async def grow_tables(database: str) -> None:
    """`GROWN_INBOX` ids of the orders app in the inbox, `GROWN_BACKLOG` rows of another app
    waiting in the outbox (which the orders relay leaves alone); then ANALYZE, as autovacuum
    would."""
    engine = make_engine(database, poolclass=NullPool)
    try:
        async with engine.begin() as connection:
            await connection.execute(
                text(
                    "INSERT INTO mersal_inbox (app, message_id, handled_at) "
                    "SELECT 'orders', md5(n::text), now() - (n % 1000) * interval '10 minutes' "
                    f"FROM generate_series(1, {GROWN_INBOX}) AS n"
                )
            )
            await connection.execute(
                text(
                    "INSERT INTO mersal_outbox (app, address, publish, headers, body) "
                    "SELECT 'stock', 'StockReserved', true, '{}', '\\x00'::bytea "
                    f"FROM generate_series(1, {GROWN_BACKLOG}) AS n"
                )
            )
        autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        async with autocommit.connect() as connection:
            await connection.execute(text("VACUUM ANALYZE mersal_inbox"))
            await connection.execute(text("VACUUM ANALYZE mersal_outbox"))
    finally:
        await engine.dispose()


async def drop_orders(database: str) -> None:
    """Empty the orders table, so that the second chain writes the same rows again."""
    engine = make_engine(database, poolclass=NullPool)
    try:
        async with engine.begin() as connection:
            await connection.execute(text("DELETE FROM orders"))
    finally:
        await engine.dispose()


# The database and the vhost.


@asynccontextmanager
async def private_database() -> AsyncIterator[str]:
    """The URL of a new, migrated PostgreSQL database; dropped (connections and all) afterwards."""
    name = f"mersal_bench_{uuid.uuid4().hex}"
    admin = create_async_engine(
        f"{POSTGRES}/postgres", isolation_level="AUTOCOMMIT", poolclass=NullPool
    )
    try:
        async with admin.connect() as connection:
            await connection.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            url = f"{POSTGRES}/{name}"
            await asyncio.to_thread(upgrade, url)
            yield url
        finally:
            async with admin.connect() as connection:
                await connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        await admin.dispose()


async def chain_only() -> dict[str, float | int]:
    """The setup, a warm-up and one full-load chain: what to profile."""
    async with (
        private_database() as database,
        private_vhost("mersal-bench-outbox") as transport,
        Chain(database, transport) as chain,
    ):
        await chain.full_load(WARM_UP)
        full = await chain.full_load(CHAINS)
    return {
        "outbox_chain_msgs_per_s": full.rate,
        "outbox_chain_cpu_ms": full.cpu_seconds * 1e3,
        "outbox_full_load_p50_ms": percentile_ms(full.latencies, 50),
        "outbox_full_load_p99_ms": percentile_ms(full.latencies, 99),
    }


async def seeded_only() -> dict[str, float | int]:
    """The pre-seeded orders app alone: what to profile."""
    async with private_database() as database, private_vhost("mersal-bench-seeded") as transport:
        await create_business_tables(database)
        phase = await seeded_chain(database, transport)
    return {
        "outbox_seeded_chains_per_s": phase.rate,
        "outbox_seeded_cpu_ms_per_chain": phase.cpu_seconds * 1e3,
    }


async def raw_only() -> dict[str, float | int]:
    """The raw chain alone: what to profile beside it."""
    phase = await hand_written_only(raw_chain)
    return {"raw_chain_per_s": phase.rate, "raw_cpu_ms_per_chain": phase.cpu_seconds * 1e3}


async def orm_only() -> dict[str, float | int]:
    """The ORM chain alone: what to profile beside the raw chain."""
    phase = await hand_written_only(orm_chain)
    return {"orm_chain_per_s": phase.rate, "orm_cpu_ms_per_chain": phase.cpu_seconds * 1e3}


async def hand_written_only(chain: Callable[[str, str], Awaitable[Phase]]) -> Phase:
    """One hand-written chain on a database and a vhost of its own."""
    async with private_database() as database, private_vhost("mersal-bench-seeded") as transport:
        await create_business_tables(database)
        return await chain(database, transport)


async def pair_only() -> dict[str, float | int]:
    """The pre-seeded orders app, the ORM chain, then the raw chain, and the app's ratios."""
    return seeded_figures(await seeded_against_raw(rotation=0))


async def grown_only() -> dict[str, float | int]:
    """The pre-seeded chain on empty tables and on grown ones, and the ratio of their rates."""
    empty, grown = await grown_against_empty()
    return {
        "outbox_seeded_chains_per_s": empty.rate,
        "outbox_grown_chains_per_s": grown.rate,
        "outbox_grown_cpu_ms_per_chain": grown.cpu_seconds * 1e3,
        "outbox_grown_ratio_to_empty": grown.rate / empty.rate,
    }


def main(argv: list[str]) -> int:
    """`relay-instance NAME` (a child of the two-instance phase), or a part alone to profile."""
    if argv[:1] == ["relay-instance"] and len(argv) == 2:
        loop.run(relay_instance(argv[1]))
        return 0
    parts = {
        "chain": chain_only,
        "seeded": seeded_only,
        "orm-chain": orm_only,
        "raw-chain": raw_only,
        "pair": pair_only,
        "grown": grown_only,
    }
    if len(argv) == 1 and argv[0] in parts:
        for key, value in loop.run(parts[argv[0]]()).items():
            print(f"{key}={value:.4g}", flush=True)
        return 0
    print(
        "usage: python -m bench.outbox relay-instance NAME | " + " | ".join(parts),
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
