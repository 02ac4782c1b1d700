"""An app's status for operators: in the app's process, and shown without a password or a
hostile app name's control characters."""

from __future__ import annotations

from uuid import uuid4

import pytest

from mersal import App, RetryPolicy
from mersal.inspection import AppRows, StorageStatus
from mersal.messages import Envelope
from mersal.status import Naming, app_status
from mersal.status import Status as Seen
from mersal.transport import Outgoing


async def test_app_status_counts_an_in_process_app_on_the_memory_transport() -> None:
    transport = f"memory://status-{uuid4().hex}"
    app = App("orders", transport=transport, retry=RetryPolicy(error_queue="orders.error"))
    async with app:
        dead = Outgoing("orders.error", Envelope({"message-id": "m-1"}, b"{}"))
        await app.transport.send([dead])

        status = await app_status(app)

    assert [(q.name, q.role, q.ready, q.unacked, q.consumers) for q in status.queues] == [
        ("orders", "input", 0, 0, 1),
        ("orders.error", "error", 1, 0, 0),
    ]
    assert status.storage is None
    assert status.exit_code == 1
    assert status.reasons()[0].startswith("1 message(s) in the error queue 'orders.error'")


def test_an_app_name_in_the_outbox_is_shown_escaped_one_word_and_cut() -> None:
    hostile = "evil\x1b[2J\nmersal 9 9"
    apps = (
        AppRows("orders", 1, 0, None),
        AppRows(hostile, 0, 0, None),
        AppRows("é" * 150, 0, 0, None),
    )
    seen = Seen(app="orders", database="db", storage=StorageStatus(1, 0, None, 0, "orders", apps))

    lines = seen.lines()

    start = lines.index(f"{'  APP':<102}  PENDING  PARKED  OLDEST PENDING")
    assert lines[start + 1 : start + 4] == [
        f"{'* orders':<102}  1        0       -",
        r"  evil\x1b[2J\nmersal\x209\x209".ljust(102) + "  0        0       -",
        f"  {'é' * 97}...  0        0       -",
    ]
    assert seen.as_json()["outbox"]["apps"][1]["app"] == hostile


@pytest.mark.parametrize(
    ("database", "environment", "table", "command"),
    [
        (
            "postgresql+asyncpg://app:secret@db/shop",
            None,
            None,
            "`mersal outbox retry 7 --database 'postgresql+asyncpg://app@db/shop'` (its URL "
            "without the password: add the password, or set MERSAL_DATABASE to the URL and "
            "leave --database out)",
        ),
        (
            "postgresql+asyncpg://app:secret@db/shop",
            "postgresql+asyncpg://app:secret@db/shop",
            "shop_outbox",
            "`mersal outbox retry 7 --outbox-table shop_outbox`",
        ),
        (
            "postgresql+asyncpg://app:***@db/shop",
            "postgresql+asyncpg://app:secret@db/shop",
            None,
            "`mersal outbox retry 7 --database 'postgresql+asyncpg://app@db/shop'` (its URL "
            "without the password: add the password, or set MERSAL_DATABASE to the URL and "
            "leave --database out)",
        ),
        (
            "sqlite+aiosqlite:///shop.db",
            None,
            None,
            "`mersal outbox retry 7 --database 'sqlite+aiosqlite:///shop.db'`",
        ),
    ],
)
def test_the_retry_command_for_a_parked_row_never_shows_a_password(
    database: str,
    environment: str | None,
    table: str | None,
    command: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if environment is None:
        monkeypatch.delenv("MERSAL_DATABASE", raising=False)
    else:
        monkeypatch.setenv("MERSAL_DATABASE", environment)
    assert Naming(database=database).outbox_retry(7, table) == command
