"""Sagas in SQL: concurrency between app instances, and one transaction with everything else.

The concurrency tests run two instances of one app (one queue on RabbitMQ, one PostgreSQL
database), each handling up to 32 messages at once, with no retry budget at all
(`RetryPolicy(immediate=0, delayed=[])`): a conflict that spent an attempt would dead-letter.
Conflicts are counted as the saga method's runs past the number of messages, and printed.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from lagom import Container
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from mersal import App, ConfigurationError, Header, RetryPolicy
from mersal.sagas import Saga, StoredSaga
from mersal.serialization import JsonCodec
from mersal.transport import Outgoing
from mersal.transport.memory import MemoryTransport
from mersal_sqlalchemy import SqlStorage, attach, make_engine
from tests.mersal_sqlalchemy.support import (
    ORDERS,
    Order,
    Ship,
    count,
    create_business_tables,
    storage_of,
)
from tests.support import Broker, DelegatingTransport, eventually

EVENTS = 100
SETTLE = 30.0
"""Seconds the 100 events may take; the whole test is meant to take about 20 s."""


@dataclass
class Open:
    key: str
    n: int = 0


@dataclass
class Add:
    key: str
    n: int


@dataclass
class Close:
    key: str


@dataclass
class Write:
    """Write a business row and send a Ship from the saga; `fail`: then raise."""

    key: str
    n: int
    fail: bool = False


@dataclass
class Tally:
    key: str = ""
    starts: list[int] = field(default_factory=list)
    values: list[int] = field(default_factory=list)


class Boom(Exception):
    """A saga method's failure on purpose."""


@dataclass
class Probe:
    """What the saga methods did across both instances and every attempt."""

    runs: Counter[str] = field(default_factory=Counter)
    barrier: int = 0
    """The first `barrier` Open runs wait until that many have begun: they race to insert."""
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    gate: asyncio.Event | None = None
    """Write waits for it (after its writes, before the commit) when set."""


class Tallies(Saga[Tally], name="tests.sagas.Tallies"):
    started_by = (Open,)
    correlation = {Open: "key", Add: "key", Close: "key", Write: "key"}

    def __init__(self, app: App, session: AsyncSession, probe: Probe) -> None:
        self.app = app
        self.session = session
        self.probe = probe

    async def open(self, message: Open) -> None:
        probe = self.probe
        probe.runs["open"] += 1
        if probe.runs["open"] <= probe.barrier:
            await eventually(
                lambda: probe.runs["open"] >= probe.barrier, "the starts began", timeout=5
            )
        self.data.key = message.key
        self.data.starts.append(message.n)

    async def add(self, message: Add) -> None:
        self.probe.runs["add"] += 1
        self.data.values.append(message.n)

    async def close(self, message: Close) -> None:
        self.probe.runs["close"] += 1
        self.mark_complete()

    async def write(self, message: Write) -> None:
        self.probe.runs["write"] += 1
        self.session.add(Order(order_id=f"{message.key}-{message.n}"))
        await self.app.send(Ship(message.n))
        self.data.values.append(message.n)
        await self.session.flush()  # the row reached the database before the failure
        if self.probe.gate is not None:
            self.probe.entered.set()
            await asyncio.wait_for(self.probe.gate.wait(), timeout=5)
        if message.fail:
            raise Boom(f"write {message.n} fails on purpose")


class LockedTallies(Tallies, name="tests.sagas.LockedTallies"):
    """The same saga, registered pessimistic: FOR UPDATE while a message is handled."""


def tally_app(
    name: str,
    transport: object,
    database: str,
    probe: Probe,
    *,
    saga: type[Tallies] = Tallies,
    pessimistic: bool = False,
) -> App:
    """One instance of the tally app: 32 at once, no retries (the error queue at once)."""
    container = Container()
    container[Probe] = probe
    app = App(
        name,
        transport=transport,  # type: ignore[arg-type]
        database=database,
        concurrency=32,
        retry=RetryPolicy(immediate=0, delayed=[], error_queue=f"{name}.error"),
        container=container,
    )
    app.register_saga(saga, pessimistic=pessimistic)
    for message_type in (Open, Add, Close, Write):
        app.route(message_type, name)
    app.route(Ship, "sink")
    # 32 messages at once share 20 connections (they wait for one in turn): two instances
    # then hold at most 40 of the PostgreSQL server's 100, which other suites share (with the
    # default pool, 2 x 45, "too many clients" dead-lettered messages here).
    attach(app, engine_options={"pool_size": 20, "max_overflow": 0})
    return app


