"""The dashboard's sagas and outbox pages: sagas found by type and correlation with their
timeouts, parked outbox rows retried and purged."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from sqlalchemy import select, update

from mersal import App, Header, RetryPolicy
from mersal.messages import Envelope
from mersal.sagas import Saga
from mersal.transport import Outgoing
from mersal_dashboard import Dashboard, source_of
from mersal_sqlalchemy.outbox import write_outbox
from tests.mersal_dashboard.conftest import TOKEN
from tests.support import eventually

pytestmark = pytest.mark.integration


@dataclass
class Subscribe:
    customer: str


@dataclass
class Renew:
    customer: str


@dataclass
class Subscription:
    customer: str = ""
    plan: str = ""
    renewals: list[str] = field(default_factory=list)


class Subscriptions(Saga[Subscription], name="tests.dashboard.Subscriptions"):
    started_by = (Subscribe,)
    correlation = {Subscribe: "customer", Renew: "customer"}

    async def subscribe(self, message: Subscribe) -> None:
        self.data.customer = message.customer
        self.data.plan = "<b>gold</b>"

    async def renew(self, message: Renew) -> None:
        self.data.renewals.append("renewed")


@pytest.fixture
async def billing(memory_url: str, database: str, prefix: str) -> AsyncIterator[App]:
    """A billing app with subscriptions, started, and stopped (its rows stay) before the test."""
    app = App(
        f"{prefix}-billing",
        transport=memory_url,
        database=database,
        retry=RetryPolicy(immediate=0, delayed=[]),
    )
    app.register_saga(Subscriptions)
    app.route(Subscribe, app.name)
    async with app:
        for customer in ("c-1", "c-2", "c-3"):
            await app.send(Subscribe(customer))
        await eventually(lambda: _saga_count(app, 3), "three subscriptions")
    yield app


async def _saga_count(app: App, expected: int) -> bool:
    storage = app.storage
    assert storage is not None
    tables = storage.tables  # type: ignore[attr-defined]
    async with storage.engine.connect() as connection:  # type: ignore[attr-defined]
        rows = await connection.execute(
            select(tables.sagas.c.id).where(tables.sagas.c.app == app.name)
        )
        return len(rows.all()) == expected


@pytest.fixture
async def served(billing: App) -> AsyncIterator[tuple[Dashboard, str]]:
    """The billing app's dashboard (the app itself stopped: no relay sends its outbox)."""
    dashboard = Dashboard([source_of(billing)], token=TOKEN, interval=0.2, ingest=False)
    async with dashboard.serving() as url:
        yield dashboard, url


async def test_a_saga_is_found_by_its_correlation_with_its_data_and_timeouts(
    billing: App, served: tuple[Dashboard, str]
) -> None:
    dashboard, url = served
    source = dashboard.sources[billing.name]
    assert source.engine is not None
    async with source.engine.connect() as connection:
        saga_id = (
            (
                await connection.execute(
                    select(source.tables.sagas.c.id).where(
                        source.tables.sagas.c.app == billing.name
                    )
                )
            )
            .scalars()
            .first()
        )
    assert saga_id is not None
    timeout = Envelope(
        {Header.SAGA_ID: saga_id, Header.TYPE: "tests.Renew", Header.DELIVER_AT: "2030-01-01"},
        b"{}",
    )
    async with source.engine.begin() as connection:
        await write_outbox(
            connection, source.tables.outbox, billing.name, [Outgoing(billing.name, timeout)], None
        )
    async with aiohttp.ClientSession() as client:
        listing = await (await client.get(f"{url}/apps/{billing.name}/sagas")).text()
        found = await (
            await client.get(
                f"{url}/apps/{billing.name}/sagas",
                params={"saga": "tests.dashboard.Subscriptions", "id": saga_id},
            )
        ).text()
        none = await (
            await client.get(f"{url}/apps/{billing.name}/sagas", params={"correlation": "nobody"})
        ).text()
    assert 'tests.dashboard.Subscriptions</a></td><td class="num">3</td>' in listing
    assert f'data-saga-id="{saga_id}"' in found and found.count("data-saga-id=") == 1
    assert "&lt;b&gt;gold&lt;/b&gt;" in found
    assert "tests.Renew, due 2030-01-01" in found
    assert "no saga matches" in none


async def test_parked_rows_are_retried_and_purged_from_the_outbox_page(
    billing: App, served: tuple[Dashboard, str]
) -> None:
    dashboard, url = served
    source = dashboard.sources[billing.name]
    assert source.engine is not None
    table = source.tables.outbox
    rows = [Outgoing(billing.name, Envelope({Header.TYPE: f"t{n}"}, b"{}")) for n in range(2)]
    async with source.engine.begin() as connection:
        await write_outbox(connection, table, billing.name, rows, None)
        await connection.execute(
            update(table).values(parked_at=table.c.created_at, parked_reason="<i>refused</i>")
        )
        ids = sorted((await connection.execute(select(table.c.id))).scalars())
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as client:
        page = await (await client.get(f"{url}/apps/{billing.name}/outbox")).text()
        assert "&lt;i&gt;refused&lt;/i&gt;" in page and f'data-row="{ids[1]}"' in page
        purged = await client.post(
            f"{url}/apps/{billing.name}/outbox/do",
            data={"action": "purge", "id": str(ids[0])},
            headers=bearer,
        )
        await eventually(lambda: _done(client, str(purged.url)), "the purge to finish", timeout=10)
        retried = await client.post(
            f"{url}/apps/{billing.name}/outbox/do",
            data={"action": "retry", "id": str(ids[1])},
            headers=bearer,
        )
        await eventually(lambda: _done(client, str(retried.url)), "the retry", timeout=10)
        outcome = await (await client.get(str(retried.url))).text()
    async with source.engine.connect() as connection:
        left = (await connection.execute(select(table.c.id, table.c.parked_at))).all()
    assert "1 row(s) un-parked" in outcome
    # the dashboard sent the un-parked row itself (its transport), so none is left
    assert left == []


async def _done(client: aiohttp.ClientSession, url: str) -> bool:
    page = await (await client.get(url)).text()
    return 'data-job-state="done"' in page
