"""`app.health()`: alive while its loops run, ready while it can do its work, and why not."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mersal import App
from mersal.errors import OutcomeUnknown
from mersal.health import Health
from mersal.messages import Envelope
from mersal.outbox import OutboxRow, Relay
from mersal.transport import Outgoing
from mersal.transport.memory import MemoryTransport
from mersal_sqlalchemy import attach
from tests.support import DelegatingTransport, eventually, sqlite_file


@dataclass
class Job:
    n: int


async def _ignore(message: Job) -> None:
    return None


async def test_an_app_is_neither_live_nor_ready_before_start_and_after_stop(
    memory_url: str,
) -> None:
    app = App("health-life", transport=memory_url)
    app.register(Job, _ignore)

    before = app.health()
    assert (before.live, before.ready) == (False, False)
    assert "not running" in before.checks["app"]

    async with app:
        running = app.health()
        assert (running.live, running.ready, running.checks) == (True, True, {})

    after = app.health()
    assert (after.live, after.ready) == (False, False)
    assert set(after.checks) == {"app"}


async def test_a_worker_that_stopped_receiving_makes_the_app_not_live(memory_url: str) -> None:
    app = App("health-worker", transport=memory_url)
    app.register(Job, _ignore)
    async with app:
        assert app.worker is not None
        await app.worker.consumer.close()  # as if the broker lost it for good
        health = await eventually(lambda: _unless(app.health(), "live"), "not live")
        assert not health.ready
        assert "stopped receiving" in health.checks["worker"]


class RefusingTransport(DelegatingTransport):
    """A memory transport whose sends fail while `refusing` is set."""

    def __init__(self, inner: MemoryTransport) -> None:
        super().__init__(inner)
        self.refusing = False

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        if self.refusing:
            return [OutcomeUnknown("the broker refused") for _ in messages]
        return await self.inner.send_each(messages)


async def test_a_failing_relay_makes_the_app_not_ready_until_it_succeeds(
    memory_url: str, tmp_path: Path
) -> None:
    transport = RefusingTransport(MemoryTransport(memory_url))
    app = App("health-relay", transport=transport, database=sqlite_file(tmp_path))
    app.register(Job, _ignore)
    app.route(Job, "elsewhere")
    async with app:
        await app.transport.declare("elsewhere")
        transport.refusing = True
        async with app.transaction():
            await app.send(Job(1))
        health = await eventually(lambda: _unless(app.health(), "ready"), "not ready", timeout=10)
        assert health.live, "a relay that fails and tries again is alive"
        assert "the broker refused" in health.checks["outbox"]

        transport.refusing = False
        await eventually(lambda: app.health().ready, "ready again", timeout=40)
        assert app.health().checks == {}


async def test_a_stopped_relay_makes_the_app_not_live(memory_url: str, tmp_path: Path) -> None:
    app = App("health-relay-gone", transport=memory_url, database=sqlite_file(tmp_path))
    app.register(Job, _ignore)
    async with app:
        assert app.storage is not None and app.storage.relay is not None
        await app.storage.relay.stop()
        health = app.health()
        assert not health.live
        assert health.checks["relay"] == "the outbox relay is not running"


class FullBatches:
    """An outbox that always has a full batch to give: the relay can never catch up."""

    def __init__(self) -> None:
        self.full = True
        self.next_id = 0

    async def claim(self, limit: int) -> list[OutboxRow]:
        if not self.full:
            return []
        rows = []
        for _ in range(limit):
            self.next_id += 1
            outgoing = Outgoing("lagging", _envelope(), False)
            rows.append(OutboxRow(self.next_id, outgoing))
        await asyncio.sleep(0.01)
        return rows

    async def delete(self, ids: Sequence[int]) -> None:
        return None

    async def release(self, ids: Sequence[int], delay: float = 0.0) -> None:
        return None

    async def park(self, row_id: int, reason: str) -> None:
        return None

    async def count_parked(self) -> int:
        return 0


def _envelope() -> Envelope:
    return Envelope({"message-id": "m"}, b"{}")


async def test_relay_lag_grows_while_every_claim_is_a_full_batch_and_ends_when_one_is_not(
    memory_url: str,
) -> None:
    transport = MemoryTransport(memory_url)
    await transport.start()
    try:
        await transport.declare("lagging")
        store = FullBatches()
        relay = Relay(store, transport, batch=2, poll_interval=0.05)
        relay.start()
        try:
            await eventually(lambda: relay.lag > 0.3, "the relay is behind", timeout=5)
            store.full = False
            await eventually(lambda: relay.lag == 0.0, "the relay caught up", timeout=5)
        finally:
            await relay.stop()
    finally:
        await transport.stop()


class SlowTransport(DelegatingTransport):
    """A memory transport that takes `pause` seconds for each batch it sends."""

    def __init__(self, inner: MemoryTransport, pause: float) -> None:
        super().__init__(inner)
        self.pause = pause

    async def send_each(self, messages: Sequence[Outgoing]) -> list[Exception | None]:
        await asyncio.sleep(self.pause)
        return await self.inner.send_each(messages)


async def test_an_app_whose_relay_lags_past_the_threshold_is_not_ready_until_it_catches_up(
    memory_url: str, tmp_path: Path
) -> None:
    transport = SlowTransport(MemoryTransport(memory_url), pause=0.1)
    app = App("health-lag", transport=transport, database=sqlite_file(tmp_path))
    attach(app, relay_batch=1)
    app.register(Job, _ignore)
    app.route(Job, "elsewhere")
    async with app:
        await app.transport.declare("elsewhere")
        async with app.transaction():
            for n in range(15):
                await app.send(Job(n))
        health = await eventually(
            lambda: _unless(app.health(max_relay_lag=0.3), "ready"), "not ready", timeout=5
        )
        assert health.live
        assert "behind" in health.checks["relay_lag"]
        await eventually(lambda: app.health(max_relay_lag=0.3).ready, "caught up", timeout=10)


def _unless(health: Health, state: str) -> Health | None:
    """`health` when its `state` ("live" or "ready") is false, else None."""
    return None if getattr(health, state) else health
