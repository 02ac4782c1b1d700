"""Issue 8, case 3 with a database: the message's session and transaction belong to Mersal.

A handler may not commit, roll back or close the message's session (the attempt fails and is
retried), a rollback behind Mersal's back fails the attempt at commit, `app.transaction(session)`
on the message's own session joins the message's transaction, and on another session inside a
handler it is refused. On SQLite and PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from lagom import Container
from sqlalchemy.ext.asyncio import AsyncSession

from mersal import App, ConfigurationError, MersalError, RetryPolicy
from tests.sql.support import (
    ORDERS,
    Order,
    OrderPlaced,
    PlaceOrder,
    Probe,
    Sink,
    billing_app,
    count,
    create_business_tables,
    outbox_empty,
    storage_of,
)
from tests.support import eventually

pytestmark = pytest.mark.timeout(60)

POLICY = RetryPolicy(immediate=1, delayed=[], error_queue="error")
"""Two attempts, then the error queue."""


def orders_app(database: str, memory_url: str, probe: Probe, handler: Any) -> App:
    """The orders app with `handler` for PlaceOrder and the probe in its container."""
    container = Container()
    container[Probe] = probe
    app = App("orders", transport=memory_url, database=database, retry=POLICY, container=container)
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
    orders = orders_app(database, memory_url, probe, EndingHandler)
    billing = billing_app(memory_url, probe)
    async with billing, orders:
        await orders.send(PlaceOrder("o-1"))
        await eventually(lambda: len(sink.ids("error")) == 1, "the message is dead-lettered")
        await eventually(
            lambda: sink.queue_settled("orders") and orders.in_flight == 0,
            "the delivery is acked and settled",
        )
        await assert_nothing_committed(orders)
    assert probe.calls == POLICY.max_attempts
    assert [type(error) for error in refused] == [MersalError] * POLICY.max_attempts
    assert probe.billed == []
    dead = next(o for o in sink.seen if o.address == "error")
    assert f"do not {verb} the message's session" in dead.envelope.headers["error-message"]


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
    orders = orders_app(database, memory_url, probe, SyncRollbackHandler)
    billing = billing_app(memory_url, probe)
    async with billing, orders:
        await orders.send(PlaceOrder("o-1"))
        await eventually(lambda: len(sink.ids("error")) == 1, "the message is dead-lettered")
        await eventually(
            lambda: sink.queue_settled("orders") and orders.in_flight == 0,
            "the delivery is acked and settled",
        )
        await assert_nothing_committed(orders)
    assert probe.calls == POLICY.max_attempts
    assert probe.billed == []
    dead = next(o for o in sink.seen if o.address == "error")
    assert "rolled back" in dead.envelope.headers["error-message"]


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
    orders = orders_app(database, memory_url, probe, BlockHandler)
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
    orders = orders_app(database, memory_url, probe, OtherSessionHandler)
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
