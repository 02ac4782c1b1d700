"""`app.transaction(session)`: the caller's writes and the messages commit together or not."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from mersal import App, EncodeError
from mersal_sqlalchemy import make_engine
from tests.mersal_sqlalchemy.support import (
    ORDERS,
    Boom,
    Order,
    Probe,
    Ship,
    Sink,
    count,
    create_business_tables,
    orders_app,
    storage_of,
)
from tests.support import eventually


@pytest.fixture
async def user_engine(database: str) -> AsyncIterator[AsyncEngine]:
    """The caller's own engine on the app's database, with the business tables."""
    await create_business_tables(database)
    engine = make_engine(database)
    yield engine
    await engine.dispose()


async def nothing_left(app: App) -> bool:
    """Whether the relay finds nothing to send."""
    relay = storage_of(app).relay
    assert relay is not None
    return await relay.flush() == 0


@pytest.mark.parametrize("written", ["by the ORM", "by a Core statement"])
async def test_rows_on_the_session_and_messages_commit_together(
    database: str, user_engine: AsyncEngine, memory_url: str, written: str
) -> None:
    sink = await Sink(memory_url).start()
    app = orders_app(database, memory_url, Probe())
    async with app, AsyncSession(user_engine) as session:
        async with app.transaction(session):
            if written == "by the ORM":
                session.add(Order(order_id="o-1"))
            else:
                await session.execute(ORDERS.insert().values(order_id="o-1"))
            sent = [await app.send(Ship(n)) for n in range(2)]
        await eventually(lambda: sink.ids() == sent, "both messages leave after the commit")
    assert await count(user_engine, ORDERS) == 1


async def test_raising_inside_the_block_leaves_neither_rows_nor_messages(
    database: str, user_engine: AsyncEngine, memory_url: str
) -> None:
    sink = await Sink(memory_url).start()
    app = orders_app(database, memory_url, Probe())
    async with app, AsyncSession(user_engine) as session:
        with pytest.raises(Boom):
            async with app.transaction(session):
                session.add(Order(order_id="o-1"))
                await session.flush()
                await app.send(Ship(1))
                raise Boom("the request fails")
        assert not session.in_transaction()
        assert await nothing_left(app)
        assert await count(user_engine, ORDERS) == 0
        assert await count(user_engine, storage_of(app).tables.outbox) == 0
    assert sink.ids() == []


async def test_a_transaction_the_caller_began_is_the_one_that_commits(
    database: str, user_engine: AsyncEngine, memory_url: str
) -> None:
    sink = await Sink(memory_url).start()
    app = orders_app(database, memory_url, Probe())
    async with app, AsyncSession(user_engine) as session:
        async with session.begin():
            session.add(Order(order_id="o-1"))
            async with app.transaction(session):
                session.add(Order(order_id="o-2"))
                sent = await app.send(Ship(1))
        await eventually(lambda: sink.ids() == [sent], "the message leaves after the commit")
    assert await count(user_engine, ORDERS) == 2


async def test_a_connection_works_like_a_session(
    database: str, user_engine: AsyncEngine, memory_url: str
) -> None:
    sink = await Sink(memory_url).start()
    app = orders_app(database, memory_url, Probe())
    async with app, user_engine.connect() as connection:
        async with app.transaction(connection):
            await connection.execute(ORDERS.insert().values(order_id="o-1"))
            sent = await app.send(Ship(1))
        await eventually(lambda: sink.ids() == [sent], "the message leaves after the commit")
        with pytest.raises(Boom):
            async with app.transaction(connection):
                await connection.execute(ORDERS.insert().values(order_id="o-2"))
                await app.send(Ship(2))
                raise Boom("no")
        assert await nothing_left(app)
    assert await count(user_engine, ORDERS) == 1
    assert sink.ids() == [sent]


async def test_without_a_session_the_block_uses_one_of_the_apps_own(
    database: str, memory_url: str
) -> None:
    sink = await Sink(memory_url).start()
    app = orders_app(database, memory_url, Probe())
    async with app:
        async with app.transaction():
            sent = await app.send(Ship(1))
        with pytest.raises(Boom):
            async with app.transaction():
                await app.send(Ship(2))
                raise Boom("no")
        await eventually(lambda: sink.ids() == [sent], "only the committed message leaves")
        assert await nothing_left(app)


async def test_a_message_its_receiver_could_not_decode_is_refused_in_the_block_not_at_commit(
    database: str, user_engine: AsyncEngine, memory_url: str
) -> None:
    sink = await Sink(memory_url).start()
    app = orders_app(database, memory_url, Probe())
    async with app, AsyncSession(user_engine) as session:
        async with app.transaction(session):
            session.add(Order(order_id="o-1"))
            with pytest.raises(EncodeError) as raised:
                await app.send(Ship("2"))  # type: ignore[arg-type]
            sent = await app.send(Ship(1))
        await eventually(lambda: sink.ids() == [sent], "the valid message leaves after commit")
        assert await nothing_left(app)
    assert await count(user_engine, ORDERS) == 1
    assert str(raised.value) == (
        "cannot send Ship: field n holds a str ('2') where Ship declares int; convert the value "
        "before sending"
    )
