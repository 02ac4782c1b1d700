"""The SQL dead-letter store on PostgreSQL with 100,000 stored failures, against bare asyncpg.

One run, on a PostgreSQL database of its own (`mersal_bench_dlq_<random>`, created through the
`postgres` database, migrated with `mersal db upgrade`'s code, dropped at the end):

- Seeding (not a figure beyond `dlq_seed_seconds`): `ROWS` failures of one app, `billing`,
  spread evenly and interleaved over `len(FAILURES)` failure groups (an exception type, a
  message and a handler each). Each row stores a realistic dead letter (message, correlation
  and causation ids, type, sent-at, the error headers with a traceback, `Header.ERROR_QUEUE`
  naming the source queue, a ~1 KB JSON body) as `DeadLetterStore.row_of` would (its group
  columns taken from `row_of`, and sample rows checked against it), written with asyncpg's
  COPY in chunks of `CHUNK`; then VACUUM ANALYZE, as autovacuum would.
- Reads: each of the store's calls below, and the same SQL written by hand on one bare asyncpg
  connection (same columns, conditions, order and limit: the same rows, checked once), called
  in turns (which of the two goes first alternates) `CALLS` times each after a warm-up; the
  median milliseconds of each. `groups()`; `page()` (the first page, `PAGE` rows), with
  `before=` an id a tenth of the way up the table, with `group=`, with `search=` a text one
  group's messages hold, and with `search=` a text no row holds (a full scan: `MISS_CALLS`);
  `get(id)` of a row in the middle. `failures_page`: the dashboard's failures page of one
  group served over HTTP (its groups, the page, the group's count, rendered), against those
  three queries on bare asyncpg. The raw side returns asyncpg records; the store's side
  includes checking out a pooled connection, SQLAlchemy's compile cache and building the
  result objects. A `<name>_ratio` is raw time / store time (1 is as fast as by hand).
- Retries: `store.retry_group(key)` on one group (`ROWS / len(FAILURES)` rows), timed until
  it returns; then the same work by hand on asyncpg on another group of the same size: per
  transaction of `RETRY_BATCH` rows, SELECT ... FOR UPDATE, the headers made replayable
  (error and retry headers dropped, `replays` counted), the outbox rows inserted with
  executemany (the columns `write_outbox` writes) and one NOTIFY, the rows resolved (kept as
  tombstones: key kept, headers and body emptied). Messages
  per second for each; `retry_ratio` is the store's rate / the raw rate. Which side goes
  first alternates from run to run (both groups share the table's pages). Both are checked:
  every row of both groups resolved, one outbox row each.

Environment: MERSAL_BENCH_POSTGRES (default `postgresql+asyncpg://postgres@127.0.0.1:5432`,
a server where that user may create databases); MERSAL_BENCH_DLQ_ROWS sets `ROWS`.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import re
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import asyncpg  # type: ignore[import-untyped]
import msgspec
from sqlalchemy.engine import make_url

from mersal import App
from mersal.dead_letters import RETRY_HEADERS, DeadLetter
from mersal.messages import Envelope, Header
from mersal.settle import ERROR_HEADERS
from mersal_dashboard import Dashboard, source_of
from mersal_sqlalchemy import make_engine, make_tables
from mersal_sqlalchemy.cli import upgrade
from mersal_sqlalchemy.dead_letters import (
    PAGE,
    RETRY_BATCH,
    DeadLetterStore,
    StoredFailure,
    StoredGroup,
)

POSTGRES = os.environ.get("MERSAL_BENCH_POSTGRES", "postgresql+asyncpg://postgres@127.0.0.1:5432")
ROWS = int(os.environ.get("MERSAL_BENCH_DLQ_ROWS", "100000"))
CHUNK = 10_000
"""Rows per COPY while seeding."""
CALLS = 20
"""Timed calls of each read, per side."""
MISS_CALLS = 5
"""Timed calls of the search no row matches (each reads the whole table), per side."""
APP = "billing"
ERROR_QUEUE = "error"
SOURCE_QUEUE = "billing"
BODY_SIZE = 1024
NOTE = "x" * (BODY_SIZE - 515)
"""Pads a body to about `BODY_SIZE` bytes (the order and its lines take about 515)."""
DAYS = 7
"""The failures' failed-at times spread over the last this many days, oldest first."""
SEARCH = "insufficient funds"
"""A text the messages of one group (of `len(FAILURES)`) hold."""
MISSING = "no failure says this"
"""A text no row holds."""
DROPPED = frozenset((*ERROR_HEADERS, *RETRY_HEADERS))
"""The headers a retry takes off, as `mersal.dead_letters.replayable` does."""

