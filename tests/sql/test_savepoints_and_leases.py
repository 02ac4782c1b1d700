"""Regressions of an adversarial review, on SQLite and PostgreSQL with the memory transport.

Savepoints in a handler (`session.begin_nested()`) commit, commit explicitly and roll back
without failing the message, and a savepoint's rollback forgets the messages sent in it (p21);
outbox rows the broker keeps refusing do not hold back the rows written after them (p02);
after an operator purges or retries the parked rows, a busy app becomes healthy again within
about the relay's poll interval (p23).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from sqlalchemy import insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from mersal import App, MersalError, RetryPolicy
from mersal.transport import Outgoing
from mersal.transport.memory import MemoryTransport
from mersal_sqlalchemy import attach
from tests.cli.conftest import mersal
from tests.sql.support import (
    ORDERS,
    Order,
    Ship,
    Sink,
    count,
    create_business_tables,
    outbox_empty,
    storage_of,
)
from tests.support import DelegatingTransport, eventually

pytestmark = pytest.mark.timeout(60)

STYLES = ("committed", "committed explicitly", "rolled back", "failed flush")


@dataclass
class Work:
    """A command whose handler writes a row, then works in a savepoint in one of STYLES."""

    n: int
    style: str


@dataclass
class ToFull:
    """A command to a queue that refuses everything."""

    n: int


@dataclass
class Lost:
    """A command routed to a queue nobody declared (until the test does)."""

    n: int


class Undo(Exception):
    """Raised inside a savepoint to roll it back."""


# p21: savepoints in a handler.


class SavepointHandler:
    """Writes an outer row, then a row and a send in a savepoint it commits or rolls back."""

    calls: Counter[str]

    def __init__(self, app: App, session: AsyncSession) -> None:
        self.app = app
        self.session = session

    async def __call__(self, message: Work) -> None:
        """Handle one message."""
        SavepointHandler.calls[message.style] += 1
        session, style = self.session, message.style
        await session.execute(insert(ORDERS).values(order_id=f"{style}: outer"))
        if style == "committed":
            async with session.begin_nested():
                await session.execute(insert(ORDERS).values(order_id=f"{style}: savepoint"))
                await self.app.send(Ship(100 + message.n))
        elif style == "committed explicitly":
            savepoint = await session.begin_nested()
            await session.execute(insert(ORDERS).values(order_id=f"{style}: savepoint"))
            await self.app.send(Ship(100 + message.n))
            await savepoint.commit()
        elif style == "failed flush":  # the savepoint rolls back; the message goes on
            try:
                async with session.begin_nested():
                    await self.app.send(Ship(100 + message.n))  # undone with the savepoint
                    session.add_all(
                        [Order(id=10_000, order_id="a"), Order(id=10_000, order_id="b")]
                    )
                    await session.flush()
            except IntegrityError:
                pass
        else:
            try:
                async with session.begin_nested():
                    await session.execute(insert(ORDERS).values(order_id=f"{style}: undone"))
                    await self.app.send(Ship(100 + message.n))  # undone with the savepoint
                    raise Undo("undo the savepoint's row only")
            except Undo:
                pass
        await self.app.send(Ship(message.n))


async def test_savepoints_in_a_handler_commit_or_roll_back_and_the_message_commits_once(
    database: str, memory_url: str
) -> None:
    await create_business_tables(database)
    sink = await Sink(memory_url).start("error")
    SavepointHandler.calls = Counter()
    app = App(
        "savepoints",
        transport=memory_url,
        database=database,
        retry=RetryPolicy(immediate=0, delayed=[], error_queue="error"),
    )
    app.register(Work, SavepointHandler)
    app.route(Work, "savepoints")
    app.route(Ship, "sink")
    async with app:
        storage = storage_of(app)
        for n, style in enumerate(STYLES):
            await app.send(Work(n, style))

        async def finished() -> bool:
            return (
                sink.queue_settled("savepoints")
                and await outbox_empty(storage)
                and len(sink.ids()) + len(sink.ids("error")) >= len(STYLES) + 2
            )

        await eventually(finished, "every message handled or dead-lettered", timeout=10)
        async with storage.engine.connect() as connection:
            rows = (await connection.execute(select(ORDERS.c.order_id))).scalars().all()
        handled = await count(storage.engine, storage.tables.inbox)

    assert sink.ids("error") == []
    assert dict(SavepointHandler.calls) == dict.fromkeys(STYLES, 1)
    assert sorted(rows) == sorted(
        [
            "committed: outer",
            "committed: savepoint",
            "committed explicitly: outer",
            "committed explicitly: savepoint",
            "rolled back: outer",
            "failed flush: outer",
        ]
    )
    shipped = sorted(json.loads(o.envelope.body)["n"] for o in sink.seen if o.address == "sink")
    assert shipped == [0, 1, 2, 3, 100, 101]  # not 102, 103: sent in savepoints rolled back
    assert sink.duplicates() == {}
    assert handled == len(STYLES)


# p02: rows the broker keeps refusing, and the rows behind them.


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


# p23: healthy again after an operator deals with the parked rows.


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
