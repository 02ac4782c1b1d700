"""The connection's recovery registry: restores after a reconnect, and on request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from rabbitmq_support import rabbitmqctl, wait_until

from mersal_rabbitmq.connection import Connection, Restore

pytestmark = pytest.mark.integration


@pytest.fixture
async def connection(url: str) -> AsyncIterator[Connection]:
    """An open connection to the test vhost; closed afterwards."""
    opened = Connection(url)
    await opened.open(heartbeat=None)
    yield opened
    await opened.close()


async def test_every_registration_is_restored_once_connected_after_a_reconnect(
    connection: Connection, vhost: str
) -> None:
    restored: dict[str, list[bool]] = {"first": [], "second": []}

    def restore_of(name: str) -> Restore:
        async def restore() -> None:
            restored[name].append(connection.connected)

        return restore

    connection.register("restoring first", restore_of("first"))
    connection.register("restoring second", restore_of("second"))

    await asyncio.to_thread(rabbitmqctl, "close_all_connections", "-p", vhost, "test")
    await wait_until(lambda: all(restored.values()), what="both restored")
    await asyncio.sleep(0.1)
    assert restored == {"first": [True], "second": [True]}


async def test_a_restore_that_keeps_failing_is_tried_after_each_delay_then_reported_lost(
    connection: Connection,
) -> None:
    attempts = 0
    lost: list[tuple[str, int]] = []

    async def restore() -> None:
        nonlocal attempts
        attempts += 1
        raise RuntimeError(f"attempt {attempts}")

    registration = connection.register(
        "restoring",
        restore,
        delays=(0.01, 0.01),
        lost=lambda error, n: lost.append((str(error), n)),
    )
    registration.restore()
    await wait_until(lambda: bool(lost), what="reported lost")
    assert lost == [("attempt 3", 3)]

    registration.restore()  # given up: no longer registered, so nothing runs
    await asyncio.sleep(0.1)
    assert attempts == 3


async def test_a_restore_asked_for_while_one_runs_follows_it_once_and_never_overlaps(
    connection: Connection,
) -> None:
    running = peak = runs = 0
    gate = asyncio.Event()

    async def restore() -> None:
        nonlocal running, peak, runs
        running += 1
        runs += 1
        peak = max(peak, running)
        await gate.wait()
        running -= 1

    registration = connection.register("restoring", restore)
    registration.restore()
    await wait_until(lambda: runs == 1, what="the first restore under way")
    registration.restore()
    registration.restore()
    gate.set()
    await wait_until(lambda: runs == 2 and running == 0, what="one more restore")
    await asyncio.sleep(0.1)
    assert (runs, peak) == (2, 1)


async def test_a_cancelled_registration_is_not_restored(connection: Connection, vhost: str) -> None:
    kept: list[bool] = []
    dropped: list[bool] = []

    async def keep() -> None:
        kept.append(True)

    async def drop() -> None:
        dropped.append(True)

    connection.register("keeping", keep)
    await connection.register("dropping", drop).cancel()

    await asyncio.to_thread(rabbitmqctl, "close_all_connections", "-p", vhost, "test")
    await wait_until(lambda: bool(kept), what="the kept one restored")
    assert dropped == []
