"""`mersal outbox purge` of many rows: batched deletes, a progress line on a terminal only."""

from __future__ import annotations

import io
import sys

import pytest
from sqlalchemy import select

from mersal.messages import Envelope, Header
from mersal.transport import Outgoing
from mersal_sqlalchemy import SqlOutboxStore, make_engine, make_tables
from mersal_sqlalchemy.outbox import write_outbox
from tests.cli.conftest import mersal


class Terminal(io.StringIO):
    """A stream that says it is a terminal, and keeps what was written to it."""

    def isatty(self) -> bool:
        """Yes, a terminal."""
        return True


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
    database: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
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