FAILURES = (
    ("billing.errors.CardDeclined", "card declined for order {order} (code {n})", "charge"),
    ("billing.errors.InsufficientFunds", "insufficient funds: {n} below {m}", "charge"),
    ("TimeoutError", "payment gateway gave no answer in {n} s", "charge"),
    ("billing.errors.FraudSuspected", "score {n} over limit for customer {order}", "charge"),
    ("httpx.ConnectError", "all connection attempts to psp.example failed", "charge"),
    ("asyncpg.exceptions.UniqueViolationError", "duplicate key 'payments_pkey'", "record"),
    ("asyncpg.exceptions.DeadlockDetectedError", "deadlock detected in {n}", "record"),
    ("sqlalchemy.exc.IntegrityError", "null value in column 'amount'", "record"),
    ("KeyError", "'currency'", "record"),
    ("billing.errors.UnknownCustomer", "no customer {order}", "invoice"),
    ("ValueError", "amount {n} is negative", "invoice"),
    ("jinja2.exceptions.UndefinedError", "'address' is undefined", "invoice"),
    ("smtplib.SMTPServerDisconnected", "connection unexpectedly closed", "notify"),
    ("billing.errors.TemplateMissing", "template 'receipt' not found", "notify"),
    ("ConnectionResetError", "[Errno 104] connection reset by peer", "notify"),
    ("billing.errors.RefundWindowClosed", "order {order} is {n} days old", "refund"),
    ("billing.errors.AlreadyRefunded", "order {order} was refunded", "refund"),
    ("decimal.InvalidOperation", "[<class 'decimal.ConversionSyntax'>]", "refund"),
    ("msgspec.ValidationError", "expected `int`, got `str` - at `$.items[{n}]`", "ledger"),
    ("PermissionError", "[Errno 13] permission denied: '/ledger/{n}.csv'", "ledger"),
)
"""Each group's exception type, its message (`{order}`, `{n}`, `{m}` vary) and its handler."""

TRACEBACK = """Traceback (most recent call last):
  File "/srv/billing/.venv/lib/python3.12/site-packages/mersal/pipeline.py", line 212, in dispatch
    await step(context, message)
  File "/srv/billing/.venv/lib/python3.12/site-packages/mersal/handlers.py", line 88, in __call__
    return await self.function(message)
  File "/srv/billing/billing/handlers.py", line {line}, in {handler}
    await self.gateway.{handler}(message.order_id, message.amount)
  File "/srv/billing/billing/gateway.py", line {line}, in {handler}
    raise {error}({message!r})
{error}: {message}
"""

_decode = msgspec.json.Decoder(dict[str, str])
_encode = msgspec.json.Encoder()

_turns = itertools.count()
"""Counts the runs, so that successive runs alternate which retry goes first."""


@dataclass(frozen=True)
class Pair:
    """One read, through the store and by hand: each a call returning its rows."""

    name: str
    ours: Callable[[], Awaitable[Any]]
    raw: Callable[[], Awaitable[Any]]
    calls: int = CALLS


async def run() -> dict[str, float | int]:
    """Seed a fresh database, time the reads and the retries on both sides, drop it."""
    async with private_database() as name:
        url = make_url(POSTGRES).set(database=name).render_as_string(hide_password=False)
        await asyncio.to_thread(upgrade, url)
        engine = make_engine(url)
        connection = await asyncpg.connect(dsn(name))
        try:
            store = DeadLetterStore(engine, make_tables(), APP)
            figures: dict[str, float | int] = {"dlq_rows": ROWS}
            figures["dlq_seed_seconds"] = await seed(connection, store)
            groups = [group.key for group in await store.groups()]
            if len(groups) != len(FAILURES):
                raise RuntimeError(f"{len(groups)} failure groups, not {len(FAILURES)}")
            for pair in await reads(store, connection, groups[0]):
                figures.update(await compare(pair))
            figures.update(await page_render(url, connection, groups[0]))
            figures.update(await retries(store, connection, groups[-2], groups[-1]))
            return figures
        finally:
            await connection.close()
            await engine.dispose()


