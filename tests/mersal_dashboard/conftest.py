"""The dashboard's fixtures: a payments app whose handler fails on RabbitMQ and PostgreSQL, the
dashboard serving it, and a headless Chromium driven through its WebDriver."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mersal_dashboard import Dashboard, source_of
from tests.payments import Payments, running_payments

TOKEN = "test-token-0123456789abcdef"


@pytest.fixture
async def payments(amqp_url: str, postgres_url: str, prefix: str) -> AsyncIterator[Payments]:
    """A started payments app on RabbitMQ and PostgreSQL."""
    async for payments in running_payments(amqp_url, postgres_url, prefix):
        yield payments


@dataclass
class Served:
    """A dashboard serving the payments app, and its URL."""

    dashboard: Dashboard
    url: str


async def serve(payments: Payments, **options: Any) -> AsyncIterator[Served]:
    """The dashboard of `payments`, sampling every 0.2 s."""
    dashboard = Dashboard([source_of(payments.app)], interval=0.2, **options)
    async with dashboard.serving() as url:
        yield Served(dashboard, url)


@pytest.fixture
async def served(payments: Payments) -> AsyncIterator[Served]:
    """The dashboard of the payments app, actions allowed with the token."""
    async for served in serve(payments, token=TOKEN):
        yield served


@pytest.fixture
async def read_only(payments: Payments) -> AsyncIterator[Served]:
    """The dashboard of the payments app without a token."""
    async for served in serve(payments):
        yield served


@pytest.fixture(scope="session")
def chromium() -> Iterator[Any]:
    """A headless Chromium (Debian's), driven by Selenium through chromium-driver."""
    webdriver = pytest.importorskip("selenium.webdriver")
    binary = shutil.which("chromium")
    driver_path = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    if binary is None or not Path(driver_path).exists():
        pytest.skip("chromium and chromium-driver are not installed (make services installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    options.page_load_strategy = "eager"  # a page is read once parsed, not after every fetch
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument("--window-size=1280,900")
    service = webdriver.ChromeService(executable_path=driver_path)
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def browser(chromium: Any) -> Iterator[Any]:
    """The session's Chromium at 1280 px, its cookies cleared after the test."""
    chromium.set_window_size(1280, 900)
    try:
        yield chromium
    finally:
        chromium.delete_all_cookies()


@pytest.fixture(scope="session")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the browser tests leave their screenshots: $MERSAL_SCREENSHOTS (`make screenshots`
    sets docs/images/dashboard), else a directory of the session's own."""
    chosen = os.environ.get("MERSAL_SCREENSHOTS")
    directory = Path(chosen) if chosen else tmp_path_factory.mktemp("screenshots")
    directory.mkdir(parents=True, exist_ok=True)
    return directory
