"""Helpers for the SQL storage tests: a business table, the apps, a broker sink, counting, outbox
rows as stored, and databases the release before migrated."""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]
from lagom import Container
from sqlalchemy import String, Table, func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from mersal import App, Header, RetryPolicy
from mersal.messages import Envelope
from mersal.transport import Outgoing
from mersal.transport.memory import MemoryTransport
from mersal_sqlalchemy import SqlStorage, attach, make_engine
from tests.support import DelegatingTransport


class Base(DeclarativeBase):
    """The test's own (business) tables."""


class Order(Base):
    """A business row that a handler writes."""

    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    order_id: Mapped[str] = mapped_column(String(50))


ORDERS: Table = Order.__table__  # type: ignore[assignment]


@dataclass
class PlaceOrder:
    """A command the orders app handles."""

    order_id: str
    fail: bool = False


@dataclass
class OrderPlaced:
    """The event the orders app publishes for each order."""

    order_id: str


@dataclass
class Ship:
    """A command the tests send to the "sink" queue."""

    n: int


class Boom(Exception):
    """A handler failure on purpose."""


@dataclass
class Probe:
    """What the handlers saw."""

    calls: int = 0
    billed: list[str] = field(default_factory=list)
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    gate: asyncio.Event | None = None


class PlaceOrderHandler:
    """Adds an order row and publishes OrderPlaced; raises afterwards for `fail=True`."""

    def __init__(self, app: App, session: AsyncSession, probe: Probe) -> None:
        self.app = app
        self.session = session
        self.probe = probe

    async def __call__(self, message: PlaceOrder) -> None:
        """Handle one order."""
        self.probe.calls += 1
        self.probe.entered.set()
        if self.probe.gate is not None:
            await self.probe.gate.wait()
        self.session.add(Order(order_id=message.order_id))
        await self.app.publish(OrderPlaced(message.order_id))
        if message.fail:
            await self.session.flush()  # the row reached the database before the failure
            raise Boom(f"order {message.order_id} fails on purpose")


def orders_app(
    database: str | None,
    transport: Any,
    probe: Probe,
    **options: Any,
) -> App:
    """The orders app: one attempt, then the error queue; `options` go to `attach`."""
    container = Container()
    container[Probe] = probe
    app = App(
        "orders",
        transport=transport,
        database=database,
        retry=RetryPolicy(immediate=0, delayed=[], error_queue="error"),
        container=container,
    )
    app.register(PlaceOrder, PlaceOrderHandler)
    app.route(PlaceOrder, "orders")
    app.route(Ship, "sink")
    if options:
        attach(app, **options)
    return app


def billing_app(transport: str, probe: Probe) -> App:
    """The billing app (no database): records every OrderPlaced."""
    app = App("billing", transport=transport)

    async def bill(message: OrderPlaced) -> None:
        probe.billed.append(message.order_id)

    app.register(OrderPlaced, bill)
    app.subscribe(OrderPlaced)
    return app


def storage_of(app: App) -> SqlStorage:
    """The app's SQL storage."""
    assert isinstance(app.storage, SqlStorage)
    return app.storage


async def create_business_tables(database: str) -> None:
    """Create the test's business tables in `database`."""
    engine = make_engine(database)
    try:
        async with engine.begin() as connection:
            await connection.run_sync(Base.metadata.create_all)
    finally:
        await engine.dispose()


async def execute(database: str, *statements: str) -> None:
    """Run SQL statements in one transaction."""
    engine = make_engine(database)
    try:
        async with engine.begin() as connection:
            for statement in statements:
                await connection.execute(text(statement))
    finally:
        await engine.dispose()


async def count(engine: AsyncEngine, table: Table, *where: Any) -> int:
    """How many rows of `table` match `where`."""
    query = select(func.count()).select_from(table).where(*where)
    async with engine.connect() as connection:
        return int((await connection.execute(query)).scalar_one())


async def outbox_empty(storage: SqlStorage) -> bool:
    """Whether the app has no outbox rows waiting."""
    return await storage.pending() == 0


