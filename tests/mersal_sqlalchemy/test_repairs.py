"""`mersal outbox list|retry|purge` on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg  # type: ignore[import-untyped]
import pytest
from sqlalchemy import Table, select
from sqlalchemy.ext.asyncio import AsyncEngine

from mersal.messages import Envelope, Header
from mersal.outbox import Relay
from mersal.transport import Outgoing
from mersal.transport.memory import MemoryTransport
from mersal_sqlalchemy import SqlOutboxStore, make_engine, make_tables
from mersal_sqlalchemy.outbox import write_outbox
from tests.support import Terminal, mersal, postgres_database

REASON = "Unroutable: no queue named 'sink': start the app that owns it\n(second line)"


@dataclass
class Outbox:
    """A seeded outbox: orders rows 1-3 (2 parked), billing row 4 (parked)."""

    database: str
    engine: AsyncEngine
    table: Table

    async def rows(self) -> dict[int, tuple[str | None, str | None]]:
        """Every row's id with its parked_reason and lease_until (as text)."""
        table = self.table
        query = select(table.c.id, table.c.parked_reason, table.c.lease_until)
        async with self.engine.connect() as connection:
            return {
                record.id: (
                    record.parked_reason,
                    None if record.lease_until is None else str(record.lease_until),
                )
                for record in await connection.execute(query)
            }


def outgoing(message_id: str, address: str = "sink") -> Outgoing:
    """A message to `address` with this id, as an app would have sent it."""
    headers = {Header.MESSAGE_ID: message_id, Header.TYPE: "tests.repairs.Ship.v1"}
    return Outgoing(address, Envelope(headers, b'{"n": 1}'))


@pytest.fixture
async def outbox(migrated_database: str) -> AsyncIterator[Outbox]:
    """The test's database (made by `mersal db upgrade`, as an operator's is) with four outbox
    rows, two of them parked."""
    database = migrated_database
    engine = make_engine(database)
    table = make_tables().outbox
    async with engine.begin() as connection:
        await write_outbox(
            connection, table, "orders", [outgoing(f"m{n}") for n in (1, 2, 3)], None
        )
        await write_outbox(connection, table, "billing", [outgoing("m4", "invoices")], None)
    orders = SqlOutboxStore(engine, table, "orders")
    claimed = await orders.claim(10)  # as the relay does before it parks a row
    assert [row.id for row in claimed] == [1, 2, 3]
    await orders.release([1, 3])
    await orders.park(2, REASON)
    await SqlOutboxStore(engine, table, "billing").park(4, "Unsendable: too large")
    try:
        yield Outbox(database, engine, table)
    finally:
        await engine.dispose()


async def test_list_shows_every_row_and_why_the_parked_ones_are_parked(
    outbox: Outbox, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        await mersal("outbox", "list", "--database", outbox.database) == 1
    )  # parked rows need an operator

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "ID",
        "APP",
        "KIND",
        "ADDRESS",
        "TYPE",
        "MESSAGE-ID",
        "ATTEMPTS",
        "CREATED",
        "PARKED",
        "REASON",
    ]
    rows = {line.split()[0]: line for line in lines[1:5]}
    assert rows["1"].split()[1:7] == ["orders", "send", "sink", "tests.repairs.Ship.v1", "m1", "1"]
    assert rows["1"].split()[-2:] == ["-", "-"]
    assert rows["2"].split()[5] == "m2"
    assert rows["2"].endswith("Unroutable: no queue named 'sink': start the app that owns it")
    assert "(second line)" not in rows["2"]
    assert rows["4"].split()[1:4] == ["billing", "send", "invoices"]
    assert rows["4"].endswith("Unsendable: too large")
    assert lines[5] == "4 outbox row(s), 2 of them parked"


async def test_list_filters_parked_rows_and_apps_and_stops_at_the_limit(
    outbox: Outbox, capsys: pytest.CaptureFixture[str]
) -> None:
    url = outbox.database
    assert (
        await mersal("outbox", "list", "--parked", "--database", url) == 1
    )  # parked rows need an operator
    parked = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in parked[1:-1]] == ["2", "4"]
    assert parked[-1] == "2 parked outbox row(s)"

    assert (
        await mersal("outbox", "list", "--app", "orders", "--parked", "--database", url) == 1
    )  # parked rows need an operator
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:-1]] == ["2"]

    assert (
        await mersal("outbox", "list", "--limit", "1", "--database", url) == 1
    )  # parked rows need an operator
    lines = capsys.readouterr().out.splitlines()
    assert "PARKED" not in lines[0]  # row 1 is not parked: no parked columns
    assert [line.split()[0] for line in lines[1:-1]] == ["1"]
    assert lines[-1].startswith("the first 1 of 4 outbox row(s) (--limit N for more)")

    assert await mersal("outbox", "list", "--app", "nobody", "--database", url) == 0
    assert capsys.readouterr().out == "no outbox row(s) of app 'nobody'\n"


