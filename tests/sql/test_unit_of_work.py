"""The unit of work: a handler's rows, its outbox rows and its inbox row commit together or not."""

from __future__ import annotations

import asyncio
import logging

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from mersal import App, ConfigurationError, MessageContext, RetryPolicy
from mersal.pipeline import Next
from mersal.testing import Harness
from mersal.transport import Outgoing
from mersal_sqlalchemy import SESSION
from tests.sql.support import (
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