def sender_app(name: str, transport: str, target: str) -> App:
    """A send-only app that sends the tally app's messages."""
    app = App(name, transport=transport, consume=False)
    for message_type in (Open, Add, Close, Write):
        app.route(message_type, target)
    return app


async def saga_row(app: App, saga: type[Tallies], key: str) -> StoredSaga | None:
    """The saga's committed row (id, revision, data) as the database has it."""
    return await storage_of(app).sagas.read(app.sagas.spec(saga).name, key)


async def saga_rows(storage: SqlStorage) -> int:
    """How many rows the saga table has, whatever the saga."""
    return await count(storage.engine, storage.tables.sagas)


async def settled(apps: Sequence[App]) -> bool:
    return all(app.in_flight == 0 for app in apps)


async def run_events_on_two_instances(
    broker: Broker, prefix: str, database: str, saga: type[Tallies], pessimistic: bool
) -> tuple[Tally, StoredSaga, int, float]:
    """100 Adds for one saga, sent at once to two instances; the final data and conflicts."""
    probe = Probe()
    name = f"{prefix}.tally"
    first = broker.watch(
        tally_app(name, broker.url, database, probe, saga=saga, pessimistic=pessimistic)
    )
    second = broker.watch(
        tally_app(name, broker.url, database, probe, saga=saga, pessimistic=pessimistic)
    )
    sender = broker.watch(sender_app(f"{prefix}.sender", broker.url, name))
    async with first, second, sender:
        await sender.send(Open("k-1"))
        await eventually(lambda: first.saga_data(saga, "k-1"), "the saga exists", timeout=10)
        began = time.monotonic()
        await asyncio.gather(*(sender.send(Add("k-1", n)) for n in range(EVENTS)))

        seen: list[int] = []

        async def all_added() -> Tally | None:
            data = await first.saga_data(saga, "k-1")
            seen[:] = [] if data is None else data.values
            return data if data is not None and len(data.values) >= EVENTS else None

        try:
            data = await eventually(all_added, f"{EVENTS} values in the saga", timeout=SETTLE)
        except AssertionError as error:
            raise AssertionError(
                f"{error}: {len(seen)} values after {time.monotonic() - began:.1f}s, "
                f"{probe.runs['add']} method runs ({probe.runs['add'] - len(seen)} conflicts); "
                f"in flight: {first.in_flight} + {second.in_flight}; "
                f"ready in {name}: {await broker.count(name)}"
            ) from None
        assert data is not None
        took = time.monotonic() - began
        await eventually(lambda: settled([first, second]), "both instances settled")
        row = await saga_row(first, saga, "k-1")
        assert row is not None
        assert await broker.count(f"{name}.error") == 0
        assert await saga_rows(storage_of(first)) == 1
    return data, row, probe.runs["add"] - EVENTS, took


@pytest.mark.integration
@pytest.mark.parametrize(
    ("saga", "pessimistic"),
    [(Tallies, False), (LockedTallies, True)],
    ids=["optimistic", "pessimistic"],
)
async def test_events_on_two_instances_are_all_reflected(
    broker: Broker, prefix: str, postgres_url: str, saga: type[Tallies], pessimistic: bool
) -> None:
    data, row, conflicts, took = await run_events_on_two_instances(
        broker, prefix, postgres_url, saga, pessimistic=pessimistic
    )
    locking = "pessimistic" if pessimistic else "optimistic"
    print(f"{locking}: {EVENTS} events on 2 instances in {took:.2f}s, {conflicts} conflicts")

    assert sorted(data.values) == list(range(EVENTS))  # no lost update, none applied twice
    assert row.revision == EVENTS + 1
    if pessimistic:
        assert conflicts == 0  # the row is locked while each message is handled: nothing to lose


