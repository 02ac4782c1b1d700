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

Environment: MERSAL_BENCH_POSTGRES (default `postgresql+asyncpg://postgres@127.0.0.1:5432`,
a server where that user may create databases) and MERSAL_BENCH_RABBITMQ_HOST (127.0.0.1;
`rabbitmqctl` makes the vhost, so run as root on the RabbitMQ host).

`python -m bench.outbox chain` runs only the setup, a warm-up and the full-load chain, and prints
its figures: the thing to profile.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aio_pika
from aio_pika.abc import AbstractIncomingMessage
from sqlalchemy import String, func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.pool import NullPool

from bench.support import PHASE_TIMEOUT, Phase, Tally, percentile_ms, private_vhost
from mersal import App, MessageContext, message
from mersal.messages import Envelope, Header
from mersal.transport import Outgoing
from mersal_sqlalchemy import SqlStorage, attach, make_engine, make_tables
from mersal_sqlalchemy.cli import upgrade
from mersal_sqlalchemy.outbox import write_outbox

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

RELAY_BATCH: int = inspect.signature(attach).parameters["relay_batch"].default
POSTGRES = os.environ.get("MERSAL_BENCH_POSTGRES", "postgresql+asyncpg://postgres@127.0.0.1:5432")
ROOT = Path(__file__).resolve().parent.parent

_runs = itertools.count()
"""Runs so far in this process: odd runs time raw aio-pika before the relay."""


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
    async with private_database() as database, private_vhost("mersal-bench-outbox") as transport:
        async with Chain(database, transport) as chain:
            await chain.full_load(WARM_UP)
            full = await chain.full_load(CHAINS)
            half_rate = full.rate / 2
            half = await chain.half_load(half_rate)
            idle = await chain.idle(IDLE_SAMPLES)
        relay, raw = await relay_against_raw(database, transport, raw_first=next(_runs) % 2 == 1)
        twins = await two_instances(database, transport)
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


def placing_orders(commits: dict[str, float]) -> type:
    """The orders handler class, stamping its commits into `commits`."""

    class PlaceOrderHandler:
        """Adds the order row and publishes OrderPlaced: both commit together, or neither."""

        def __init__(self, app: App, context: MessageContext, session: AsyncSession) -> None:
            self.app, self.context, self.session = app, context, session

        async def __call__(self, message: PlaceOrder) -> None:
            self.session.add(Order(id=message.order_id, amount=message.amount))
            message_id = await self.app.publish(OrderPlaced(message.order_id, message.amount))

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
            sink, durable=True, arguments={"x-queue-type": "classic"}
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
            sink, durable=True, arguments={"x-queue-type": "classic"}
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


def main(argv: list[str]) -> int:
    """`relay-instance NAME` (a child of the two-instance phase) or `chain` (for profiling)."""
    if argv[:1] == ["relay-instance"] and len(argv) == 2:
        asyncio.run(relay_instance(argv[1]))
        return 0
    if argv == ["chain"]:
        for key, value in asyncio.run(chain_only()).items():
            print(f"{key}={value:.4g}", flush=True)
        return 0
    print("usage: python -m bench.outbox relay-instance NAME | chain", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
