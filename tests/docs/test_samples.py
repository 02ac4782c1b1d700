"""Every code sample of the docs site runs, and does what its page says.

The pages show copies of these modules' sections (scripts/docs-samples makes them, and
tests/docs/test_pages.py checks them), so what a reader sees is what runs here: on memory:// and
SQLite, or on RabbitMQ and PostgreSQL for the pages about them.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.runtime.environment import EnvironmentContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, MetaData, inspect

from docs.samples import (
    alembic_env,
    amqp10,
    cluster,
    handlers,
    inbox,
    messages,
    pipeline,
    postgresql,
    quickstart,
    rabbitmq,
    repositories,
    retries,
    sagas,
    sharing_engine,
    testing,
    transactions,
)
from mersal_sqlalchemy import make_engine
from mersal_sqlalchemy.cli import alembic_config, upgrade
from tests.support import RABBITMQ_HOST, postgres_database

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^([ \t]*)```python\n(.*?)^\1```", re.MULTILINE | re.DOTALL)
COPIED = re.compile(r"<!-- copied from (\S+) by make docs-samples -->\n([ \t]*)```python\n")
IN_DEPTH = {"guide.md", "rabbitmq.md", "outbox.md", "security.md", "operations.md", "extending.md"}
"""The pages that predate the site, whose samples are tested their own way (or not yet)."""
SECTION = re.compile(r"#\s*-{1,3}8<-{1,2}\s*\[(start|end):(\w+)\]")


@pytest.fixture(autouse=True)
def no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The samples run as a reader's would: without MERSAL_TRANSPORT or MERSAL_DATABASE."""
    monkeypatch.delenv("MERSAL_TRANSPORT", raising=False)
    monkeypatch.delenv("MERSAL_DATABASE", raising=False)


@pytest.fixture
def sqlite(tmp_path: Path) -> str:
    """A SQLite file of this test's own."""
    return f"sqlite+aiosqlite:///{tmp_path / 'sample.db'}"


async def test_quickstart() -> None:
    assert await quickstart.main() == ["o-1"]


def test_the_readme_shows_the_quickstart_program() -> None:
    program = section(DOCS / "samples" / "quickstart.py", "program")
    readme = (ROOT / "README.md").read_text()
    assert f"```python\n{program}```" in readme, "README.md's example differs from the sample"


async def test_messages() -> None:
    received, types = await messages.main()
    assert received == [
        messages.PriceChanged("p-1", 9.5),
        messages.StockCounted("p-1", 12),
        messages.NoteAdded(sku="p-1", text="recount on Monday"),
    ]
    assert types == ["catalog.PriceChanged.v1", "catalog.StockCounted.v1", "catalog.NoteAdded.v1"]


async def test_handlers() -> None:
    handlers.audit.clear()
    assert await handlers.main() == {"p-1": 9.5}
    assert handlers.audit == ["p-1 on attempt 1 from pricing"]


async def test_pipeline() -> None:
    pipeline.durations.clear()
    names, tenants = await pipeline.main()
    assert names[:2] == ["decode", "timed"]
    assert tenants == ["acme"]
    assert len(pipeline.durations) == 1


async def test_transactions(sqlite: str) -> None:
    carts, orders, published = await transactions.main(sqlite)
    assert carts == ["c-1"], "the failed block's cart was rolled back"
    assert orders == ["c-1"], "the failed block's PlaceOrder was never sent"
    assert published == [transactions.OrderPlaced("c-1")]


async def test_retries() -> None:
    dead = {letter.message.order_id: letter for letter in await retries.main()}
    assert dead["o-1"].attempts == 4  # 1 + 1 immediate + 2 delayed
    assert dead["o-1"].error_type.endswith("PaymentDeclined")
    assert dead["o-2"].attempts == 1  # fail_fast
    assert dead["o-2"].error_type.endswith("InvalidAmount")
    assert {letter.address for letter in dead.values()} == {"payments.error"}


async def test_inbox(sqlite: str) -> None:
    assert await inbox.main(sqlite) == 1


async def test_testing() -> None:
    await testing.test_a_declined_order_is_dead_lettered_after_three_attempts()


async def test_sagas() -> None:
    await sagas.test_an_unpaid_invoice_is_reminded_three_times_then_overdue()
    part_paid, dead = await sagas.main()
    assert part_paid == sagas.Invoice("i-1", "ada@example.org", 50.0, paid=20.0)
    [unmatched] = dead  # the second payment of i-3, after its saga completed
    assert unmatched.message == sagas.PaymentReceived("INV-i-3", 50.0)
    assert unmatched.error_type.endswith("UnmatchedPayment")
    assert unmatched.attempts == 3


@pytest.mark.parametrize("on", ["memory", "sqlite"])
async def test_a_hot_saga_counts_every_row_once(on: str, sqlite: str) -> None:
    finished = await sagas.import_batch(60, sqlite if on == "sqlite" else None)
    assert finished == [sagas.BatchImported("b-1", 60)]


@pytest.mark.integration
async def test_a_hot_saga_counts_every_row_once_on_postgresql() -> None:
    async with postgres_database(migrate=True) as database:  # rows wait on FOR UPDATE
        assert await sagas.import_batch(60, database) == [sagas.BatchImported("b-1", 60)]


@dataclass
class AlembicContext:
    """What an env.py passes to Alembic's `context.configure`."""

    options: dict[str, Any] = field(default_factory=dict)

    def configure(self, **options: Any) -> None:
        """Keep the options."""
        self.options = options