@pytest.mark.integration
async def test_two_concurrent_starts_make_one_saga_row(
    broker: Broker, prefix: str, postgres_url: str
) -> None:
    probe = Probe(barrier=2)  # both starts load "no saga" before either inserts
    name = f"{prefix}.tally"
    first = broker.watch(tally_app(name, broker.url, postgres_url, probe))
    second = broker.watch(tally_app(name, broker.url, postgres_url, probe))
    sender = broker.watch(sender_app(f"{prefix}.sender", broker.url, name))
    async with first, second, sender:
        await asyncio.gather(sender.send(Open("k-1", 1)), sender.send(Open("k-1", 2)))

        async def both_started() -> Tally | None:
            data = await first.saga_data(Tallies, "k-1")
            return data if data is not None and len(data.starts) == 2 else None

        data = await eventually(both_started, "both starts in the saga", timeout=SETTLE)
        assert data is not None
        await eventually(lambda: settled([first, second]), "both instances settled")
        storage = storage_of(first)
        assert await saga_rows(storage) == 1
        row = await saga_row(first, Tallies, "k-1")
        assert row is not None and row.revision == 2
        assert await broker.count(f"{name}.error") == 0
        assert await count(storage.engine, storage.tables.inbox) == 2
    assert sorted(data.starts) == [1, 2]  # each start method ran once, on the same saga
    print(f"two starts: {probe.runs['open']} start method runs (a conflict reruns one)")
    assert probe.runs["open"] >= 3  # the loser of the insert ran again on the saga


@pytest.mark.integration
async def test_a_completed_saga_row_is_deleted(postgres_url: str, memory_url: str) -> None:
    probe = Probe()
    app = tally_app("tally", memory_url, postgres_url, probe)
    async with app:
        storage = storage_of(app)
        await app.send(Open("k-1"))
        await eventually(lambda: saga_rows(storage), "the saga row")
        await app.send(Close("k-1"))
        await eventually(lambda: probe.runs["close"] == 1 and app.in_flight == 0, "closed")

        assert await saga_rows(storage) == 0
        assert await app.saga_data(Tallies, "k-1") is None
        assert await count(storage.engine, storage.tables.inbox) == 2


class SinkGated(DelegatingTransport):
    """A memory transport whose sends to "sink" wait for `opened`: the outbox keeps the rows."""

    def __init__(self, url: str) -> None:
        super().__init__(MemoryTransport(url))
        self.opened = asyncio.Event()
        self.sunk: list[Outgoing] = []

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        if any(outgoing.address == "sink" for outgoing in messages):
            await asyncio.wait_for(self.opened.wait(), timeout=10)
        results = await self.inner.send_each(messages)
        self.sunk += [
            o for o, r in zip(messages, results, strict=True) if r is None and o.address == "sink"
        ]
        return results


async def outbox_to_sink(storage: SqlStorage) -> int:
    """How many outbox rows wait to go to the "sink" queue."""
    outbox = storage.tables.outbox
    return await count(storage.engine, outbox, outbox.c.address == "sink")


async def outbox_drained(storage: SqlStorage) -> bool:
    return await outbox_to_sink(storage) == 0


@pytest.mark.integration
async def test_a_failing_saga_method_commits_nothing_and_a_succeeding_one_everything(
    postgres_url: str, memory_url: str
) -> None:
    await create_business_tables(postgres_url)
    probe = Probe()
    transport = SinkGated(memory_url)
    app = tally_app("tally", transport, postgres_url, probe)
    async with app:
        await transport.declare("sink")
        storage = storage_of(app)
        engine = storage.engine
        await app.send(Open("k-1"))
        await eventually(lambda: saga_rows(storage), "the saga row")

        await app.send(Write("k-1", 1, fail=True))
        await eventually(lambda: probe.runs["write"] == 1 and app.in_flight == 0, "failed")
        assert isinstance(transport.inner, MemoryTransport)
        assert len(transport.inner.broker.queues["tally.error"].ready) == 1
        assert await count(engine, ORDERS) == 0
        assert await outbox_to_sink(storage) == 0
        row = await saga_row(app, Tallies, "k-1")
        assert row is not None and row.revision == 1
        assert await app.saga_data(Tallies, "k-1") == Tally("k-1", starts=[0])
        assert await count(engine, storage.tables.inbox) == 1  # the Open's alone

        await app.send(Write("k-1", 2))
        await eventually(lambda: probe.runs["write"] == 2 and app.in_flight == 0, "written")
        assert await count(engine, ORDERS, ORDERS.c.order_id == "k-1-2") == 1
        assert await count(engine, ORDERS) == 1
        assert await outbox_to_sink(storage) == 1
        row = await saga_row(app, Tallies, "k-1")
        assert row is not None and row.revision == 2
        assert await app.saga_data(Tallies, "k-1") == Tally("k-1", starts=[0], values=[2])
        assert await count(engine, storage.tables.inbox) == 2

        transport.opened.set()
        await eventually(lambda: outbox_drained(storage), "the Ship relayed")
    assert [o.envelope.headers[Header.TYPE] for o in transport.sunk] == [app.types.name_of(Ship)]


