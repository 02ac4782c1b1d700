"""The dashboard over HTTP: what its pages show of the store and the broker, and who may act."""

from __future__ import annotations

import asyncio
import html
import re

import aiohttp
import pytest
from sqlalchemy import select, text, update

from mersal import Header
from mersal.messages import Envelope
from mersal.transport import Outgoing
from mersal_dashboard import Dashboard, source_of
from mersal_sqlalchemy.outbox import write_outbox
from tests.mersal_dashboard.conftest import TOKEN, Served
from tests.payments import Payments, running_payments
from tests.support import add_vhost, delete_vhost, eventually

pytestmark = pytest.mark.integration


async def signed_in(served: Served) -> tuple[aiohttp.ClientSession, str]:
    """A client signed in with the token, and the CSRF field its forms carry."""
    client = aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))
    answer = await client.post(f"{served.url}/signin", data={"token": TOKEN, "then": "/"})
    assert answer.status == 200, await answer.text()
    page = await client_page(client, f"{served.url}/signin")
    assert "Sign out" in page
    return client, _csrf_of(page)


async def client_page(client: aiohttp.ClientSession, url: str) -> str:
    """The page at `url`, which must answer 200."""
    answer = await client.get(url)
    assert answer.status == 200, await answer.text()
    return await answer.text()


def _csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert found is not None, page
    return found.group(1)


async def test_a_failed_message_is_ingested_and_shown_in_its_group(
    payments: Payments, served: Served
) -> None:
    await payments.fail("order-1", "order-2")
    failures = await payments.stored(2)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as client:
        page = await client_page(client, f"{served.url}/apps/{payments.app.name}/failures")
        detail = await client_page(
            client, f"{served.url}/apps/{payments.app.name}/failures/{failures[0].id}"
        )
    assert page.count('data-group="') == 1
    assert f"{html.escape(failures[0].group_label)}</a>" in page
    assert failures[0].group_label.startswith("CardDeclined: card declined for order")
    assert failures[0].handler is not None and failures[0].handler.endswith(":charge")
    assert f'data-failure="{failures[0].id}"' in page and f'data-failure="{failures[1].id}"' in page
    assert "card declined for order order-" in detail
    assert "Traceback" in detail and "raise CardDeclined" in detail


async def test_a_retry_signed_in_sends_the_message_back_and_it_is_handled_once(
    payments: Payments, served: Served
) -> None:
    await payments.fail("order-7")
    [failure] = await payments.stored(1)
    payments.broken = False
    client, csrf = await signed_in(served)
    async with client:
        answer = await client.post(
            f"{served.url}/apps/{payments.app.name}/failures/do",
            data={"csrf": csrf, "action": "retry", "id": str(failure.id)},
        )
        assert answer.status == 200
        assert "/jobs/" in str(answer.url)
        await eventually(
            lambda: _job_done(client, str(answer.url)), "the retry job to finish", timeout=10
        )
    await eventually(lambda: payments.handled == ["order-7"], "the retried order handled")
    assert await payments.store.get(failure.id) is None
    assert payments.handled == ["order-7"]


async def _job_done(client: aiohttp.ClientSession, url: str) -> bool:
    return 'data-job-state="done"' in await client_page(client, url)


async def test_a_delete_removes_the_failures_of_a_whole_group(
    payments: Payments, served: Served
) -> None:
    await payments.fail("order-1", "order-2", "order-3")
    failures = await payments.stored(3)
    client, csrf = await signed_in(served)
    chosen = {"csrf": csrf, "action": "delete", "group": failures[0].group_key}
    async with client:
        confirm = await client.post(
            f"{served.url}/apps/{payments.app.name}/failures/confirm", data=chosen
        )
        asked = await confirm.text()
        answer = await client.post(
            f"{served.url}/apps/{payments.app.name}/failures/do", data=chosen
        )
        await eventually(lambda: _job_done(client, str(answer.url)), "the delete job", timeout=10)
    assert "Delete 3 failures?" in asked
    assert f"<strong>{html.escape(failures[0].group_label)}</strong>" in asked
    assert await payments.store.count() == 0


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("no session", "sign in with the dashboard"),
        ("no csrf", "the form did not come from this dashboard"),
        ("other origin", "another site"),
        ("cross-site fetch", "another site"),
        ("wrong bearer", "the token is wrong"),
    ],
)
async def test_an_action_without_the_token_or_from_another_site_is_refused(
    payments: Payments, served: Served, how: str, expected: str
) -> None:
    await payments.fail("order-1")
    [failure] = await payments.stored(1)
    client, csrf = await signed_in(served)
    data = {"csrf": csrf, "action": "delete", "id": str(failure.id)}
    headers: dict[str, str] = {}
    if how == "no session":
        client.cookie_jar.clear()
    elif how == "no csrf":
        del data["csrf"]
    elif how == "other origin":
        headers["Origin"] = "http://evil.example"
    elif how == "cross-site fetch":
        headers["Sec-Fetch-Site"] = "cross-site"
    else:
        client.cookie_jar.clear()
        headers["Authorization"] = "Bearer not-the-token-at-all"
    async with client:
        answer = await client.post(
            f"{served.url}/apps/{payments.app.name}/failures/do", data=data, headers=headers
        )
        text = await answer.text()
    assert answer.status == 403
    assert expected in text
    assert await payments.store.get(failure.id) is not None