class Sink:
    """Records what reaches the memory broker of `url`, and keeps a "sink" queue."""

    def __init__(self, url: str) -> None:
        self.transport = MemoryTransport(url)
        self.seen: list[Outgoing] = []

    async def start(self, *queues: str) -> Sink:
        """Declare the queues and start recording."""
        await self.transport.start()
        for queue in ("sink", *queues):
            await self.transport.declare(queue)
        self.transport.broker.observers.append(self.seen.append)
        return self

    def ids(self, address: str = "sink") -> list[str]:
        """The message ids that reached `address`, in order."""
        return [o.envelope.headers[Header.MESSAGE_ID] for o in self.seen if o.address == address]

    def duplicates(self, address: str = "sink") -> dict[str, int]:
        """Message ids that reached `address` more than once, with how often."""
        return {k: n for k, n in Counter(self.ids(address)).items() if n > 1}

    def queue_settled(self, name: str) -> bool:
        """Whether `name` has nothing ready and nothing unacknowledged."""
        queue = self.transport.broker.queues[name]
        return not queue.ready and not queue.unacked


class FlakyTransport(DelegatingTransport):
    """A memory transport whose `send` fails with ConnectionError the first `failures` times."""

    def __init__(self, url: str, failures: int) -> None:
        super().__init__(MemoryTransport(url))
        self.failures = failures
        self.failed = 0

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        """Fail while failures are left, then send."""
        if self.failed < self.failures:
            self.failed += 1
            raise ConnectionError("the broker is down (on purpose)")
        return await self.inner.send_each(messages)


def envelope_of(app: App, message: object, message_id: str) -> Envelope:
    """The envelope `app` would send for `message`, with the given id."""
    headers = {
        Header.MESSAGE_ID: message_id,
        Header.TYPE: app.types.name_of(type(message)),
        Header.CONTENT_TYPE: app.codec.content_type,
    }
    return Envelope(headers, app.codec.encode(message))


@dataclass(frozen=True)
class Ran:
    """What a command printed, and its exit status."""

    code: int
    out: str
    err: str

    @property
    def said(self) -> str:
        """The `mersal: ...` line it printed on stderr (Alembic's log lines left out)."""
        lines = [line for line in self.err.splitlines() if line.startswith("mersal: ")]
        assert len(lines) == 1, self.err
        return lines[0]


async def run_process(command: Sequence[str], cwd: Path, **environment: str) -> Ran:
    """Run `command` in `cwd` in a process of its own, without the MERSAL_ variables."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("MERSAL_")}
    done = await asyncio.to_thread(
        subprocess.run,
        list(command),
        cwd=cwd,
        env={**inherited, **environment},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return Ran(done.returncode, done.stdout, done.stderr)


# The test's own view of the outbox table.


def unique_name(what: str) -> str:
    """An app or queue name no other test uses."""
    return f"{what}-{uuid.uuid4().hex[:10]}"


@dataclass
class Stored:
    """An outbox row as the table holds it."""

    id: int
    address: str
    headers: str
    parked_reason: str | None
    parked_at: object
    leased: bool
    attempts: int


async def stored_rows(engine: AsyncEngine, table: Table) -> dict[int, Stored]:
    """Every row of the outbox table, by id; `leased` if its lease lies in the future."""
    now = func.now() if engine.dialect.name == "postgresql" else func.datetime("now")
    leased = table.c.lease_until.is_not(None) & (table.c.lease_until > now)
    query = select(
        table.c.id,
        table.c.address,
        table.c.headers,
        table.c.parked_reason,
        table.c.parked_at,
        leased.label("leased"),
        table.c.attempts,
    ).order_by(table.c.id)
    async with engine.connect() as connection:
        return {
            record.id: Stored(
                record.id,
                record.address,
                record.headers,
                record.parked_reason,
                record.parked_at,
                bool(record.leased),
                record.attempts,
            )
            for record in await connection.execute(query)
        }


async def unparked(engine: AsyncEngine, table: Table) -> int:
    """How many rows wait to be sent (neither sent nor parked)."""
    return sum(row.parked_at is None for row in (await stored_rows(engine, table)).values())


def none_waiting(engine: AsyncEngine, table: Table) -> Any:
    """A predicate: no row of the outbox waits to be sent."""

    async def check() -> bool:
        return await unparked(engine, table) == 0

    return check


# Databases as the release before per-pair version tables migrated them (the files in data/).

DATA = Path(__file__).parent / "data"


async def migrate_as_before(database: str, name: str) -> None:
    """Run `data/legacy_<name>.sql` (what that release's `mersal db upgrade` ran) on PostgreSQL."""
    url = make_url(database).set(drivername="postgresql").render_as_string(hide_password=False)
    connection = await asyncpg.connect(url, timeout=5)
    try:
        await connection.execute((DATA / f"legacy_{name}.sql").read_text())
    finally:
        await connection.close()