def dsn(database: str) -> str:
    """The asyncpg DSN of `database` on the benchmark's server."""
    url = make_url(POSTGRES).set(drivername="postgresql", database=database)
    return url.render_as_string(hide_password=False)


@asynccontextmanager
async def private_database() -> AsyncIterator[str]:
    """The name of a new, empty database; dropped (connections and all) afterwards."""
    name = f"mersal_bench_dlq_{uuid.uuid4().hex[:12]}"
    await administer(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        await administer(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def administer(statement: str) -> None:
    """Run `statement` on the server's `postgres` database."""
    admin = await asyncpg.connect(dsn("postgres"), timeout=10)
    try:
        await admin.execute(statement)
    finally:
        await admin.close()


# Seeding.


COLUMNS = (
    "app",
    "key",
    "error_queue",
    "source_queue",
    "message_id",
    "type_name",
    "error_type",
    "error_message",
    "traceback",
    "handler",
    "attempts",
    "failed_at",
    "group_key",
    "group_label",
    "headers",
    "body",
)
"""The columns seeded, in the records' order (`id` and `ingested_at` take their defaults)."""


async def seed(connection: Any, store: DeadLetterStore) -> float:
    """COPY `ROWS` stored failures into the store's table, then VACUUM ANALYZE; the seconds."""
    started = time.perf_counter()
    first = datetime.now(UTC) - timedelta(days=DAYS)
    groups = group_rows(store, first)
    for start in range(0, ROWS, CHUNK):
        records = [
            record(letter_of(n, first), groups[n % len(groups)])
            for n in range(start, min(start + CHUNK, ROWS))
        ]
        await connection.copy_records_to_table(store.table.name, records=records, columns=COLUMNS)
    await connection.execute(f"VACUUM ANALYZE {store.table.name}")
    return time.perf_counter() - started


def group_rows(store: DeadLetterStore, first: datetime) -> list[dict[str, Any]]:
    """Each group's first row as `store.row_of` makes it; a RuntimeError if `record` differs.

    `record` takes the group's columns from here and the rest from the letter, faster than
    `row_of` (no grouping, no digest of the whole message): its rows of the groups' second
    failures are checked against `row_of`'s, their `key` (a digest either way) aside.
    """
    count = len(FAILURES)
    groups = [store.row_of(letter_of(n, first), ERROR_QUEUE) for n in range(count)]
    for n in range(count, 2 * count):
        letter = letter_of(n, first)
        seeded = dict(zip(COLUMNS, record(letter, groups[n % count]), strict=True))
        if {**seeded, "key": ""} != {**store.row_of(letter, ERROR_QUEUE), "key": ""}:
            raise RuntimeError(f"the seeded row of failure {n} is not what the store stores")
    return groups


def record(letter: DeadLetter, group: dict[str, Any]) -> tuple[Any, ...]:
    """The COPY record storing `letter`, of the group whose row `group` is (see `COLUMNS`)."""
    headers = letter.headers
    return (
        APP,
        hashlib.sha256(headers[Header.MESSAGE_ID].encode()).hexdigest(),
        ERROR_QUEUE,
        letter.source_queue,
        letter.message_id,
        letter.type_name,
        letter.error_type,
        letter.error_message,
        headers[Header.ERROR_TRACEBACK],
        group["handler"],
        letter.attempts,
        letter.failed_at,
        group["group_key"],
        group["group_label"],
        _encode.encode(headers).decode(),
        letter.envelope.body,
    )


def letter_of(n: int, first: datetime) -> DeadLetter:
    """Failure `n` of the `ROWS`, failing one after the other from `first` to now."""
    error, text, handler = FAILURES[n % len(FAILURES)]
    message = text.format(order=uuid.UUID(int=n), n=n % 97 + 3, m=n % 89 + 100)
    failed_at = first + timedelta(days=DAYS) / ROWS * n
    return DeadLetter(Envelope(headers_of(n, error, message, handler, failed_at), body_of(n)))


def headers_of(
    n: int, error: str, message: str, handler: str, failed_at: datetime
) -> dict[str, str]:
    """The headers of failure `n`, as the app's error queue gets them."""
    sent_at = failed_at - timedelta(seconds=2)
    return {
        Header.MESSAGE_ID: str(uuid.UUID(int=n + ROWS)),
        Header.TYPE: f"billing.{handler.capitalize()}Order.v1",
        Header.CORRELATION_ID: str(uuid.UUID(int=n // 3 + 2 * ROWS)),
        Header.CAUSATION_ID: str(uuid.UUID(int=n // 3 + 3 * ROWS)),
        Header.SENT_AT: f"{sent_at.timestamp():.6f}",
        Header.CONTENT_TYPE: "application/json",
        Header.SOURCE: "checkout",
        Header.PARTITION_KEY: f"customer-{n % 1000}",
        Header.ERROR_TYPE: error,
        Header.ERROR_MESSAGE: message,
        Header.ERROR_TRACEBACK: TRACEBACK.format(
            line=40 + len(handler), handler=handler, error=error, message=message
        ),
        Header.ERROR_ATTEMPTS: "5",
        Header.ERROR_QUEUE: SOURCE_QUEUE,
        Header.FAILED_AT: f"{failed_at.timestamp():.6f}",
    }


def body_of(n: int) -> bytes:
    """The JSON body of failure `n`: an order with its lines, about `BODY_SIZE` bytes."""
    return _encode.encode(
        {
            "order_id": str(uuid.UUID(int=n)),
            "customer_id": f"customer-{n % 1000}",
            "amount": round(n % 997 * 1.37, 2),
            "currency": "EUR",
            "lines": [
                {"sku": f"SKU-{(n + i) % 5000:05d}", "quantity": i + 1, "price": 9.99 + i}
                for i in range(8)
            ],
            "note": NOTE,
        }
    )


# Reads.


async def reads(store: DeadLetterStore, connection: Any, group: str) -> list[Pair]:
    """The reads to compare: the groups, five kinds of page and one row."""
    table = store.table.name
    low, high = await connection.fetchrow(f"SELECT min(id), max(id) FROM {table}")
    deep, middle = low + (high - low) // 10, (low + high) // 2
    pattern, missing = f"%{SEARCH}%", f"%{MISSING}%"
    return [
        Pair("groups", store.groups, lambda: connection.fetch(groups_sql(table), APP, 200)),
        Pair("page", store.page, lambda: connection.fetch(page_sql(table), APP, PAGE)),
        Pair(
            "page_deep",
            lambda: store.page(before=deep),
            lambda: connection.fetch(page_sql(table, before=True), APP, deep, PAGE),
        ),
        Pair(
            "page_group",
            lambda: store.page(group=group),
            lambda: connection.fetch(page_sql(table, group=True), APP, group, PAGE),
        ),
        Pair(
            "page_search",
            lambda: store.page(search=SEARCH),
            lambda: connection.fetch(page_sql(table, search=True), APP, pattern, PAGE),
        ),
        Pair(
            "page_search_miss",
            lambda: store.page(search=MISSING),
            lambda: connection.fetch(page_sql(table, search=True), APP, missing, PAGE),
            MISS_CALLS,
        ),
        Pair(
            "get",
            lambda: store.get(middle),
            lambda: connection.fetchrow(get_sql(table), APP, middle),
        ),
    ]


LISTED = (
    "id, error_queue, source_queue, message_id, type_name, error_type, error_message, handler, "
    "attempts, failed_at, ingested_at, group_key, group_label"
)
"""A page's columns, as the store lists them."""


def groups_sql(table: str) -> str:
    """The store's groups query, by hand: $1 the app, $2 the limit."""
    seen = "coalesce(failed_at, ingested_at)"
    return (
        f"SELECT group_key, min(group_label), min(error_type), min(handler), count(*), "
        f"min({seen}), max({seen}) FROM {table} WHERE app = $1 AND resolved_at IS NULL "
        "GROUP BY group_key "
        f"ORDER BY max({seen}) DESC, group_key LIMIT $2"
    )


def page_sql(table: str, *, group: bool = False, search: bool = False, before: bool = False) -> str:
    """The store's page query, by hand: $1 the app, then the group, pattern or id, the limit."""
    conditions = ["app = $1"]
    if group:
        conditions.append(f"group_key = ${len(conditions) + 1}")
    if search:
        parameter = f"${len(conditions) + 1}"
        columns = ("message_id", "type_name", "error_type", "error_message")
        matches = " OR ".join(f"{column} ILIKE {parameter} ESCAPE '\\'" for column in columns)
        conditions.append(f"({matches})")
    if before:
        conditions.append(f"id < ${len(conditions) + 1}")
    return (
        f"SELECT {LISTED} FROM {table} WHERE {' AND '.join(conditions)} AND resolved_at IS NULL "
        f"ORDER BY id DESC LIMIT ${len(conditions) + 1}"
    )


def get_sql(table: str) -> str:
    """The store's query for one row, by hand: $1 the app, $2 the id."""
    return (
        f"SELECT {LISTED}, traceback, headers, body FROM {table} "
        "WHERE app = $1 AND resolved_at IS NULL AND id = $2"
    )


async def compare(pair: Pair) -> dict[str, float]:
    """The median milliseconds of both sides of `pair`, and raw / ours; the rows checked first."""
    ours, raw = await pair.ours(), await pair.raw()
    if keys(ours) != keys(raw):
        raise RuntimeError(f"{pair.name}: the store and the raw query return different rows")
    times: tuple[list[float], list[float]] = ([], [])
    for turn in range(pair.calls):
        sides = ((0, pair.ours), (1, pair.raw))
        for side, call in sides if turn % 2 == 0 else sides[::-1]:
            times[side].append(await timed(call))
    ours_ms, raw_ms = (statistics.median(side) * 1000 for side in times)
    return {
        f"{pair.name}_ms": ours_ms,
        f"raw_{pair.name}_ms": raw_ms,
        f"{pair.name}_ratio": raw_ms / ours_ms,
    }


async def timed(call: Callable[[], Awaitable[Any]]) -> float:
    """The seconds one call takes."""
    started = time.perf_counter()
    await call()
    return time.perf_counter() - started


def keys(result: Any) -> list[Any]:
    """What identifies the rows of a result: group keys or row ids, in order."""
    items = result if isinstance(result, list) else [result]
    if all(isinstance(item, int) for item in items):
        return items
    return [
        item.key
        if isinstance(item, StoredGroup)
        else item.id
        if isinstance(item, StoredFailure)
        else item[0]
        for item in items
    ]


async def page_render(url: str, connection: Any, group: str) -> dict[str, float]:
    """The dashboard's page of one group (its groups, a page, the count, rendered and served
    over HTTP) against the same three queries on bare asyncpg."""
    app = App(APP, transport="memory://bench-dead-letters", database=url)
    source = source_of(app)
    source.transport = None  # the page reads the database only
    dashboard = Dashboard([source], ingest=False, interval=3600)
    table = source.tables.dead_letters.name
    count_sql = (
        f"SELECT count(*) FROM {table} WHERE app = $1 AND resolved_at IS NULL AND group_key = $2"
    )

    async def raw() -> list[Any]:
        await connection.fetch(groups_sql(table), APP, 200)
        rows = await connection.fetch(page_sql(table, group=True), APP, group, PAGE + 1)
        await connection.fetchval(count_sql, APP, group)
        return [row["id"] for row in rows[:PAGE]]

    async with dashboard.serving() as base, aiohttp.ClientSession() as client:
        address = f"{base}/apps/{APP}/failures?group={group}"

        async def ours() -> list[int]:
            async with client.get(address) as answer:
                page = await answer.text()
            return [int(found) for found in re.findall(r'data-failure="(\d+)"', page)]

        return await compare(Pair("failures_page", ours, raw))


# Retries.


async def retries(
    store: DeadLetterStore, connection: Any, ours: str, raw: str
) -> dict[str, float | int]:
    """Retry group `ours` through the store and group `raw` by hand; messages per second."""
    size = ROWS // len(FAILURES)
    if next(_turns) % 2 == 0:
        ours_seconds = await store_retry(store, ours, size)
        raw_seconds = await raw_retry(connection, store, raw, size)
    else:
        raw_seconds = await raw_retry(connection, store, raw, size)
        ours_seconds = await store_retry(store, ours, size)
    await check_retried(connection, store, (ours, raw), 2 * size)
    return {
        "retry_group_rows": size,
        "retry_group_per_s": size / ours_seconds,
        "raw_retry_per_s": size / raw_seconds,
        "retry_ratio": raw_seconds / ours_seconds,
    }


async def store_retry(store: DeadLetterStore, group: str, size: int) -> float:
    """The seconds `store.retry_group(group)` takes; a RuntimeError unless it sent `size`."""
    started = time.perf_counter()
    retried = await store.retry_group(group)
    seconds = time.perf_counter() - started
    if retried.sent != size or retried.without_queue:
        raise RuntimeError(f"the store's retry sent {retried.sent} of {size}")
    return seconds


async def raw_retry(connection: Any, store: DeadLetterStore, group: str, size: int) -> float:
    """The seconds the store's retry of `group` takes by hand; a RuntimeError unless `size`."""
    table, outbox = store.table.name, store.tables.outbox.name
    select = (
        f"SELECT id, headers, body FROM {table} WHERE app = $1 AND resolved_at IS NULL "
        "AND group_key = $2 AND id > $3 ORDER BY id LIMIT $4 FOR UPDATE"
    )
    insert = (
        f"INSERT INTO {outbox} (app, address, publish, headers, body) VALUES ($1, $2, $3, $4, $5)"
    )
    resolve = (
        f"UPDATE {table} SET resolved_at = now(), resolution = 'retried', headers = '{{}}', "
        "body = '', traceback = NULL WHERE id = ANY($1::bigint[])"
    )
    started = time.perf_counter()
    sent, after = 0, 0
    while True:
        async with connection.transaction():
            rows = await connection.fetch(select, APP, group, after, RETRY_BATCH)
            if not rows:
                break
            await connection.executemany(insert, [outbox_record(row) for row in rows])
            await connection.execute("SELECT pg_notify($1, $2)", store.tables.channel, APP)
            await connection.execute(resolve, [row["id"] for row in rows])
        sent, after = sent + len(rows), rows[-1]["id"]
    seconds = time.perf_counter() - started
    if sent != size:
        raise RuntimeError(f"the raw retry sent {sent} of {size}")
    return seconds


def outbox_record(row: Any) -> tuple[str, str, bool, str, bytes]:
    """The outbox row that sends a stored failure back to its source queue, replayable."""
    headers = _decode.decode(row["headers"])
    address = headers[Header.ERROR_QUEUE]
    replayed = {name: value for name, value in headers.items() if name not in DROPPED}
    replayed[Header.REPLAYS] = str(int(headers.get(Header.REPLAYS, "0")) + 1)
    return APP, address, False, _encode.encode(replayed).decode(), row["body"]


async def check_retried(
    connection: Any, store: DeadLetterStore, groups: tuple[str, str], expected: int
) -> None:
    """A RuntimeError unless the groups' rows are gone and `expected` outbox rows wait."""
    left = await connection.fetchval(
        f"SELECT count(*) FROM {store.table.name} WHERE group_key = ANY($1::text[]) "
        "AND resolved_at IS NULL",
        list(groups),
    )
    queued = await connection.fetchval(
        f"SELECT count(*) FROM {store.tables.outbox.name} WHERE app = $1 AND address = $2",
        APP,
        SOURCE_QUEUE,
    )
    if left or queued != expected:
        raise RuntimeError(f"after the retries: {left} rows left, {queued} of {expected} queued")
