"""The inbox retention: ids older than the window are removed in bounded batches."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import insert, select

from mersal_sqlalchemy.engines import sql_time
from mersal_sqlalchemy.inbox import inbox_key
from tests.mersal_sqlalchemy.support import Probe, orders_app, storage_of

DAY = 86_400.0


async def test_cleanup_removes_ids_older_than_the_window_and_keeps_newer_ones(
    database: str, memory_url: str
) -> None:
    app = orders_app(database, memory_url, Probe(), retention=timedelta(days=7), cleanup_batch=2)
    async with app:
        storage = storage_of(app)
        inbox, engine = storage.tables.inbox, storage.engine
        rows = [
            ("orders", "old-1", -8 * DAY),
            ("orders", "old-2", -30 * DAY),
            ("orders", "old-3", -7 * DAY - 60),
            ("orders", "new-1", -7 * DAY + 60),
            ("orders", "new-2", 0.0),
            ("billing", "old-of-another-app", -30 * DAY),
        ]
        async with engine.begin() as connection:
            for app_name, message_id, age in rows:
                await connection.execute(
                    insert(inbox).values(
                        app=app_name, message_id=message_id, handled_at=sql_time(engine, age)
                    )
                )
        assert await storage.clean_inbox() == 3
        async with engine.connect() as connection:
            left = (await connection.execute(select(inbox.c.app, inbox.c.message_id))).all()
        assert sorted(tuple(row) for row in left) == [
            ("billing", "old-of-another-app"),
            ("orders", "new-1"),
            ("orders", "new-2"),
        ]
        assert await storage.clean_inbox() == 0


def test_ids_longer_than_the_column_are_stored_as_a_digest() -> None:
    assert inbox_key("short") == "short"
    long = "x" * 300
    assert inbox_key(long).startswith("sha256:") and len(inbox_key(long)) <= 255
    assert inbox_key(long) == inbox_key("x" * 300) != inbox_key("x" * 301)
