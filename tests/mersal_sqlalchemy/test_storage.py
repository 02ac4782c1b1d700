"""The unit of work: a handler's rows, its outbox rows and its inbox row commit together or not.

The message's session and transaction belong to Mersal: a handler may not commit, roll back or
close the session (the attempt fails and is retried), a rollback behind Mersal's back fails the
attempt at commit, `app.transaction(session)` on the message's own session joins the message's
transaction and on another session inside a handler is refused, and savepoints in a handler
commit or roll back without failing the message. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from lagom import Container
from sqlalchemy import insert, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from mersal import App, ConfigurationError, MersalError, MessageContext, RetryPolicy
from mersal.pipeline import Next
from mersal.testing import Harness
from mersal.transport import Outgoing
from mersal_sqlalchemy import SESSION
from tests.mersal_sqlalchemy.support import (
    ORDERS,
    Order,
    OrderPlaced,
    PlaceOrder,
    Probe,
    Ship,
    Sink,
    billing_app,
    count,
    create_business_tables,
    envelope_of,
    orders_app,
    outbox_empty,
    storage_of,
)
from tests.support import eventually


async def test_a_handler_that_raises_leaves_nothing_and_sends_nothing(
    database: str, memory_url: str
) -> None:
    await create_business_tables(database)
    probe = Probe()
    sink = await Sink(memory_url).start("error")
    orders, billing = orders_app(database, memory_url, probe), billing_app(memory_url, probe)
    async with billing, orders:
        storage = storage_of(orders)
        await orders.send(PlaceOrder("o-1", fail=True))
        await eventually(lambda: len(sink.ids("error")) == 1, "the message is dead-lettered")
        assert probe.calls == 1
        engine = storage.engine
        assert await count(engine, ORDERS) == 0
        assert await count(engine, storage.tables.outbox) == 0
        assert await count(engine, storage.tables.inbox) == 0
        assert storage.relay is not None
        assert await storage.relay.flush() == 0
    assert probe.billed == []
    assert [o.address for o in sink.seen] == ["orders", "error"]


async def test_a_handler_that_succeeds_commits_its_row_and_its_messages_leave(
    database: str, memory_url: str
) -> None:
    await create_business_tables(database)
    probe = Probe()
    orders, billing = orders_app(database, memory_url, probe), billing_app(memory_url, probe)
    async with billing, orders:
        storage = storage_of(orders)
        for n in range(3):
            await orders.send(PlaceOrder(f"o-{n}"))
        await eventually(lambda: len(probe.billed) == 3, "billing got every OrderPlaced")
        await eventually(lambda: outbox_empty(storage), "the relay deleted the confirmed rows")
        await eventually(lambda: orders.in_flight == 0, "every delivery settled")
        assert sorted(probe.billed) == ["o-0", "o-1", "o-2"]
        assert await count(storage.engine, ORDERS) == 3
        assert await count(storage.engine, storage.tables.outbox) == 0
        assert await count(storage.engine, storage.tables.inbox) == 3


async def test_a_handler_whose_rows_fail_at_commit_sends_nothing(
    database: str, memory_url: str
) -> None:
    """The rows are flushed at commit, after the outbox rows: that failure takes both back."""
    await create_business_tables(database)
    probe = Probe()
    sink = await Sink(memory_url).start("error")
    retry = RetryPolicy(immediate=0, delayed=[], error_queue="error")
    orders = App("orders", transport=memory_url, database=database, retry=retry)
    billing = billing_app(memory_url, probe)

    class PlaceWithFixedId:
        def __init__(self, app: App, session: AsyncSession) -> None:
            self.app, self.session = app, session

        async def __call__(self, message: PlaceOrder) -> None:
            self.session.add(Order(id=7, order_id=message.order_id))  # the second collides
            await self.app.publish(OrderPlaced(message.order_id))
            await self.app.send(Ship(7))

    orders.register(PlaceOrder, PlaceWithFixedId)
    orders.route(PlaceOrder, "orders")
    orders.route(Ship, "sink")
    async with billing, orders:
        storage = storage_of(orders)
        await orders.send(PlaceOrder("o-1"))
        await eventually(lambda: probe.billed == ["o-1"], "the first order billed")
        await orders.send(PlaceOrder("o-2"))
        await eventually(lambda: len(sink.ids("error")) == 1, "the second is dead-lettered")
        assert storage.relay is not None
        assert await storage.relay.flush() == 0
        assert await count(storage.engine, ORDERS) == 1
        assert await count(storage.engine, storage.tables.outbox) == 0
        assert await count(storage.engine, storage.tables.inbox) == 1
    assert probe.billed == ["o-1"]
    assert len(sink.ids("sink")) == 1


async def test_the_same_message_delivered_twice_is_handled_once(
    database: str, memory_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    await create_business_tables(database)
    probe = Probe()
    sink = await Sink(memory_url).start()
    orders, billing = orders_app(database, memory_url, probe), billing_app(memory_url, probe)
    async with billing, orders:
        storage = storage_of(orders)
        envelope = envelope_of(orders, PlaceOrder("o-1"), "the-same-id")
        caplog.set_level(logging.INFO, logger="mersal.receiving")
        await orders.transport.send([Outgoing("orders", envelope)])
        await eventually(lambda: probe.billed == ["o-1"], "the first copy was handled")
        await orders.transport.send([Outgoing("orders", envelope.copy())])
        await eventually(lambda: "duplicate" in caplog.text, "the second copy is skipped")
        await eventually(lambda: sink.queue_settled("orders"), "both copies are acked")
        assert storage.relay is not None
        assert await storage.relay.flush() == 0
        assert probe.calls == 1
        assert probe.billed == ["o-1"]
        assert await count(storage.engine, ORDERS) == 1
        assert await count(storage.engine, storage.tables.inbox) == 1
    assert "duplicate" in caplog.text and "skipped" in caplog.text


@pytest.mark.integration
async def test_a_copy_arriving_while_the_first_is_handled_waits_and_is_skipped(
    postgres_url: str, memory_url: str
) -> None:
    await create_business_tables(postgres_url)
    probe = Probe(gate=asyncio.Event())
    sink = await Sink(memory_url).start()
    orders, billing = orders_app(postgres_url, memory_url, probe), billing_app(memory_url, probe)
    async with billing, orders:
        storage = storage_of(orders)
        envelope = envelope_of(orders, PlaceOrder("o-1"), "concurrent-id")
        await orders.transport.send([Outgoing("orders", envelope), Outgoing("orders", envelope)])
        await eventually(probe.entered.is_set, "the first copy is in its handler")

        async def second_copy_waits_on_the_inbox_row() -> bool:
            query = text(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            async with storage.engine.connect() as connection:
                return bool((await connection.execute(query)).scalar_one())

        await eventually(second_copy_waits_on_the_inbox_row, "the second copy waits")
        assert probe.gate is not None
        probe.gate.set()
        await eventually(lambda: sink.queue_settled("orders"), "both copies are acked")
        await eventually(lambda: probe.billed == ["o-1"], "billing got the one OrderPlaced")
        assert probe.calls == 1
        assert await count(storage.engine, ORDERS) == 1
        assert await count(storage.engine, storage.tables.inbox) == 1


async def test_a_message_without_an_id_is_handled_without_the_inbox(
    database: str, memory_url: str
) -> None:
    await create_business_tables(database)
    probe = Probe()
    orders, billing = orders_app(database, memory_url, probe), billing_app(memory_url, probe)
    async with billing, orders:
        storage = storage_of(orders)
        envelope = envelope_of(orders, PlaceOrder("o-1"), "")
        del envelope.headers["message-id"]
        await orders.transport.send([Outgoing("orders", envelope)])
        await eventually(lambda: probe.billed == ["o-1"], "billing got the OrderPlaced")
        assert await count(storage.engine, ORDERS) == 1
        assert await count(storage.engine, storage.tables.inbox) == 0


async def test_each_attempt_gets_a_fresh_session(database: str, memory_url: str) -> None:
    await create_business_tables(database)
    sessions: list[object] = []
    probe = Probe()
    orders = orders_app(database, memory_url, probe, lease=30.0)  # attached now, not at start

    async def remember(context: MessageContext, next: Next[MessageContext]) -> None:
        sessions.append(context.items[SESSION])
        await next(context)

    orders.incoming.insert_after("inbox", "remember", remember)
    async with orders:
        await orders.send(PlaceOrder("o-1"))
        await orders.send(PlaceOrder("o-2"))
        await eventually(
            lambda: len(sessions) == 2 and orders.in_flight == 0,
            "both messages handled and settled",
        )
    assert sessions[0] is not sessions[1]


async def test_a_handler_may_not_commit_the_messages_session(
    database: str, memory_url: str
) -> None:
    await create_business_tables(database)
    sink = await Sink(memory_url).start("error")
    app = App(
        "orders",
        transport=memory_url,
        database=database,
        retry=RetryPolicy(immediate=0, delayed=[], error_queue="error"),
    )

    class CommittingHandler:
        def __init__(self, session: AsyncSession) -> None:
            self.session = session

        async def __call__(self, message: PlaceOrder) -> None:
            self.session.add(Order(order_id=message.order_id))
            await self.session.commit()

    app.register(PlaceOrder, CommittingHandler)
    app.route(PlaceOrder, "orders")
    async with app:
        await app.send(PlaceOrder("o-1"))
        await eventually(lambda: len(sink.ids("error")) == 1, "the message is dead-lettered")
        assert await count(storage_of(app).engine, ORDERS) == 0
    dead = next(o for o in sink.seen if o.address == "error")
    assert "do not commit the message's session" in dead.envelope.headers["error-message"]


async def test_the_harness_waits_for_the_outbox_to_drain(database: str, memory_url: str) -> None:
    await create_business_tables(database)
    probe = Probe()
    orders, billing = orders_app(database, memory_url, probe), billing_app(memory_url, probe)
    async with Harness(billing, orders) as bus:
        relay = storage_of(orders).relay
        assert relay is not None
        await relay.stop()  # committed rows now wait in the outbox
        await orders.send(PlaceOrder("o-1"))
        with pytest.raises(TimeoutError):
            await bus.idle(timeout=0.5)
        assert probe.billed == []
        relay.start()
        await bus.idle(timeout=20)
        assert probe.billed == ["o-1"]


@pytest.mark.parametrize("attached", ["by App(database=...)", "by attach(app)"])
async def test_a_commit_step_of_the_user_commits_through_the_outbox(
    database: str, memory_url: str, attached: str
) -> None:
    await create_business_tables(database)
    probe = Probe()
    seen: list[str] = []

    async def audited_commit(context: MessageContext, next: Next[MessageContext]) -> None:
        seen.append(context.message_id)
        await context.transaction.commit()
        await next(context)

    explicit = {"relay_batch": 100} if attached == "by attach(app)" else {}
    orders = orders_app(database, memory_url, probe, **explicit)
    billing = billing_app(memory_url, probe)
    orders.incoming.replace("commit", audited_commit)
    async with billing, orders:
        storage = storage_of(orders)
        await orders.send(PlaceOrder("o-1"))
        await eventually(lambda: probe.billed == ["o-1"], "billing got OrderPlaced")
        await eventually(lambda: orders.in_flight == 0, "the delivery settled")
        assert len(seen) == 1
        assert await count(storage.engine, ORDERS) == 1
        assert await count(storage.engine, storage.tables.inbox) == 1


async def test_an_app_whose_pipeline_lost_its_commit_step_does_not_start(
    database: str, memory_url: str
) -> None:
    orders = orders_app(database, memory_url, Probe())
    orders.incoming.remove("commit")
    with pytest.raises(ConfigurationError, match="no 'commit' step"):
        await orders.start()
    assert not orders.running


# A handler may not end the message's session, and a transaction block in a handler joins it.


RETRYING = RetryPolicy(immediate=1, delayed=[], error_queue="error")
"""Two attempts, then the error queue."""


def retrying_orders_app(database: str, memory_url: str, probe: Probe, handler: Any) -> App:
    """The orders app with `handler` for PlaceOrder and the probe in its container."""
    container = Container()
    container[Probe] = probe
    app = App(
        "orders", transport=memory_url, database=database, retry=RETRYING, container=container
    )
    app.register(PlaceOrder, handler)
    app.route(PlaceOrder, "orders")
    return app


async def assert_nothing_committed(app: App) -> None:
    """No business row, no outbox row and no inbox row."""
    storage = storage_of(app)
    assert await count(storage.engine, ORDERS) == 0
    assert await count(storage.engine, storage.tables.outbox) == 0
    assert await count(storage.engine, storage.tables.inbox) == 0


async def _commit(session: AsyncSession) -> None:
    await session.commit()


async def _rollback(session: AsyncSession) -> None:
    await session.rollback()


async def _close(session: AsyncSession) -> None:
    await session.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("end", "verb"),
    [
        pytest.param(_commit, "commit", id="commit"),
        pytest.param(_rollback, "roll back", id="rollback"),
        pytest.param(_close, "close", id="close"),
    ],
)
async def test_a_handler_may_not_end_the_messages_session(
    database: str,
    memory_url: str,
    end: Callable[[AsyncSession], Any],
    verb: str,
) -> None:
    await create_business_tables(database)
    probe = Probe()
    refused: list[BaseException] = []

    class EndingHandler:
        def __init__(self, app: App, session: AsyncSession, probe: Probe) -> None:
            self.app, self.session, self.probe = app, session, probe

        async def __call__(self, message: PlaceOrder) -> None:
            self.probe.calls += 1
            self.session.add(Order(order_id=message.order_id))
            await self.app.publish(OrderPlaced(message.order_id))
            await self.session.flush()
            try:
                await end(self.session)
            except BaseException as error:
                refused.append(error)
                raise

    sink = await Sink(memory_url).start("error")
    orders = retrying_orders_app(database, memory_url, probe, EndingHandler)
    billing = billing_app(memory_url, probe)
    async with billing, orders:
        await orders.send(PlaceOrder("o-1"))
        await eventually(lambda: len(sink.ids("error")) == 1, "the message is dead-lettered")
        await eventually(
            lambda: sink.queue_settled("orders") and orders.in_flight == 0,
            "the delivery is acked and settled",
        )
        await assert_nothing_committed(orders)
    assert probe.calls == RETRYING.max_attempts
    assert [type(error) for error in refused] == [MersalError] * RETRYING.max_attempts
    assert probe.billed == []
    dead = next(o for o in sink.seen if o.address == "error")
    assert f"do not {verb} the message's session" in dead.envelope.headers["error-message"]


@pytest.mark.timeout(60)
async def test_a_rollback_behind_mersals_back_fails_the_attempt_at_commit(
    database: str, memory_url: str
) -> None:
    await create_business_tables(database)
    probe = Probe()

    class SyncRollbackHandler:
        def __init__(self, app: App, session: AsyncSession, probe: Probe) -> None:
            self.app, self.session, self.probe = app, session, probe

        async def __call__(self, message: PlaceOrder) -> None:
            self.probe.calls += 1
            self.session.add(Order(order_id=f"{message.order_id}-undone"))
            await self.session.flush()
            await self.session.run_sync(lambda session: session.rollback())
            self.session.add(Order(order_id=message.order_id))
            await self.app.publish(OrderPlaced(message.order_id))

    sink = await Sink(memory_url).start("error")
    orders = retrying_orders_app(database, memory_url, probe, SyncRollbackHandler)
    billing = billing_app(memory_url, probe)
    async with billing, orders:
        await orders.send(PlaceOrder("o-1"))
        await eventually(lambda: len(sink.ids("error")) == 1, "the message is dead-lettered")
        await eventually(
            lambda: sink.queue_settled("orders") and orders.in_flight == 0,
            "the delivery is acked and settled",
        )
        await assert_nothing_committed(orders)
    assert probe.calls == RETRYING.max_attempts
    assert probe.billed == []
    dead = next(o for o in sink.seen if o.address == "error")
    assert "rolled back" in dead.envelope.headers["error-message"]


@pytest.mark.timeout(60)
async def test_a_transaction_block_on_the_messages_session_joins_the_message(
    database: str, memory_url: str
) -> None:
    await create_business_tables(database)
    probe = Probe()
    joined: list[bool] = []

    class BlockHandler:
        def __init__(self, app: App, session: AsyncSession, probe: Probe) -> None:
            self.app, self.session, self.probe = app, session, probe

        async def __call__(self, message: PlaceOrder) -> None:
            self.probe.calls += 1
            app = self.app
            async with app.transaction(self.session) as transaction:
                joined.append(transaction.session is self.session)
                self.session.add(Order(order_id=message.order_id))
                await app.publish(OrderPlaced(f"{message.order_id} in the block"))
            await app.publish(OrderPlaced(f"{message.order_id} after the block"))
            if self.probe.calls == 1:
                raise RuntimeError("the first attempt fails after its block")

    sink = await Sink(memory_url).start("error")
    orders = retrying_orders_app(database, memory_url, probe, BlockHandler)
    billing = billing_app(memory_url, probe)
    async with billing, orders:
        storage = storage_of(orders)
        await orders.send(PlaceOrder("o-1"))
        await eventually(lambda: len(probe.billed) == 2, "both events of attempt 2 arrive")
        await eventually(lambda: outbox_empty(storage), "the relay sent every row")
        await eventually(
            lambda: sink.queue_settled("orders") and orders.in_flight == 0,
            "the delivery is acked and settled",
        )
        assert await count(storage.engine, ORDERS) == 1
        assert await count(storage.engine, storage.tables.inbox) == 1
    assert probe.calls == 2
    assert joined == [True, True]
    assert sorted(probe.billed) == ["o-1 after the block", "o-1 in the block"]
    assert sink.ids("error") == []


@pytest.mark.timeout(60)
async def test_a_transaction_block_on_another_session_inside_a_handler_is_refused(
    database: str, memory_url: str
) -> None:
    await create_business_tables(database)
    probe = Probe()
    refused: list[BaseException] = []

    class OtherSessionHandler:
        def __init__(self, app: App, session: AsyncSession, probe: Probe) -> None:
            self.app, self.session, self.probe = app, session, probe

        async def __call__(self, message: PlaceOrder) -> None:
            self.probe.calls += 1
            app = self.app
            other = AsyncSession(storage_of(app).engine)
            try:
                async with app.transaction(other):
                    await app.publish(OrderPlaced(f"{message.order_id} in the other session"))
            except ConfigurationError as error:
                refused.append(error)
            finally:
                await other.close()
            self.session.add(Order(order_id=message.order_id))
            await app.publish(OrderPlaced(message.order_id))

    sink = await Sink(memory_url).start("error")
    orders = retrying_orders_app(database, memory_url, probe, OtherSessionHandler)
    billing = billing_app(memory_url, probe)
    async with billing, orders:
        storage = storage_of(orders)
        await orders.send(PlaceOrder("o-1"))
        await eventually(lambda: probe.billed == ["o-1"], "the handler's own event arrives")
        await eventually(lambda: outbox_empty(storage), "the relay sent every row")
        await eventually(
            lambda: sink.queue_settled("orders") and orders.in_flight == 0,
            "the delivery is acked and settled",
        )
        assert await count(storage.engine, ORDERS) == 1
        assert await count(storage.engine, storage.tables.outbox) == 0
    assert probe.calls == 1
    assert len(refused) == 1
    assert probe.billed == ["o-1"]
    assert sink.ids("error") == []


STYLES = ("committed", "committed explicitly", "rolled back", "failed flush")


@dataclass
class Work:
    """A command whose handler writes a row, then works in a savepoint in one of STYLES."""

    n: int
    style: str


class Undo(Exception):
    """Raised inside a savepoint to roll it back."""


# Savepoints in a handler (`session.begin_nested()`): commit, commit explicitly and roll back
# without failing the message; a savepoint's rollback forgets the messages sent in it.


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


@pytest.mark.timeout(60)
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


@dataclass
class Entry:
    n: int


async def test_a_transaction_given_an_engine_is_refused_saying_what_to_give(
    memory_url: str, tmp_path: Path
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'app.db'}"
    app = App("writing", transport=memory_url, database=url)
    app.route(Entry, "writing")
    engine = create_async_engine(url)
    try:
        async with app:
            with pytest.raises(ConfigurationError) as refused:
                async with app.transaction(engine):  # type: ignore[arg-type]
                    await app.send(Entry(1))
            assert await app.storage.pending() == 0
    finally:
        await engine.dispose()

    assert str(refused.value).startswith("app.transaction(AsyncEngine): give it the AsyncSession")