def proposed(connection: Connection, include: bool) -> list[Any]:
    """What autogenerate proposes for an empty metadata, configured by the sample or without."""
    context = AlembicContext()
    alembic_env.run_on(context, connection, MetaData())
    if not include:
        del context.options["include_object"]
    config = alembic_config(None)  # an Alembic run in progress, as when env.py runs
    with EnvironmentContext(config, ScriptDirectory.from_config(config)):
        migration = MigrationContext.configure(connection, opts=context.options)
        diffs: list[Any] = compare_metadata(migration, context.options["target_metadata"])
        return diffs


async def test_alembic_env(sqlite: str) -> None:
    await asyncio.to_thread(upgrade, sqlite)
    engine = make_engine(sqlite)
    try:
        async with engine.connect() as connection:
            assert await connection.run_sync(proposed, True) == []
            dropped = {diff[1].name for diff in await connection.run_sync(proposed, False)}
    finally:
        await engine.dispose()
    assert dropped >= {"mersal_outbox", "mersal_inbox", "mersal_sagas", "mersal_schema"}


async def test_the_migrations_page_names_every_table_the_migrations_make(sqlite: str) -> None:
    await asyncio.to_thread(upgrade, sqlite)
    engine = make_engine(sqlite)
    try:
        async with engine.connect() as connection:
            made = await connection.run_sync(lambda sync: set(inspect(sync).get_table_names()))
    finally:
        await engine.dispose()
    page = (DOCS / "setup" / "migrations.md").read_text()
    assert made >= {"mersal_outbox", "mersal_inbox", "mersal_sagas", "mersal_schema"}
    assert sorted(table for table in made if f"`{table}`" not in page) == []


async def test_repositories(sqlite: str) -> None:
    assert await repositories.main(sqlite) == [
        ("c-1", "ada@example.org"),
        ("c-2", "alan@example.com"),
    ]


async def test_sharing_the_engine(sqlite: str) -> None:
    shared, rows, welcomed = await sharing_engine.main(sqlite)
    assert shared
    assert rows == ["ada@example.com"]
    assert welcomed == ["ada@example.com"]


@pytest.fixture
async def amqp_url(vhost: str) -> AsyncIterator[str]:
    """The session's vhost; the sample's queues are deleted afterwards."""
    url = f"amqp://guest:guest@{RABBITMQ_HOST}/{vhost}"
    yield url
    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel()
        for queue in ("docs.pings", "docs.pings.error"):
            await channel.queue_delete(queue)


@pytest.mark.integration
async def test_rabbitmq(amqp_url: str) -> None:
    assert await rabbitmq.main(amqp_url) == [0, 1, 2]


@pytest.mark.integration
async def test_amqp10(vhost: str) -> None:
    assert await amqp10.main(f"amqp10://guest:guest@{RABBITMQ_HOST}/{vhost}") == [0, 1, 2]


@pytest.mark.integration
async def test_cluster(vhost: str) -> None:
    url = f"amqp://guest:guest@{RABBITMQ_HOST}/{vhost}"
    dead = f"amqp://guest:guest@{RABBITMQ_HOST}:5699/{vhost}"  # nothing listens there
    try:
        handled = await cluster.main(url, dead)
    finally:
        async with await aio_pika.connect(url) as connection:
            channel = await connection.channel()
            for queue in ("docs.shipping", *(f"docs.shipping.partition.{n}" for n in range(8))):
                await channel.queue_delete(queue)
            await channel.exchange_delete("docs.shipping.partitions")
    for order_id in ("o-1", "o-2"):
        assert [step for key, step in handled if key == order_id] == [0, 1, 2]
    assert cluster.cluster_app("u", "p", ["h1", "h2"], "shop").transport.address == (
        "amqp://u:p@h1/shop;amqp://u:p@h2/shop"
    )
    assert cluster.classic("amqp://h/shop").queue_type == "classic"


@pytest.mark.integration
async def test_postgresql() -> None:
    async with postgres_database(migrate=True) as database:
        assert await postgresql.main(database) == ["o-1"]


def section(path: Path, name: str) -> str:
    """The lines between a file's `--8<-- [start:name]` and `[end:name]` markers, dedented."""
    lines = path.read_text().splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if f"[start:{name}]" in line]
    ends = [i for i, line in enumerate(lines) if f"[end:{name}]" in line]
    assert len(starts) == len(ends) == 1, f"{path}: one section {name!r}"
    chosen = [line for line in lines[starts[0] + 1 : ends[0]] if not SECTION.search(line)]
    indent = min(len(line) - len(line.lstrip()) for line in chosen if line.strip())
    return "".join(line[indent:] if line.strip() else line for line in chosen)


def test_every_sample_module_runs_in_a_test_here() -> None:
    modules = {path.stem for path in (DOCS / "samples").glob("*.py")} - {"__init__"}
    assert modules <= set(globals()), f"no test imports {sorted(modules - set(globals()))}"


@pytest.mark.parametrize(
    "page", [p for p in sorted(DOCS.rglob("*.md")) if p.name not in IN_DEPTH], ids=str
)
def test_the_python_on_the_new_pages_is_copied_not_typed(page: Path) -> None:
    text = page.read_text()
    typed = len(FENCE.findall(text)) - len(COPIED.findall(text))
    assert typed == 0, (
        f"{page.relative_to(DOCS)} has Python typed into the page: put it in a section of a "
        "module under docs/samples, put the line `<!-- copied from docs/samples/module.py:"
        "section by make docs-samples -->` where it goes and run `make docs-samples`"
    )