@pytest.mark.integration
async def test_saga_data_outbox_rows_and_inbox_row_appear_together_at_commit(
    postgres_url: str, memory_url: str
) -> None:
    await create_business_tables(postgres_url)
    probe = Probe()
    transport = SinkGated(memory_url)
    app = tally_app("tally", transport, postgres_url, probe)
    async with app:
        await transport.declare("sink")
        storage = storage_of(app)
        engine = storage.engine
        await app.send(Open("k-1"))
        await eventually(lambda: saga_rows(storage), "the saga row")
        await eventually(lambda: app.in_flight == 0, "the Open settled")

        probe.gate = asyncio.Event()
        await app.send(Write("k-1", 1))
        await asyncio.wait_for(probe.entered.wait(), timeout=5)
        # The method has written, sent and flushed; nothing is visible until the commit.
        assert await count(engine, ORDERS) == 0
        assert await outbox_to_sink(storage) == 0
        assert await count(engine, storage.tables.inbox) == 1
        row = await saga_row(app, Tallies, "k-1")
        assert row is not None and row.revision == 1

        probe.gate.set()
        await eventually(lambda: outbox_to_sink(storage), "the outbox row committed")
        assert await count(engine, ORDERS) == 1
        assert await count(engine, storage.tables.inbox) == 2
        row = await saga_row(app, Tallies, "k-1")
        assert row is not None and row.revision == 2
        transport.opened.set()
        await eventually(lambda: outbox_drained(storage), "the Ship relayed")
    assert len(transport.sunk) == 1


async def test_sqlite_concurrent_starts_make_one_saga_and_events_are_reflected(
    sqlite_url: str, memory_url: str
) -> None:
    probe = Probe()
    first = tally_app("tally", memory_url, sqlite_url, probe)
    second = tally_app("tally", memory_url, sqlite_url, probe)
    sender = sender_app("sender", memory_url, "tally")
    async with first, second, sender:
        await asyncio.gather(*(sender.send(Open("k-1", n)) for n in range(10)))

        async def started() -> Tally | None:
            data = await first.saga_data(Tallies, "k-1")
            return data if data is not None and len(data.starts) == 10 else None

        data = await eventually(started, "every start in the saga", timeout=SETTLE)
        assert data is not None
        assert sorted(data.starts) == list(range(10))
        await asyncio.gather(*(sender.send(Add("k-1", n)) for n in range(30)))

        async def added() -> Tally | None:
            data = await first.saga_data(Tallies, "k-1")
            return data if data is not None and len(data.values) >= 30 else None

        data = await eventually(added, "every event in the saga", timeout=SETTLE)
        assert data is not None
        await eventually(lambda: settled([first, second]), "both instances settled")
        storage = storage_of(first)
        assert await saga_rows(storage) == 1
        row = await saga_row(first, Tallies, "k-1")
        assert row is not None and row.revision == 40
        assert isinstance(first.transport, MemoryTransport)
        errors = first.transport.broker.queues["tally.error"]
        assert not errors.ready and not errors.unacked
    assert sorted(data.values) == list(range(30))
    print(f"sqlite: {probe.runs['open'] - 10} start and {probe.runs['add'] - 30} event conflicts")


async def test_the_saga_table_is_created_in_sqlite_with_the_inbox(sqlite_url: str) -> None:
    app = tally_app("tally", "memory://sqlite-tables", sqlite_url, Probe())
    async with app:
        storage = storage_of(app)
        assert storage.tables.sagas.name == "mersal_sagas"
    engine = make_engine(sqlite_url)
    try:
        async with engine.connect() as connection:
            query = select(func.count()).select_from(storage.tables.sagas)
            assert (await connection.execute(query)).scalar_one() == 0
    finally:
        await engine.dispose()


# What the saga store must not mistake, or let through.


@dataclass
class Place:
    key: str


class Placing(Saga[Tally], name="tests.sagas.Placing"):
    """A start method that adds a business row with a fixed id (unflushed): the second collides."""

    started_by = (Place,)
    correlation = {Place: "key"}

    def __init__(self, session: AsyncSession, probe: Probe) -> None:
        self.session = session
        self.probe = probe

    async def place(self, message: Place) -> None:
        self.probe.runs["place"] += 1
        self.session.add(Order(id=7, order_id=message.key))


