"""The dashboard in a real browser (headless Chromium): what an operator sees and does.

Selenium blocks, so each step runs in a thread while the dashboard serves on the test's loop.
The tests screenshot the pages they look at: `make screenshots` keeps them for the docs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.mersal_dashboard.conftest import TOKEN, Served
from tests.payments import Payments
from tests.support import eventually

pytestmark = pytest.mark.integration

T = TypeVar("T")


class Page:
    """The browser, one awaitable step at a time."""

    def __init__(self, driver: Any, served: Served, screenshots: Path) -> None:
        self.driver = driver
        self.url = served.url
        self.screenshots = screenshots

    async def run(self, step: Callable[[], T]) -> T:
        """Run one blocking browser step off the loop."""
        return await asyncio.to_thread(step)

    async def open(self, path: str) -> None:
        """Load a page of the dashboard."""
        await self.run(lambda: self.driver.get(f"{self.url}{path}"))

    async def css(self, selector: str) -> list[Any]:
        """The elements `selector` finds now."""
        return await self.run(lambda: self.driver.find_elements("css selector", selector))

    async def text(self, selector: str) -> str:
        """The text of the first element `selector` finds ('' if none), read in one step: a
        live part may be replaced between finding an element and reading it."""
        script = "const e = document.querySelector(arguments[0]); return e ? e.innerText : ''"
        found: str = await self.run(lambda: self.driver.execute_script(script, selector))
        return found.strip()

    async def click(self, selector: str) -> None:
        """Click the first element `selector` finds, once it is there."""
        await eventually(lambda: self.has(selector), f"{selector!r} on {self.driver.current_url}")
        # A click from a script: the step does not wait for the page it opens (the caller waits
        # for what it expects there), which a busy machine can stall past WebDriver's timeout.
        script = "document.querySelector(arguments[0]).click()"
        await self.run(lambda: self.driver.execute_script(script, selector))

    async def script(self, source: str) -> Any:
        """The value of a script run in the page."""
        return await self.run(lambda: self.driver.execute_script(source))

    async def sign_in(self) -> None:
        """Sign in with the token through the form."""
        await self.open("/signin")
        [field] = await self.css("input[name=token]")
        await self.run(lambda: field.send_keys(TOKEN))
        await self.click("form.signin button")
        await eventually(lambda: self.has("form[action='/signout']"), "the session to start")

    async def shows(self, selector: str, text: str) -> None:
        """Wait until the element `selector` finds holds `text` (the page may be loading)."""

        async def there() -> bool:
            return text in await self.text(selector)

        await eventually(there, f"{text!r} in {selector!r} on {self.driver.current_url}")

    async def has(self, selector: str) -> bool:
        """Whether `selector` finds anything now."""
        return bool(await self.css(selector))

    async def shot(self, name: str) -> None:
        """Save the page as <name>.png in the screenshots' directory."""
        path = self.screenshots / f"{name}.png"
        await self.run(lambda: self.driver.save_screenshot(str(path)))


@pytest.fixture
def page(browser: Any, served: Served, screenshots: Path) -> Page:
    """The browser on the dashboard of the payments app."""
    return Page(browser, served, screenshots)


async def test_a_failed_message_shows_in_its_group_and_a_retry_has_it_handled_once(
    payments: Payments, page: Page
) -> None:
    await payments.fail("order-41", "order-42")
    failures = await payments.stored(2)
    await page.sign_in()
    await page.open(f"/apps/{payments.app.name}/failures")
    group = await page.text("section.groups tbody tr")
    assert "CardDeclined: card declined for order" in group and "2" in group.split()
    await page.shot("failures")
    await page.open(f"/apps/{payments.app.name}/failures/{failures[0].id}")
    assert "raise CardDeclined" in await page.text("pre.traceback")
    await page.shot("failure")

    payments.broken = False
    await page.open(f"/apps/{payments.app.name}/failures")
    for failure in failures:
        await page.click(f"input[name=id][value='{failure.id}']")
    await page.click("#selection button[value=retry]")
    await page.shows("h1", "Retry 2 failures?")
    await page.shot("confirm")
    await page.click("#confirm")
    await eventually(
        lambda: page.has("[data-job-state=done]"), "the retry's progress line to say done"
    )
    await page.shows("#job", "2 failure(s) sent back through the outbox")
    await page.shot("job")
    await eventually(lambda: len(payments.handled) == 2, "both orders handled")
    assert sorted(payments.handled) == ["order-41", "order-42"]
    assert await payments.store.count() == 0


async def test_a_delete_from_the_page_removes_the_failure(payments: Payments, page: Page) -> None:
    await payments.fail("order-9")
    [failure] = await payments.stored(1)
    await page.sign_in()
    await page.open(f"/apps/{payments.app.name}/failures/{failure.id}")
    await page.click("form.actions button[value=delete]")
    await page.click("#confirm")
    await eventually(lambda: page.has("[data-job-state=done]"), "the delete to finish")
    assert await payments.store.get(failure.id) is None
    await page.open(f"/apps/{payments.app.name}/failures")
    await page.shows("section.groups", "no failed messages stored")


async def test_an_action_without_signing_in_is_refused(payments: Payments, page: Page) -> None:
    await payments.fail("order-5")
    [failure] = await payments.stored(1)
    await page.open(f"/apps/{payments.app.name}/failures/{failure.id}")
    await page.click("form.actions button[value=retry]")
    await page.shows("[data-refused]", "sign in with the dashboard")
    await page.shot("refused")
    assert await payments.store.get(failure.id) is not None


async def test_a_script_in_a_header_shows_as_text_and_never_runs(
    payments: Payments, page: Page
) -> None:
    hostile = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'
    await payments.fail("order-6", headers={"x-note": hostile})
    [failure] = await payments.stored(1)
    await page.open(f"/apps/{payments.app.name}/failures/{failure.id}")
    rows = await page.css("table.headers tr")
    texts = [await page.run(lambda row=row: row.text) for row in rows]
    assert any(hostile in text for text in texts), texts
    assert await page.script("return window.pwned === undefined")
    assert not await page.has("table.headers img")


async def test_the_overview_updates_without_a_reload(payments: Payments, page: Page) -> None:
    await page.open("/")
    await page.script("window.loadedOnce = 'yes'")
    assert await page.text("[data-figure=failures]") in ("0", "-")
    await payments.fail("order-1", "order-2", "order-3")
    await eventually(
        lambda: _figure_is(page, "failures", "3"), "the overview to count three stored failures"
    )
    assert await page.script("return window.loadedOnce") == "yes"
    await page.shot("overview")
    await page.run(lambda: page.driver.set_window_size(390, 844))
    await page.open("/")
    await page.shot("overview-phone")
    await page.open(f"/apps/{payments.app.name}/failures")
    await page.shot("failures-phone")
    for path in ("/", f"/apps/{payments.app.name}/failures"):
        await page.open(path)
        width = await page.script("return document.documentElement.scrollWidth")
        assert width <= 390, f"{path} is {width} px wide on a 390 px phone"


async def _figure_is(page: Page, name: str, value: str) -> bool:
    return await page.text(f"[data-figure={name}]") == value


async def test_the_outbox_and_sagas_pages_render(payments: Payments, page: Page) -> None:
    await page.open(f"/apps/{payments.app.name}/outbox")
    assert "no parked rows" in await page.text("table")
    await page.shot("outbox")
    await page.open(f"/apps/{payments.app.name}/sagas")
    assert "no sagas in flight" in await page.text("table")
    await page.shot("sagas")
