"""The relay parks the outbox rows that can never go, and sends every other row once.

Rows that can never go (written by an older version, by hand, refused by the transport's limits
or by the broker itself) are parked with a reason while every other row of their batch leaves
once; a reply to a requester that is gone is dropped, not parked; a dead letter with thousands
of headers leaves once; what a hostile producer puts in a message id or reply address never
turns into a database error; rows the broker keeps refusing are tried again without holding
back the rows behind them; and once an operator deals with the parked rows the app is healthy
again. On RabbitMQ and PostgreSQL, and on SQLite with the memory transport where no broker is
needed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Any

import aio_pika
import pytest
from sqlalchemy import Table, select
from sqlalchemy.ext.asyncio import AsyncEngine

from mersal import App, Header, MersalError, MessageContext, RetryPolicy, message
from mersal.errors import RequestTimeout
from mersal.messages import Envelope
from mersal.transport import Outgoing
from mersal.transport.memory import MemoryTransport
from mersal_sqlalchemy import SqlStorage, attach
from tests.mersal_sqlalchemy.support import (
    Sink,
    Stored,
    none_waiting,
    stored_rows,
    unique_name,
)
from tests.support import Broker, DelegatingTransport, Recorder, eventually, mersal

SHIP = "tests.relay.Ship.v1"


@message(SHIP)
@dataclass
class Ship:
    """A command sent through the outbox to the sink queue."""

    n: int


@message("tests.relay.Ask.v1")
@dataclass
class Ask:
    """A request the replier answers through its outbox."""

    n: int
    hold: bool = False


@message("tests.relay.Answer.v1")
@dataclass
class Answer:
    """The reply to Ask."""

    n: int


@message("tests.relay.Lost.v1")
@dataclass
class Lost:
    """A command routed to a queue nobody declared."""

    n: int


@message("tests.relay.Poison.v1")
@dataclass
class Poison:
    """A command whose handler always fails."""

    n: int


def storage_of(app: App) -> SqlStorage:
    """The app's SQL storage."""
    assert isinstance(app.storage, SqlStorage)
    return app.storage


# Outbox rows written straight into the table, as an older version or an operator might.


@dataclass(frozen=True)
class Row:
    """An outbox row to insert as it is, and (for a bad one) what its parking reason must say."""

    label: str
    address: str
    headers: str
    body: bytes = b'{"n": 1}'
    publish: bool = False
    reason: str | None = None
    """None for a row that must leave; else a fragment of the reason it must be parked with."""


def headers_json(message_id: str, **extra: Any) -> str:
    """The stored headers of a Ship with this id, and `extra` (any JSON values)."""
    headers = {
        Header.MESSAGE_ID: message_id,
        Header.TYPE: SHIP,
        Header.CONTENT_TYPE: "application/json",
    }
    return json.dumps({**headers, **extra})


def good(sink: str, n: int, **extra: Any) -> Row:
    """A row that must reach `sink` once."""
    return Row(f"good-{n}", sink, headers_json(f"good-{n}", **extra), b'{"n": %d}' % n)


def bad_rows(sink: str, nowhere: str, max_body: int) -> list[Row]:
    """One row per way a row can never go, each with what its parking reason must name."""
    far = f"{time.time() + 5_000_000:.6f}"
    return [
        Row("value-not-a-string", sink, headers_json("bad-1", x={"a": 1}), reason="strings"),
        Row("headers-a-list", sink, json.dumps(["message-id", "bad-2"]), reason="strings"),
        Row("headers-not-json", sink, '{"message-id": "bad-3", ', reason="strings"),
        Row("reserved-cc", sink, headers_json("bad-4", CC=sink), reason="'CC' is reserved"),
        Row("reserved-bcc", sink, headers_json("bad-5", BCC=sink), reason="'BCC' is reserved"),
        Row("lone-surrogate", sink, headers_json("bad-16", x="\ud800"), reason="strings"),
        Row("empty-name", sink, headers_json("bad-17", **{"": "v"}), reason="header name ''"),
        Row("long-name", sink, headers_json("bad-6", **{"n" * 129: "v"}), reason="128"),
        Row("over-frame", sink, headers_json("bad-7", x="h" * 130_000), reason="headers take"),
        Row("far-delay", sink, headers_json("bad-8", **{Header.DELIVER_AT: far}), reason="delay"),
        Row(
            "word-delay", sink, headers_json("bad-14", **{Header.DELIVER_AT: "soon"}), reason="time"
        ),
        Row(
            "nan-delay", sink, headers_json("bad-15", **{Header.DELIVER_AT: "nan"}), reason="finite"
        ),
        Row("long-address", "q" * 256, headers_json("bad-9"), reason="256 bytes long"),
        Row("empty-address", "", headers_json("bad-10"), reason="not a non-empty string"),
        Row("big-body", sink, headers_json("bad-11"), b"x" * (max_body + 1), reason="body of"),
        Row(
            "long-type-published",
            "t" * 300,
            headers_json("bad-12", type="t" * 300),
            publish=True,
            reason="topic name is 300 bytes long",
        ),
        Row("unroutable", nowhere, headers_json("bad-13"), reason="Unroutable"),
    ]


