"""`mersal dashboard` as a program: it serves until SIGTERM, and says what to fix when it cannot."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import urllib.request

import pytest

from tests.support import mersal

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--name", "billing", "--database", "sqlite:///x.db", "--token", "short"],
            "16 characters",
        ),
        ([], "needs --app module:app"),
        (["--app", "tests.nowhere:app", "--name", "x"], "takes --app, or --name"),
    ],
)
async def test_a_mistake_on_the_command_line_says_what_to_change(
    argv: list[str],
    expected: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for variable in ("MERSAL_DATABASE", "MERSAL_TRANSPORT", "MERSAL_DASHBOARD_TOKEN"):
        monkeypatch.delenv(variable, raising=False)
    assert await mersal("dashboard", *argv) == 2
    assert expected in capsys.readouterr().err


async def test_it_serves_the_database_of_an_app_named_by_its_url_until_stopped(
    sqlite_url: str, prefix: str
) -> None:
    await mersal("db", "upgrade", "--database", sqlite_url)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mersal.cli",
        "dashboard",
        "--name",
        f"{prefix}-billing",
        "--database",
        sqlite_url,
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "MERSAL_DASHBOARD_TOKEN": "a-token-long-enough-for-it"},
    )
    try:
        assert process.stdout is not None and process.stderr is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        if not line:
            pytest.fail((await process.stderr.read()).decode())
        assert "actions need the token" in line, line
        url = line.split(" on ", 1)[1].split(" ", 1)[0]
        page = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"{url}/apps/{prefix}-billing/failures").read()
        )
        assert b"no failed messages stored" in page
    finally:
        process.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(process.wait(), 30)
    assert code == 0
