"""The connection's recovery registry: restores after a reconnect, and on request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from rabbitmq_support import rabbitmqctl

from mersal_rabbitmq.connection import Connection, Restore
from tests.support import eventually

pytestmark = pytest.mark.integration


@pytest.fixture
async def connection(url: str) -> AsyncIterator[Connection]:
    """An open connection to the test vhost; closed afterwards."""
    opened = Connection(url)
    await opened.open(heartbeat=None)
    yield opened
    await opened.close()


async def test_every_registration_is_restored_once_connected_after_each_reconnect(
    connection: Connection, vhost: str
) -> None:
    restored: dict[str, list[tuple[bool, int]]] = {"first": [], "second": []}
    connections: list[object] = []  # the connections restored on, in order

    def restore_of(name: str) -> Restore:
        async def restore() -> None:  # whether connected, and on which connection
            current = connection.require().transport
            if current not in connections:
                connections.append(current)
            restored[name].append((connection.connected, connections.index(current)))

        return restore

    connection.register("restoring first", restore_of("first"))
    connection.register("restoring second", restore_of("second"))

    await asyncio.to_thread(rabbitmqctl, "close_all_connections", "-p", vhost, "test")
    await eventually(lambda: all(restored.values()), "both restored", timeout=10)
    # Once more, well after the first reconnect: had it restored either twice, that shows now.
    await asyncio.to_thread(rabbitmqctl, "close_all_connections", "-p", vhost, "test")
    await eventually(
        lambda: all(runs[-1][1] == 1 for runs in restored.values()),
        "both restored on the next connection",
        timeout=10,
    )
    assert restored == {name: [(True, 0), (True, 1)] for name in restored}


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
    await eventually(lambda: lost, "reported lost", timeout=10)
    assert lost == [("attempt 3", 3)]

    registration.restore()  # given up: no longer registered, so nothing runs
    later: list[bool] = []

    async def restore_later() -> None:
        later.append(True)

    connection.register("restoring later", restore_later).restore()
    await eventually(lambda: later, "a restore asked for later ran", timeout=10)
    assert attempts == 3


async def test_a_restore_asked_for_while_one_runs_follows_it_once_and_never_overlaps(
    connection: Connection,
) -> None:
    running = peak = 0
    asked = "at first"
    runs: list[str] = []  # when each run was asked for
    gate = asyncio.Event()

    async def restore() -> None:
        nonlocal running, peak
        running += 1
        runs.append(asked)
        peak = max(peak, running)
        await gate.wait()
        running -= 1

    registration = connection.register("restoring", restore)
    registration.restore()
    await eventually(lambda: runs == ["at first"], "the first restore under way", timeout=10)
    asked = "twice while it ran"
    registration.restore()
    registration.restore()
    gate.set()
    await eventually(lambda: len(runs) == 2 and running == 0, "one more restore", timeout=10)
    # A restore asked for after those runs too: a run more of theirs would show before it.
    asked = "after them"
    registration.restore()
    await eventually(lambda: len(runs) == 3 and running == 0, "a later restore", timeout=10)
    assert (runs, peak) == (["at first", "twice while it ran", "after them"], 1)


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
    await eventually(lambda: kept, "the kept one restored", timeout=10)
    assert dropped == []