async def test_a_retried_row_is_unparked_and_the_relay_publishes_it(
    outbox: Outbox, memory_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await mersal("outbox", "retry", "2", "--database", outbox.database) == 0
    assert capsys.readouterr().out.startswith("un-parked 1 row(s): 2;")
    assert (await outbox.rows())[2] == (None, None)

    transport = MemoryTransport(memory_url)
    await transport.start()
    await transport.declare("sink")
    relay = Relay(SqlOutboxStore(outbox.engine, outbox.table, "orders"), transport)
    try:
        assert await relay.flush() == 3  # rows 1 and 3 were waiting; 2 is back with them
        sink = await transport.consume("sink", prefetch=10)
        received = []
        for _ in range(3):
            async with asyncio.timeout(2):
                delivery = await sink.get()
            received.append(delivery.envelope.message_id)
            await delivery.ack()
    finally:
        await transport.stop()
    assert received == ["m1", "m2", "m3"]
    assert sorted(await outbox.rows()) == [4]  # billing's parked row is untouched


async def test_retry_all_takes_every_parked_row_of_the_app_named(
    outbox: Outbox, capsys: pytest.CaptureFixture[str]
) -> None:
    url = outbox.database
    assert await mersal("outbox", "retry", "--all", "--app", "billing", "--database", url) == 0
    assert capsys.readouterr().out.startswith("un-parked 1 row(s): 4;")
    rows = await outbox.rows()
    assert rows[4] == (None, None)
    assert rows[2][0] == REASON[:4000]

    assert await mersal("outbox", "retry", "--all", "--database", url) == 0
    assert capsys.readouterr().out.startswith("un-parked 1 row(s): 2;")
    assert all(reason is None for reason, _ in (await outbox.rows()).values())


async def test_retry_of_rows_that_are_not_parked_changes_nothing_and_says_so(
    outbox: Outbox, capsys: pytest.CaptureFixture[str]
) -> None:
    url = outbox.database
    before = await outbox.rows()
    assert await mersal("outbox", "retry", "1", "99", "--database", url) == 1
    output = capsys.readouterr()
    assert output.out.startswith("un-parked 0 row(s);")
    assert "1, 99" in output.err
    assert await mersal("outbox", "retry", "2", "--app", "billing", "--database", url) == 1
    assert await outbox.rows() == before

    assert await mersal("outbox", "retry", "--database", url) == 2
    assert await mersal("outbox", "retry", "2", "--all", "--database", url) == 2
    assert "row ids or --all" in capsys.readouterr().err
    assert await outbox.rows() == before


async def test_purge_deletes_parked_rows_only(
    outbox: Outbox, capsys: pytest.CaptureFixture[str]
) -> None:
    url = outbox.database
    assert await mersal("outbox", "purge", "1", "2", "--database", url) == 2
    refused = capsys.readouterr().err
    assert "nothing purged" in refused
    assert "not parked (the relay sends them): 1" in refused
    assert await mersal("outbox", "purge", "2", "77", "--database", url) == 2
    assert "not in the outbox: 77" in capsys.readouterr().err
    assert sorted(await outbox.rows()) == [1, 2, 3, 4]

    assert await mersal("outbox", "purge", "2", "4", "--database", url) == 0
    assert capsys.readouterr().out == "purged 2 parked row(s): 2, 4\n"
    assert sorted(await outbox.rows()) == [1, 3]


async def test_the_database_comes_from_the_environment(
    outbox: Outbox, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MERSAL_DATABASE", raising=False)
    assert await mersal("outbox", "list") == 2
    assert "needs --database URL or MERSAL_DATABASE" in capsys.readouterr().err

    monkeypatch.setenv("MERSAL_DATABASE", outbox.database)
    assert await mersal("outbox", "list", "--parked") == 1  # parked rows need an operator
    assert capsys.readouterr().out.endswith("2 parked outbox row(s)\n")


async def test_another_outbox_table_is_named_with_outbox_table(
    outbox: Outbox, capsys: pytest.CaptureFixture[str]
) -> None:
    url = outbox.database
    assert await mersal("outbox", "list", "--outbox-table", "other_outbox", "--database", url) == 2
    error = capsys.readouterr().err
    assert "there is no table other_outbox" in error
    assert "--outbox-table other_outbox" in error  # in the `mersal db upgrade` to run


async def test_a_missing_sqlite_file_is_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.db"
    assert await mersal("outbox", "list", "--database", f"sqlite+aiosqlite:///{missing}") == 2
    assert "there is no SQLite database" in capsys.readouterr().err
    assert not missing.exists()


@pytest.mark.integration
async def test_passwords_are_masked_in_errors(capsys: pytest.CaptureFixture[str]) -> None:
    url = "postgresql+asyncpg://postgres:s3cret-pw@127.0.0.1:1/nowhere"
    assert await mersal("outbox", "list", "--database", url) == 2
    error = capsys.readouterr().err
    assert "s3cret-pw" not in error
    assert "postgres:***@127.0.0.1:1/nowhere" in error


@pytest.mark.integration
async def test_passwords_are_masked_in_the_upgrade_hint(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with postgres_database(migrate=False) as url:
        with_password = url.replace("postgres@", "postgres:s3cret-pw@")  # trust: any password
        assert await mersal("outbox", "list", "--database", with_password) == 2
    error = capsys.readouterr().err
    assert "there is no table mersal_outbox" in error
    assert "s3cret-pw" not in error
    assert "postgres:***@" in error


@pytest.mark.integration
async def test_retry_on_postgresql_wakes_the_apps_relays(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with postgres_database(migrate=True) as url:
        engine = make_engine(url)
        table = make_tables().outbox
        try:
            async with engine.begin() as connection:
                await write_outbox(connection, table, "orders", [outgoing("m1")], None)
            await SqlOutboxStore(engine, table, "orders").park(1, REASON)
            listener = await asyncpg.connect(url.replace("+asyncpg", ""), timeout=5)
            notified: asyncio.Queue[str] = asyncio.Queue()
            try:
                await listener.add_listener(table.name, lambda *args: notified.put_nowait(args[-1]))
                assert await mersal("outbox", "retry", "1", "--database", url) == 0
                async with asyncio.timeout(5):
                    assert await notified.get() == "orders"  # the payload the relays wait for
            finally:
                await listener.close()
        finally:
            await engine.dispose()
    assert capsys.readouterr().out.startswith("un-parked 1 row(s): 1;")


# `mersal outbox purge` of many rows: batched deletes, a progress line on a terminal only.


async def park_rows(database: str, count: int) -> list[int]:
    """Write `count` outbox rows and park them all, as a relay would; their ids."""
    engine = make_engine(database)
    table = make_tables().outbox
    messages = [
        Outgoing("sink", Envelope({Header.MESSAGE_ID: f"m{n}", Header.TYPE: "t.Ship.v1"}, b"{}"))
        for n in range(count)
    ]
    try:
        async with engine.begin() as connection:
            await write_outbox(connection, table, "orders", messages, None)
        store = SqlOutboxStore(engine, table, "orders")
        ids = [row.id for row in await store.claim(count)]
        for row_id in ids:
            await store.park(row_id, "Unroutable: no queue named 'sink'")
        return ids
    finally:
        await engine.dispose()


async def row_ids(database: str) -> list[int]:
    """The ids of the outbox rows, in order."""
    engine = make_engine(database)
    table = make_tables().outbox
    try:
        async with engine.connect() as connection:
            return list(
                (await connection.execute(select(table.c.id).order_by(table.c.id))).scalars()
            )
    finally:
        await engine.dispose()


async def test_a_long_purge_shows_its_progress_on_a_terminal_only(
    migrated_database: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    database = migrated_database
    ids = await park_rows(database, 200)

    assert await mersal("outbox", "purge", *map(str, ids[:60]), "--database", database) == 0
    output = capsys.readouterr()
    assert output.out.startswith("purged 60 parked row(s): ")
    assert output.err == ""  # no terminal: no progress

    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    assert await mersal("outbox", "purge", *map(str, ids[60:190]), "--database", database) == 0
    assert screen.getvalue() == "\rpurged 100/130\rpurged 130/130\n"  # a batch is 100 rows
    assert capsys.readouterr().out.startswith("purged 130 parked row(s): ")
    assert await row_ids(database) == ids[190:]
