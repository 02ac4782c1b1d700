"""The FastAPI example end to end: HTTP request -> order row + outbox row -> worker -> invoice.

On RabbitMQ and PostgreSQL the worker runs as `mersal run` in a subprocess, as it would be
deployed; on `memory://` and SQLite both apps run in this process (no servers needed).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from uuid import uuid4

import aio_pika
import asyncpg  # type: ignore[import-untyped]
import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from examples.fastapi_orders import settings
from examples.fastapi_orders.db import Invoice, Order
from examples.fastapi_orders.schema import create_tables
from examples.fastapi_orders.web import WEB_APP, create_api
from examples.fastapi_orders.worker import create_app
from mersal_sqlalchemy import make_engine, make_tables
from tests.examples.conftest import mersal_run, ready, served
from tests.support import (
    RABBITMQ_HOST,
    eventually,
    free_port,
    postgres_database,
)

ROOT = Path(__file__).parents[2]
MERSAL = Path(sys.executable).with_name("mersal")


async def status_of(client: httpx.AsyncClient, order_id: str) -> str:
    """The order's status as GET /orders/{id} shows it."""
    response = await client.get(f"/orders/{order_id}")
    assert response.status_code == 200, response.text
    status: str = response.json()["status"]
    return status


async def table_counts(database: str) -> dict[str, int]:
    """How many rows the shop's and Mersal's tables hold."""
    tables = make_tables()
    engine = make_engine(database)
    try:
        async with engine.connect() as connection:
            counts = {}
            for name, table in (
                ("orders", Order.__table__),
                ("invoices", Invoice.__table__),
                ("outbox", tables.outbox),
                ("inbox", tables.inbox),
            ):
                query = select(func.count()).select_from(table)
                counts[name] = int(
                    (await connection.execute(query)).scalar_one()
                )
            return counts
    finally:
        await engine.dispose()


async def place_orders_and_see_them_billed(
    client: httpx.AsyncClient, database: str
) -> None:
    """POST an order (and a duplicate), then wait for the worker's invoice; check the tables."""
    placed = await client.post(
        "/orders", json={"order_id": "o-1", "amount": 9.5}
    )
    assert placed.status_code == 202, placed.text
    assert placed.json() == {
        "order_id": "o-1",
        "amount": 9.5,
        "status": "placed",
    }

    again = await client.post(
        "/orders", json={"order_id": "o-1", "amount": 1.0}
    )
    assert again.status_code == 409, again.text
    assert again.json() == {"detail": "order 'o-1' exists already"}

    async def billed() -> bool:
        return await status_of(client, "o-1") == "billed"

    await eventually(billed, "the worker billed o-1", timeout=20)
    counts = await eventually(
        lambda: _settled(database),
        "the outbox row deleted after its confirm",
        timeout=10,
    )
    assert counts == {"orders": 1, "invoices": 1, "outbox": 0, "inbox": 1}
    engine = make_engine(database)
    try:
        async with engine.connect() as connection:
            invoices = (
                await connection.execute(
                    select(Invoice.order_id, Invoice.amount)
                )
            ).all()
    finally:
        await engine.dispose()
    assert [tuple(row) for row in invoices] == [("o-1", 9.5)]


async def _settled(database: str) -> dict[str, int] | None:
    counts = await table_counts(database)
    return counts if counts["outbox"] == 0 and counts["inbox"] == 1 else None


async def test_the_example_on_memory_and_sqlite(tmp_path: Path) -> None:
    database = f"sqlite+aiosqlite:///{tmp_path / 'shop.db'}"
    transport = f"memory://shop-{uuid4().hex}"
    await create_tables(database)
    worker = create_app(transport=transport, database=database)
    api = create_api(transport=transport, database=database)
    # the worker first: it declares the queue the web layer sends to
    async with worker, served(api) as client:
        await place_orders_and_see_them_billed(client, database)


@contextlib.asynccontextmanager
async def notifications(
    database: str, channel: str
) -> AsyncIterator[list[str]]:
    """The payloads of the NOTIFYs on `channel` while the block runs."""
    url = (
        make_url(database)
        .set(drivername="postgresql")
        .render_as_string(hide_password=False)
    )
    connection = await asyncpg.connect(url)
    payloads: list[str] = []
    await connection.add_listener(
        channel, lambda *args: payloads.append(args[3])
    )
    try:
        yield payloads
    finally:
        await connection.close()


async def delete_queues(url: str, *names: str) -> None:
    """Delete the example's queues from the test vhost."""
    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel()
        for name in names:
            await channel.queue_delete(name)


@pytest.mark.integration
async def test_the_example_end_to_end_on_rabbitmq_and_postgresql(
    vhost: str,
) -> None:
    url = f"amqp://guest:guest@{RABBITMQ_HOST}/{vhost}"
    port = free_port()
    async with postgres_database(migrate=True) as database:
        await create_tables(database)
        env = {"MERSAL_TRANSPORT": url, "MERSAL_DATABASE": database}
        try:
            async with mersal_run(
                "examples.fastapi_orders.worker:create_app", env, port
            ) as worker:
                await eventually(
                    lambda: ready(f"http://127.0.0.1:{port}/readyz"),
                    "worker ready",
                    timeout=30,
                )
                api = create_api(transport=url, database=database)
                async with (
                    notifications(
                        database, make_tables().outbox.name
                    ) as notified,
                    served(api) as client,
                ):
                    await place_orders_and_see_them_billed(client, database)
                    # the commit of POST /orders wrote an outbox row: its NOTIFY names the app
                    assert notified == [WEB_APP]
                worker.send_signal(signal.SIGTERM)
                async with asyncio.timeout(30):
                    assert await worker.wait() == 0
        finally:
            await delete_queues(
                url, settings.ORDERS_QUEUE, settings.ORDERS_ERRORS
            )