def mixed_batch(sink: str, nowhere: str, max_body: int) -> list[Row]:
    """Good rows before, between and after the bad ones, in one batch."""
    bad = bad_rows(sink, nowhere, max_body)
    rows = [good(sink, n) for n in range(5)]
    for index, row in enumerate(bad):
        rows.append(row)
        if index % 4 == 3:
            rows.append(good(sink, 100 + index))
    rows.append(good(sink, 200, **{Header.REPLY_TO: "r" * 300}))  # carried as a header
    rows.append(good(sink, 201, type="y" * 300))  # a send (not a publish) carries it too
    soon, past = f"{time.time() + 0.5:.6f}", f"{time.time() - 60:.6f}"
    rows.append(good(sink, 202, **{Header.DELIVER_AT: soon}))  # through a wait queue
    rows.append(good(sink, 203, **{Header.DELIVER_AT: past}))
    rows += [good(sink, n) for n in range(5, 10)]
    return rows


async def insert_rows(
    engine: AsyncEngine, table: Table, app: str, rows: Sequence[Row]
) -> list[int]:
    """Insert the rows as they are, in one transaction; their ids, in order."""
    values = [
        {
            "app": app,
            "address": row.address,
            "publish": row.publish,
            "headers": row.headers,
            "body": row.body,
        }
        for row in rows
    ]
    async with engine.begin() as connection:
        result = await connection.execute(table.insert().returning(table.c.id), values)
        return sorted(result.scalars().all())


def check_parking(rows: Sequence[Row], ids: Sequence[int], stored: dict[int, Stored]) -> None:
    """Every bad row is parked with its reason, unleased; no good row is left."""
    for row, row_id in zip(rows, ids, strict=True):
        if row.reason is None:
            assert row_id not in stored, f"good row {row.label} is still in the outbox"
            continue
        assert row_id in stored, f"bad row {row.label} was deleted, not parked"
        kept = stored[row_id]
        assert kept.parked_at is not None, f"bad row {row.label} is not parked: {kept}"
        assert kept.parked_reason is not None and row.reason in kept.parked_reason, (
            row.label,
            kept.parked_reason,
        )
        assert not kept.leased, f"parked row {row.label} is still leased"
    assert set(stored) == {i for row, i in zip(rows, ids, strict=True) if row.reason}


def recording_app(broker: Broker, name: str, url: str, database: str) -> tuple[App, list[int]]:
    """An app (watched by `broker`) that records the Ship messages it handles."""
    app = broker.watch(App(name, transport=url, database=database))
    attach(app, poll_interval=0.2)
    handled: list[int] = []

    async def ship(message: Ship) -> None:
        handled.append(message.n)

    app.register(Ship, ship)
    return app, handled


async def still_handles(broker: Broker, app: App, handled: list[int]) -> None:
    """The app still consumes: a Ship published raw to its queue is handled."""
    before = len(handled)
    outgoing = aio_pika.Message(
        b'{"n": -1}', message_id=str(uuid.uuid4()), type=SHIP, content_type="application/json"
    )
    await broker.publish(outgoing, app.name)
    await eventually(lambda: len(handled) > before, "the app still handles messages", timeout=10)
    assert handled[before:] == [-1]


# Rows that cannot go are parked with their reason; the rest of their batch leaves once.