async def test_a_business_integrity_error_in_a_start_method_is_a_failure_not_a_conflict(
    database: str, memory_url: str
) -> None:
    """The handler's own duplicate row is its failure: one attempt, then the error queue.

    It must not pass for a concurrent start of the saga (a ConcurrencyConflict, rerun at once
    up to 1,000 times outside the RetryPolicy): the method would run again and again.
    """
    await create_business_tables(database)
    probe = Probe()
    container = Container()
    container[Probe] = probe
    app = App(
        "placing",
        transport=memory_url,
        database=database,
        retry=RetryPolicy(immediate=0, delayed=[], error_queue="placing.error"),
        container=container,
        grace_period=0.5,
    )
    app.register_saga(Placing)
    app.route(Place, "placing")
    async with app:
        assert isinstance(app.transport, MemoryTransport)
        errors = app.transport.broker.queues["placing.error"]
        await app.send(Place("k-1"))
        await eventually(lambda: probe.runs["place"] == 1 and app.in_flight == 0, "k-1 placed")
        await app.send(Place("k-2"))  # its Order(id=7) collides with k-1's at the saga insert
        try:
            await eventually(lambda: len(errors.ready) == 1, "k-2 dead-lettered", timeout=3)
        finally:
            print(f"the colliding start method ran {probe.runs['place'] - 1} time(s)")
        [dead] = errors.ready
        assert "IntegrityError" in dead.envelope.headers[Header.ERROR_TYPE]
        assert probe.runs["place"] == 2
        assert await count(storage_of(app).engine, ORDERS) == 1
        assert await saga_rows(storage_of(app)) == 1


class LongName(Saga[Tally], name="tests.sagas." + "n" * 200):
    started_by = (Open,)
    correlation = {Open: "key"}

    async def open(self, message: Open) -> None:
        self.data.key = message.key


@pytest.mark.integration
async def test_a_saga_name_longer_than_the_table_holds_is_refused_before_any_message(
    postgres_url: str, memory_url: str
) -> None:
    """The saga column holds 200 characters: a longer name would fail every start at INSERT."""
    assert len(LongName.saga_name) > 200
    app = App("long", transport=memory_url, database=postgres_url)
    app.route(Open, "long")
    try:
        with pytest.raises(ConfigurationError) as raised:
            app.register_saga(LongName)
            await app.start()
        assert "200" in str(raised.value)
    finally:
        await app.stop()


class PrefixedCodec(JsonCodec):
    """A codec writing JSON after a fixed prefix: bytes that need not be UTF-8 text."""

    content_type = "application/x-test-prefixed"

    def __init__(self, prefix: bytes) -> None:
        super().__init__()
        self.prefix = prefix

    def encode(self, message: object) -> bytes:
        return self.prefix + super().encode(message)

    def decode(self, body: bytes, cls: type) -> Any:
        return super().decode(body[len(self.prefix) :], cls)


@pytest.mark.parametrize(
    "prefix",
    [b"\xff", b"base64:"],
    ids=["not-utf8", "utf8-starting-base64"],
)
async def test_a_codec_of_any_bytes_stores_and_loads_saga_data_in_sql(
    prefix: bytes, sqlite_url: str, memory_url: str
) -> None:
    """The Codec protocol gives bytes, not text: the saga store must give back the same bytes.

    Bytes that are not UTF-8 (msgpack's, protobuf's), and UTF-8 that happens to start the way
    the store marks its base64 ("base64:"), must both round-trip through the text column.
    """
    probe = Probe()
    container = Container()
    container[Probe] = probe
    app = App(
        "binary",
        transport=memory_url,
        database=sqlite_url,
        codec=PrefixedCodec(prefix),
        retry=RetryPolicy(immediate=0, delayed=[], error_queue="binary.error"),
        container=container,
    )
    app.register_saga(Tallies)
    app.route(Open, "binary")
    app.route(Add, "binary")
    async with app:
        assert isinstance(app.transport, MemoryTransport)
        errors = app.transport.broker.queues["binary.error"]
        await app.send(Open("k-1"))
        await eventually(
            lambda: (probe.runs["open"] or errors.ready) and app.in_flight == 0, "the Open done"
        )
        await app.send(Add("k-1", 5))  # loads the stored data, then saves it again
        await eventually(
            lambda: (probe.runs["add"] or errors.ready) and app.in_flight == 0, "the Add done"
        )

        assert [stored.envelope.headers.get(Header.ERROR_MESSAGE) for stored in errors.ready] == []
        assert await app.saga_data(Tallies, "k-1") == Tally("k-1", starts=[0], values=[5])
