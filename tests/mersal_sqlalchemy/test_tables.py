"""On PostgreSQL the relay's claim and the inbox's lookups use indexes, however large the tables."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from sqlalchemy import ClauseElement, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncEngine

from mersal_sqlalchemy.engines import make_engine
from mersal_sqlalchemy.inbox import Inbox
from mersal_sqlalchemy.outbox import SqlOutboxStore
from mersal_sqlalchemy.tables import make_tables

pytestmark = pytest.mark.integration

TABLES = make_tables()
BACKLOG = 100_000
OWN = 2_000
INBOX_ROWS = 300_000
RETENTION = 6.5 * 86_400.0  # the ids of the last half day of the week are older


@pytest.fixture
async def filled(postgres_url: str) -> AsyncIterator[AsyncEngine]:
    """Grown tables: another app's backlog in the outbox, a long-kept inbox, then ANALYZE.

    The outbox holds `BACKLOG` rows of "stock" (some leased, some parked) and `OWN` rows of
    "orders"; the inbox `INBOX_ROWS` ids of three apps handled over the last week, a few of
    them older than the retention window.
    """
    engine = make_engine(postgres_url)
    outbox, inbox = TABLES.outbox.name, TABLES.inbox.name
    async with engine.begin() as connection:
        await connection.execute(
            text(
                f"INSERT INTO {outbox} (app, address, publish, headers, body, lease_until, "
                f"parked_at) SELECT CASE WHEN n > {BACKLOG} THEN 'orders' ELSE 'stock' END, "
                "'queue', false, '{}', '\\x00'::bytea, "
                "CASE WHEN n % 7 = 0 THEN now() + interval '1 minute' END, "
                "CASE WHEN n % 11 = 0 THEN now() END "
                f"FROM generate_series(1, {BACKLOG + OWN}) AS n"
            )
        )
        await connection.execute(
            text(
                f"INSERT INTO {inbox} (app, message_id, handled_at) "
                "SELECT (ARRAY['orders','billing','stock'])[n % 3 + 1], md5(n::text), "
                "now() - (n % 1000) * interval '10 minutes' "
                f"FROM generate_series(1, {INBOX_ROWS}) AS n"
            )
        )
        await connection.execute(text(f"ANALYZE {outbox}"))
        await connection.execute(text(f"ANALYZE {inbox}"))
    yield engine
    await engine.dispose()


async def plan_of(engine: AsyncEngine, statement: ClauseElement) -> dict[str, Any]:
    """PostgreSQL's plan for `statement` (not run), as the JSON EXPLAIN gives it."""
    sql = statement.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True})
    async with engine.connect() as connection:
        result = await connection.execute(text(f"EXPLAIN (FORMAT JSON) {sql}"))
        plan = result.scalar_one()
    return (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every node of a plan, depth first."""
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def scans(plan: dict[str, Any], table: str) -> list[tuple[str, str | None]]:
    """How the plan reads `table`: (node type, index name) per scan of it."""
    return [
        (node["Node Type"], node.get("Index Name"))
        for node in nodes(plan)
        if node.get("Relation Name") == table
    ]


async def test_the_relays_claim_reads_the_claim_index(filled: AsyncEngine) -> None:
    store = SqlOutboxStore(filled, TABLES.outbox, "orders")
    found = scans(await plan_of(filled, store.claim_statement(500)), TABLES.outbox.name)
    assert {index for _, index in found} >= {f"ix_{TABLES.outbox.name}_claim"}, found
    assert not [scan for scan in found if scan[0] == "Seq Scan"], found


async def test_the_inbox_lookup_and_cleanup_use_indexes(filled: AsyncEngine) -> None:
    inbox = Inbox(filled, TABLES.inbox, "orders", retention=RETENTION)
    lookup = scans(await plan_of(filled, inbox.seen_query("some-id")), TABLES.inbox.name)
    assert lookup and all(kind in ("Index Scan", "Index Only Scan") for kind, _ in lookup), lookup
    cleanup = scans(await plan_of(filled, inbox.cleanup_statement()), TABLES.inbox.name)
    assert cleanup and not [scan for scan in cleanup if scan[0] == "Seq Scan"], cleanup