@pytest.mark.integration
@pytest.mark.timeout(90)
async def test_rows_that_cannot_go_are_parked_and_the_rest_of_their_batch_leaves_once(
    postgres_url: str, amqp_url: str, broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    name = unique_name("judge")
    sink = await broker.declare(f"{name}.sink", durable=True)
    nowhere = f"{name}.nobody"
    app = broker.watch(App(name, transport=amqp_url, database=postgres_url))
    attach(app, poll_interval=0.2)
    received = await broker.record(sink)
    async with app:
        transport = app.transport
        transport.limits = dataclasses.replace(transport.limits, max_body_bytes=1_000)
        storage = storage_of(app)
        engine, table = storage.engine, storage.tables.outbox
        rows = mixed_batch(sink, nowhere, 1_000)
        ids = await insert_rows(engine, table, name, rows)
        storage.wake()
        good_ids = [json.loads(row.headers)[Header.MESSAGE_ID] for row in rows if not row.reason]
        await eventually(
            lambda: all(received.ids[i] for i in good_ids), "every good row leaves", timeout=10
        )
        await eventually(none_waiting(engine, table), "no row is left unparked", timeout=10)
        bad = [row for row in rows if row.reason]
        relay = storage.relay
        assert relay is not None
        await eventually(lambda: relay.parked_rows == len(bad), "parked rows counted", timeout=5)
        marker = await relay_moved_on(storage, name, sink, lambda: received.ids)
        assert not app.healthy, "parked rows must make the app unhealthy"
        check_parking(rows, ids, await stored_rows(engine, table))
        assert received.duplicates() == {}
        assert set(received.ids) == {*good_ids, marker}
        assert received.messages["good-200"].headers[Header.REPLY_TO] == "r" * 300
        assert received.messages["good-201"].headers[Header.TYPE] == "y" * 300

        # The operator's view: every parked row is listed, and the command exits 1.
        parked_ids = [i for row, i in zip(rows, ids, strict=True) if row.reason]
        await list_parked(postgres_url, parked_ids, capsys)

        # Retry: the unroutable row goes once its queue exists.
        unroutable = ids[rows.index(next(row for row in rows if row.label == "unroutable"))]
        await broker.declare(nowhere, durable=True)
        arrived = await broker.record(nowhere)
        assert await mersal("outbox", "retry", str(unroutable), "--database", postgres_url) == 0
        await eventually(lambda: arrived.ids["bad-13"] == 1, "the retried row leaves", timeout=10)
        parked_ids.remove(unroutable)
        await retry_and_purge(postgres_url, app, parked_ids, capsys)
    assert received.duplicates() == {}
    assert arrived.ids == Counter({"bad-13": 1})


async def relay_moved_on(
    storage: SqlStorage, app: str, sink: str, arrived: Callable[[], Container[str]]
) -> str:
    """Relay one more row to `sink`, wait until it arrived and left the outbox; its message id.

    The relay works through its passes one after another and deletes a row once the broker has
    it, so when this row is through, every send of an earlier row reached `sink` before it: a row
    of an earlier batch sent again would have arrived by now.
    """
    marker = f"marker-{uuid.uuid4().hex[:8]}"
    engine, table = storage.engine, storage.tables.outbox
    await insert_rows(engine, table, app, [Row(marker, sink, headers_json(marker))])
    storage.wake()
    await eventually(lambda: marker in arrived(), "a row relayed after the batch", timeout=10)
    await eventually(none_waiting(engine, table), "the later row deleted", timeout=10)
    return marker


@pytest.mark.timeout(30)
async def test_rows_that_cannot_go_are_parked_without_a_broker(
    database: str, memory_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    sink = await Sink(memory_url).start()
    name = "judge"
    transport = MemoryTransport(memory_url)
    transport.limits = dataclasses.replace(transport.limits, max_body_bytes=1_000)
    app = App(name, transport=transport, database=database)
    attach(app, poll_interval=0.2)
    async with app:
        storage = storage_of(app)
        engine, table = storage.engine, storage.tables.outbox
        rows = mixed_batch("sink", "nobody", 1_000)
        ids = await insert_rows(engine, table, name, rows)
        storage.wake()
        good_ids = [json.loads(row.headers)[Header.MESSAGE_ID] for row in rows if not row.reason]
        await eventually(none_waiting(engine, table), "no row is left unparked", timeout=10)
        relay = storage.relay
        assert relay is not None
        bad = [row for row in rows if row.reason]
        await eventually(lambda: relay.parked_rows == len(bad), "parked rows counted", timeout=5)
        marker = await relay_moved_on(storage, name, "sink", sink.ids)
        check_parking(rows, ids, await stored_rows(engine, table))
        assert not app.healthy
        parked_ids = [i for row, i in zip(rows, ids, strict=True) if row.reason]
        await list_parked(database, parked_ids, capsys)
        await retry_and_purge(database, app, parked_ids, capsys)
    assert sorted(sink.ids()) == sorted([*good_ids, marker])
    assert sink.duplicates() == {}


async def list_parked(
    database: str, parked_ids: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    """`mersal outbox list --parked` lists exactly these rows and exits 1."""
    capsys.readouterr()
    assert await mersal("outbox", "list", "--parked", "--database", database) == 1
    listed = capsys.readouterr().out.splitlines()
    assert sorted(int(line.split()[0]) for line in listed[1:-1]) == parked_ids
    assert listed[-1] == f"{len(parked_ids)} parked outbox row(s)"


async def retry_and_purge(
    database: str, app: App, parked_ids: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    """`retry --all` un-parks the rows and the relay parks them again; `purge` deletes them."""
    storage = storage_of(app)
    engine, table, relay = storage.engine, storage.tables.outbox, storage.relay
    assert relay is not None
    before = await stored_rows(engine, table)
    capsys.readouterr()
    assert await mersal("outbox", "retry", "--all", "--database", database) == 0
    assert capsys.readouterr().out.startswith(f"un-parked {len(parked_ids)} row(s)")

    async def parked_again() -> bool:
        stored = await stored_rows(engine, table)
        return set(stored) == set(parked_ids) and all(
            stored[i].parked_at is not None and stored[i].attempts == before[i].attempts + 1
            for i in parked_ids
        )

    await eventually(parked_again, "the relay parks the retried rows again", timeout=10)
    assert await mersal("outbox", "purge", *map(str, parked_ids), "--database", database) == 0
    assert await stored_rows(engine, table) == {}
    assert await mersal("outbox", "list", "--database", database) == 0
    await eventually(lambda: relay.parked_rows == 0, "the relay counts none", timeout=5)
    assert app.healthy


def check_unknown_outcomes(received: Recorder, before_refused: set[str]) -> None:
    """Only rows published before the refused one on its channel may arrive twice, at most.

    RabbitMQ answers the refused publish by closing the channel, which loses the confirms it
    still owed for the publishes before it (it had routed them): their outcome is unknown, so
    they are sent again (the receivers' inboxes drop the copy). The rows after it were dropped
    with the channel and leave once.
    """
    duplicates = received.duplicates()
    assert set(duplicates) <= before_refused, duplicates
    assert all(n == 2 for n in duplicates.values()), duplicates


BROKER_MAX_MESSAGE = 134_217_728
"""RabbitMQ's default max_message_size, which this broker keeps (it is not lowered for tests)."""


@pytest.mark.integration
@pytest.mark.parametrize(
    "refused",
    [
        pytest.param("reserved header", marks=pytest.mark.timeout(60)),
        pytest.param("body over the broker's limit", marks=pytest.mark.timeout(90)),
    ],
)
async def test_a_row_the_broker_refuses_is_parked_not_sent_again_and_its_batch_leaves_once(
    postgres_url: str, amqp_url: str, broker: Broker, refused: str
) -> None:
    name = unique_name("refused")
    sink = await broker.declare(f"{name}.sink", durable=True)
    app, handled = recording_app(broker, name, amqp_url, postgres_url)
    received = await broker.record(sink)
    async with app:
        transport = app.transport
        if refused == "reserved header":
            # Let the CC header past the transport's own check: RabbitMQ closes the channel on it.
            transport.limits = dataclasses.replace(transport.limits, reserved_headers=frozenset())
            bad = Row("cc-for-the-broker", sink, headers_json("bad-cc", CC=sink))
            goods, wait = 20, 10.0
        else:
            # The transport believes the broker takes more than it does: the broker must refuse it.
            transport.limits = dataclasses.replace(
                transport.limits, max_body_bytes=2 * BROKER_MAX_MESSAGE
            )
            huge = b"x" * (BROKER_MAX_MESSAGE + 1)
            bad = Row("over-the-broker", sink, headers_json("bad-huge"), huge)
            goods, wait = 5, 30.0
        storage = storage_of(app)
        engine, table = storage.engine, storage.tables.outbox
        before_refused = {f"good-{n}" for n in range(goods)}
        rows = [
            *(good(sink, n) for n in range(goods)),
            dataclasses.replace(bad, reason="RabbitMQ refused"),
            *(good(sink, n) for n in range(goods, 2 * goods)),
        ]
        del bad
        ids = await insert_rows(engine, table, name, rows)
        storage.wake()
        await eventually(none_waiting(engine, table), "no row is left unparked", timeout=wait)
        good_ids = {f"good-{n}" for n in range(2 * goods)}
        await eventually(lambda: set(received.ids) >= good_ids, "every good row", timeout=10)
        marker = await relay_moved_on(storage, name, sink, lambda: received.ids)
        check_parking(rows, ids, await stored_rows(engine, table))
        if refused != "reserved header":
            assert app.healthy is False
        await still_handles(broker, app, handled)
    assert set(received.ids) == {*good_ids, marker}
    check_unknown_outcomes(received, before_refused)


# A reply to a requester that is gone is dropped; a send nobody can route is parked.


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_reply_to_a_requester_that_is_gone_is_dropped_and_an_unroutable_send_is_parked(
    postgres_url: str, amqp_url: str, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="mersal.outbox")
    replier_name = unique_name("replier")
    reply_queues: list[str] = []
    answered: list[int] = []
    release = asyncio.Event()

    async def answer(message: Ask, context: MessageContext) -> None:
        assert context.reply_to is not None
        reply_queues.append(context.reply_to)
        if message.hold:
            await release.wait()
        await context.app.reply(Answer(message.n))
        answered.append(message.n)

    replier = broker.watch(App(replier_name, transport=amqp_url, database=postgres_url))
    attach(replier, poll_interval=0.2)
    replier.register(Ask, answer)
    replier.route(Lost, unique_name("nobody"))
    requester = broker.watch(App(unique_name("requester"), transport=amqp_url))
    requester.route(Ask, replier_name)

    async with replier:
        storage = storage_of(replier)
        relay = storage.relay
        assert relay is not None
        engine, table = storage.engine, storage.tables.outbox
        await requester.start()
        reply = await requester.request(Ask(1), timeout=10, reply_type=Answer)
        assert reply == Answer(1)  # it went through the replier's outbox

        with pytest.raises(RequestTimeout):
            await requester.request(Ask(2, hold=True), timeout=0.5, reply_type=Answer)
        await requester.stop()  # its temporary reply queue goes with its connection
        gone = reply_queues[-1]
        await eventually(lambda: _missing(broker, gone), "the reply queue is gone", timeout=5)
        release.set()
        await eventually(lambda: answered == [1, 2], "the late reply is written", timeout=5)
        await eventually(lambda: relay.dropped == 1, "the relay drops the reply", timeout=5)
        assert await stored_rows(engine, table) == {}, "the dropped reply must be deleted"
        dropped = [
            record
            for record in caplog.records
            if record.name == "mersal.outbox"
            and record.levelno == logging.WARNING
            and "dropping" in record.getMessage()
        ]
        assert len(dropped) == 1 and gone in dropped[0].getMessage(), dropped
        assert relay.parked == 0 and relay.parked_rows == 0
        assert replier.healthy

        async with replier.transaction():
            await replier.send(Lost(3))
        await eventually(lambda: relay.parked_rows > 0, "the unroutable send is parked", timeout=5)
        [parked] = (await stored_rows(engine, table)).values()
        assert parked.parked_reason is not None and "Unroutable" in parked.parked_reason
        assert not replier.healthy


async def _missing(broker: Broker, queue: str) -> bool:
    """Whether `queue` no longer exists."""
    return not await broker.exists(queue)


# On RabbitMQ, a dead letter with thousands of headers still leaves, once.

TINY_HEADERS = 12_000
"""Headers of 4 bytes each (a 3-byte name, a 1-byte value): 10 bytes each in an AMQP table, so
120 kB, one frame; 12 each as a transport counts them (8 for the entry), 144 kB, over what a
message may carry; 4 each as the old dead-letter check counted them (48 kB), well within it."""

DIGITS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def tiny_name(n: int) -> str:
    """A distinct 3-character header name for each n < 62**3."""
    return DIGITS[n // 3_844] + DIGITS[n // 62 % 62] + DIGITS[n % 62]


class Doom(Exception):
    """What the Poison handler always raises."""


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_delivery_with_thousands_of_tiny_headers_reaches_the_error_queue_once(
    postgres_url: str, amqp_url: str, broker: Broker
) -> None:
    name = unique_name("poison")
    error_queue = f"{name}.error"
    calls: list[int] = []

    async def doom(message: Poison) -> None:
        calls.append(message.n)
        raise Doom(f"poison {message.n} always fails")

    policy = RetryPolicy(immediate=1, delayed=[0.2], error_queue=error_queue)
    app = broker.watch(App(name, transport=amqp_url, database=postgres_url, retry=policy))
    app.register(Poison, doom)
    headers: dict[str, Any] = {tiny_name(n): "v" for n in range(TINY_HEADERS)}
    hostile = aio_pika.Message(
        b'{"n": 7}',
        headers=headers,
        message_id="tiny-headers",
        type="tests.relay.Poison.v1",
        content_type="application/json",
    )
    async with app:
        dead = await broker.record(error_queue)
        await broker.publish(hostile, name)
        await eventually(lambda: dead.ids["tiny-headers"] == 1, "the dead letter", timeout=15)
        await eventually(lambda: app.in_flight == 0, "the delivery is settled", timeout=5)
    # The app stopped: a delivery it had not settled would be back in its queue now.
    assert await broker.count(name) == 0
    assert calls == [7] * policy.max_attempts
    assert dead.ids == Counter({"tiny-headers": 1})
    letter = dead.messages["tiny-headers"]
    letter_headers = letter.headers or {}
    assert letter_headers[Header.ERROR_TYPE] == f"{__name__}.Doom"
    assert "poison 7 always fails" in str(letter_headers[Header.ERROR_MESSAGE])
    assert letter_headers[Header.ERROR_QUEUE] == name
    assert letter.body == b'{"n": 7}'


# A NUL character from a hostile producer: SQLite stores it, PostgreSQL text cannot.


def nul_app(database: str, url: str) -> tuple[App, list[str]]:
    """An app that records the ids of the Ships it handles and replies to each."""
    app = App(
        "nul",
        transport=url,
        database=database,
        retry=RetryPolicy(immediate=0, delayed=[], error_queue="error"),
    )
    handled: list[str] = []

    async def ship(message: Ship, context: MessageContext) -> None:
        handled.append(context.message_id)
        if context.reply_to:
            await context.app.reply(Answer(message.n))

    app.register(Ship, ship)
    return app, handled


def dead_letters(app: App) -> list[dict[str, str]]:
    """The headers of what is in the app's error queue (memory transport)."""
    transport = app.transport
    assert isinstance(transport, MemoryTransport)
    return [stored.envelope.headers for stored in transport.broker.queues["error"].ready]


def route_raw(app: App, headers: dict[str, str]) -> None:
    """Put a Ship with these headers in the app's queue, past every check of the transport."""
    transport = app.transport
    assert isinstance(transport, MemoryTransport)
    headers = {Header.TYPE: SHIP, **headers}
    transport.broker.route(Outgoing(app.name, Envelope(headers, b'{"n": 1}')))


@pytest.mark.timeout(30)
async def test_a_message_id_with_a_nul_character_is_handled_once(
    database: str, memory_url: str
) -> None:
    app, handled = nul_app(database, memory_url)
    async with app:
        route_raw(app, {Header.MESSAGE_ID: "nul\x00id"})
        await eventually(
            lambda: bool(handled or dead_letters(app)), "handled or refused", timeout=5
        )
        await eventually(lambda: app.in_flight == 0, "the delivery is settled", timeout=5)
        dead = [letter.get(Header.ERROR_MESSAGE, "")[:200] for letter in dead_letters(app)]
    assert handled == ["nul\x00id"], f"not handled; dead-lettered with {dead}"
    assert dead == []


@pytest.mark.timeout(30)
async def test_a_reply_address_with_a_nul_character_is_parked_or_refused_at_the_call(
    database: str, memory_url: str
) -> None:
    app, handled = nul_app(database, memory_url)
    async with app:
        storage = storage_of(app)
        route_raw(app, {Header.MESSAGE_ID: "m-1", Header.REPLY_TO: "gone\x00queue"})
        await eventually(lambda: bool(handled), "the handler ran", timeout=5)
        await eventually(lambda: app.in_flight == 0, "the delivery is settled", timeout=5)
        await eventually(
            none_waiting(storage.engine, storage.tables.outbox),
            "no row is left unparked",
            timeout=5,
        )
        stored = list((await stored_rows(storage.engine, storage.tables.outbox)).values())
        dead = dead_letters(app)
    if dead:  # refused at the call, as a reply to an address no broker takes
        [letter] = dead
        assert letter[Header.ERROR_TYPE] == "mersal.errors.Unsendable", letter[Header.ERROR_MESSAGE]
        assert stored == []
    else:  # written, tried and parked: nobody has that queue
        [row] = stored
        assert row.parked_reason is not None and "Unroutable" in row.parked_reason


@dataclass
class ToFull:
    """A command to a queue that refuses everything."""

    n: int


# Rows the broker keeps refusing are tried again, not parked, and do not hold back the rows
# written after them.


class RefusingQueue(DelegatingTransport):
    """A memory transport on which every send to `refused` fails as a broker's nack would."""

    def __init__(self, url: str, refused: str) -> None:
        super().__init__(MemoryTransport(url))
        self.refused = refused
        self.tries: Counter[str] = Counter()

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        """Refuse what goes to `refused`; send the rest."""
        results: list[Exception | None] = []
        for outgoing in messages:
            if outgoing.address == self.refused:
                self.tries[outgoing.envelope.message_id or ""] += 1
                results.append(MersalError("RabbitMQ refused it (the queue is full), on purpose"))
            else:
                results.extend(await self.inner.send_each([outgoing]))
        return results


@pytest.mark.timeout(60)
async def test_rows_the_broker_keeps_refusing_do_not_hold_back_the_rows_behind_them(
    database: str, memory_url: str
) -> None:
    batch = 5
    sink = await Sink(memory_url).start()
    transport = RefusingQueue(memory_url, "full")
    app = App("head-of-line", transport=transport, database=database)
    attach(app, relay_batch=batch, poll_interval=0.5)
    app.route(ToFull, "full")
    app.route(Ship, "sink")
    async with app:
        storage = storage_of(app)
        async with app.transaction():  # a batch's worth of rows that never go, first
            for n in range(batch):
                await app.send(ToFull(n))
        async with app.transaction():
            for n in range(3):
                await app.send(Ship(n))
        await eventually(lambda: len(sink.ids()) == 3, "the rows behind them leave", timeout=3)
        # ... while the refused ones are still tried, not parked nor forgotten.
        await eventually(
            lambda: len(transport.tries) == batch and min(transport.tries.values()) >= 2,
            "each refused row is tried again",
            timeout=5,
        )
        assert await storage.pending() == batch
        assert storage.parked == 0
    assert sink.duplicates() == {}


# After an operator purges or retries the parked rows, a busy app is healthy again within about
# the relay's poll interval.


@pytest.mark.timeout(60)
@pytest.mark.parametrize("action", ["purge", "retry"])
async def test_a_busy_app_is_healthy_again_soon_after_its_parked_rows_are_dealt_with(
    database: str, memory_url: str, action: str
) -> None:
    poll_interval = 0.5
    sink = await Sink(memory_url).start()
    app = App("health", transport=memory_url, database=database)
    attach(app, poll_interval=poll_interval)
    app.route(Lost, "nobody-declared-this")
    app.route(Ship, "sink")
    async with app:
        storage = storage_of(app)
        table = storage.tables.outbox
        async with app.transaction():
            await app.send(Lost(1))
        await eventually(lambda: not app.healthy, "the unroutable row is parked", timeout=5)
        async with storage.engine.connect() as connection:
            parked = (await connection.execute(select(table.c.id))).scalars().all()
        assert len(parked) == 1

        async def commit_a_row() -> bool:
            """Keep the app busy: each commit wakes the relay."""
            async with app.transaction():
                await app.send(Ship(0))
            return app.healthy

        for _ in range(5):  # busy before the operator acts
            await commit_a_row()
        if action == "purge":
            assert await mersal("outbox", "purge", str(parked[0]), "--database", database) == 0
        else:
            await sink.transport.declare("nobody-declared-this")
            assert await mersal("outbox", "retry", "--all", "--database", database) == 0
        await eventually(commit_a_row, "healthy while busy", timeout=4 * poll_interval)
        assert storage.parked == 0
        if action == "retry":
            await eventually(lambda: len(sink.ids("nobody-declared-this")) == 1, "it leaves")