async def test_the_token_as_a_bearer_header_allows_an_action_without_a_session(
    payments: Payments, served: Served
) -> None:
    await payments.fail("order-1")
    [failure] = await payments.stored(1)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as client:
        answer = await client.post(
            f"{served.url}/apps/{payments.app.name}/failures/do",
            data={"action": "delete", "id": str(failure.id)},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        await eventually(lambda: _job_done(client, str(answer.url)), "the delete job", timeout=10)
    assert await payments.store.get(failure.id) is None


async def test_a_wrong_token_does_not_sign_in(served: Served) -> None:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as client:
        answer = await client.post(f"{served.url}/signin", data={"token": "x" * 30})
        assert answer.status == 403
        assert "That is not the token" in await answer.text()
        assert not client.cookie_jar.filter_cookies(served.url)


async def test_signing_in_never_sends_the_browser_to_another_site(served: Served) -> None:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as client:
        for then in ("//evil.example/", "https://evil.example/", "/\\evil.example"):
            answer = await client.post(
                f"{served.url}/signin", data={"token": TOKEN, "then": then}, allow_redirects=False
            )
            assert answer.status == 303
            assert answer.headers["Location"] == "/"


async def test_without_a_token_the_dashboard_is_read_only_and_leaves_the_error_queue_alone(
    payments: Payments, read_only: Served
) -> None:
    await payments.fail("order-1")
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as client:
        await eventually(
            lambda: _error_queue_holds(client, read_only, payments, "1"),
            "the overview to count the message in the error queue",
        )
        page = await client_page(client, f"{read_only.url}/apps/{payments.app.name}/failures")
        answer = await client.post(
            f"{read_only.url}/apps/{payments.app.name}/failures/do",
            data={"action": "delete", "group": "x"},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert answer.status == 403
        assert "read-only" in await answer.text()
    assert "read-only" in page and "Retry selected" not in page
    assert await payments.store.count() == 0


async def _error_queue_holds(
    client: aiohttp.ClientSession, served: Served, payments: Payments, count: str
) -> bool:
    page = await client_page(client, f"{served.url}/live/overview")
    return f'data-figure="error-queue">{count}<' in page


async def test_a_script_in_a_header_is_shown_as_text(payments: Payments, served: Served) -> None:
    hostile = '<script>window.pwned = 1</script><img src=x onerror="alert(1)">'
    await payments.fail("order-1", headers={"x-note": hostile, "<b>name</b>": "v"})
    [failure] = await payments.stored(1)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as client:
        answer = await client.get(f"{served.url}/apps/{payments.app.name}/failures/{failure.id}")
        page = await answer.text()
    assert "<script>window.pwned" not in page and "<img src=x" not in page
    assert "&lt;script&gt;window.pwned = 1&lt;/script&gt;" in page
    assert "&lt;b&gt;name&lt;/b&gt;" in page
    assert "script-src 'self'" in answer.headers["Content-Security-Policy"]


async def test_a_large_body_is_cut_on_the_page_and_downloaded_whole(
    payments: Payments, served: Served
) -> None:
    big = "x" * 100_000
    await payments.fail(big)
    [failure] = await payments.stored(1)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as client:
        page = await client_page(
            client, f"{served.url}/apps/{payments.app.name}/failures/{failure.id}"
        )
        answer = await client.get(
            f"{served.url}/apps/{payments.app.name}/failures/{failure.id}/body"
        )
        body = await answer.read()
    assert "The first 16,384 bytes are shown" in page
    assert len(page) < 60_000
    assert big.encode() in body
    assert answer.headers["Content-Disposition"].startswith("attachment")


async def test_the_broker_password_is_masked_on_every_page(
    payments: Payments, served: Served
) -> None:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as client:
        pages = [
            await client_page(client, f"{served.url}{path}")
            for path in ("/", "/live/overview", f"/apps/{payments.app.name}/failures")
        ]
    assert "guest:***@" in pages[0]
    assert all("guest:guest" not in page for page in pages)


async def test_a_host_it_does_not_listen_for_is_refused(served: Served) -> None:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as client:
        answer = await client.get(f"{served.url}/", headers={"Host": "rebound.example:80"})
    assert answer.status == 421


async def test_the_overview_counts_the_queues_and_the_store(
    payments: Payments, served: Served
) -> None:
    await payments.fail("order-1", "order-2")
    await payments.stored(2)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as client:
        page = await eventually(
            lambda: _overview_with(client, served.url, 'data-figure="failures">2<'),
            "the overview to count two stored failures",
        )
    assert f'data-queue="{payments.app.name}"' in page
    assert f'data-queue="{payments.app.retry.error_queue}"' in page
    assert 'data-figure="outbox-parked">0<' in page


async def _overview_with(client: aiohttp.ClientSession, url: str, text: str) -> str | None:
    page = await client_page(client, f"{url}/live/overview")
    return page if text in page else None


async def test_signing_in_never_sends_the_browser_off_the_dashboard_by_a_stripped_character(
    served: Served,
) -> None:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as client:
        for then in ("/\t/evil.example", "/\n/evil.example", "/\r/evil.example", "/ /x"):
            answer = await client.post(
                f"{served.url}/signin", data={"token": TOKEN, "then": then}, allow_redirects=False
            )
            assert answer.headers["Location"] == "/", then


@pytest.mark.parametrize(
    "path",
    [
        "/failures/99999999999999999999999",
        "/failures/%C2%B2",
        "/failures?before=%C2%B2",
        "/failures?q=%00",
        "/failures?group=%00",
        "/sagas?correlation=%00",
    ],
)
async def test_an_odd_id_or_text_in_the_url_is_refused_not_a_server_error(
    payments: Payments, served: Served, path: str
) -> None:
    async with aiohttp.ClientSession() as client:
        answer = await client.get(f"{served.url}/apps/{payments.app.name}{path}")
    assert answer.status in (200, 400, 404), await answer.text()


async def test_a_page_the_database_cannot_answer_says_so_with_the_password_masked(
    payments: Payments, served: Served
) -> None:
    source = served.dashboard.sources[payments.app.name]
    assert source.engine is not None
    async with source.engine.begin() as connection:
        await connection.execute(text(f"DROP TABLE {source.tables.dead_letters.name}"))
    async with aiohttp.ClientSession() as client:
        answer = await client.get(f"{served.url}/apps/{payments.app.name}/failures")
        page = await answer.text()
    assert answer.status == 503
    assert "Cannot show this now" in page
    assert "script-src 'self'" in answer.headers["Content-Security-Policy"]


async def test_an_address_is_answered_on_a_wildcard_bind_but_only_named_hosts(
    payments: Payments,
) -> None:
    dashboard = Dashboard([source_of(payments.app)], interval=0.2, allowed_hosts=["ops.example"])
    async with dashboard.serving("0.0.0.0") as url:
        port = url.rsplit(":", 1)[1]
        async with aiohttp.ClientSession() as client:
            statuses = {
                host: (await client.get(f"http://127.0.0.1:{port}/", headers={"Host": host})).status
                for host in (
                    f"127.0.0.1:{port}",
                    f"ops.example:{port}",
                    "rebind.example",
                    "10.0.0.9",
                )
            }
    assert statuses == {
        f"127.0.0.1:{port}": 200,
        f"ops.example:{port}": 200,
        "rebind.example": 421,
        "10.0.0.9": 200,
    }


async def test_the_outbox_page_cannot_purge_another_apps_parked_row(
    payments: Payments, served: Served
) -> None:
    source = served.dashboard.sources[payments.app.name]
    assert source.engine is not None
    table = source.tables.outbox
    other = Outgoing("elsewhere", Envelope({Header.TYPE: "t"}, b"{}"))
    async with source.engine.begin() as connection:
        await write_outbox(connection, table, "another-app", [other], None)
        await connection.execute(update(table).values(parked_at=table.c.created_at))
        [row_id] = (await connection.execute(select(table.c.id))).scalars()
    async with aiohttp.ClientSession() as client:
        answer = await client.post(
            f"{served.url}/apps/{payments.app.name}/outbox/do",
            data={"action": "purge", "id": str(row_id)},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        await eventually(lambda: _finished(client, str(answer.url)), "the purge job", timeout=10)
        outcome = await client_page(client, str(answer.url))
    assert "not in the outbox" in outcome
    async with source.engine.connect() as connection:
        assert (await connection.execute(select(table.c.id))).scalars().all() == [row_id]


async def _finished(client: aiohttp.ClientSession, url: str) -> bool:
    return "data-final" in await client_page(client, url)


async def test_the_overview_says_the_broker_is_gone_and_recovers_when_it_is_back(
    own_vhost: str, postgres_url: str, prefix: str
) -> None:
    async for payments in running_payments(own_vhost, postgres_url, prefix):
        gone = await broker_outage(payments, own_vhost.rsplit("/", 1)[1])
    assert "the broker" in gone
    assert "guest:guest" not in gone


async def broker_outage(payments: Payments, vhost: str) -> str:
    """The overview while the app's vhost is gone, once it says so; after it is back."""
    dashboard = Dashboard([source_of(payments.app)], interval=0.2)
    queue = f'data-queue="{payments.app.name}"'
    async with dashboard.serving() as url, aiohttp.ClientSession() as client:
        await eventually(
            lambda: _overview_with(client, url, queue), "the overview to show the app's queue"
        )
        await asyncio.to_thread(delete_vhost, vhost)
        gone = await eventually(
            lambda: _overview_with(client, url, 'class="problem"'),
            "the overview to say the broker cannot be seen",
            timeout=30,
        )
        await asyncio.to_thread(add_vhost, vhost)
        await eventually(
            lambda: _overview_without(client, url, 'class="problem">the broker'),
            "the overview to see the broker again",
            timeout=60,
        )
    return gone


async def _overview_without(client: aiohttp.ClientSession, url: str, text: str) -> bool:
    page = await client_page(client, f"{url}/live/overview")
    return text not in page
