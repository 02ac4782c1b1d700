"""Crash-and-count scenarios: every committed intent has exactly one effect, whatever breaks.

Each scenario runs at two sizes: `reduced` (a few hundred intents, part of `make test`) and
`full` (thousands, marked `chaos`: `make chaos`). The workers and the driver are separate OS
processes (`tests/chaos/worker.py`); the ledger (`tests/chaos/ledger.py`) prints one line per
scenario and checks lost = 0, duplicated_effects = 0 and unexpected = 0 in `finish`. The saga
scenario runs optimistic at both sizes and pessimistic in `make chaos` only.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import aio_pika
import pytest

from mersal import Header
from mersal_rabbitmq.delays import wait_milliseconds, wait_queue_name
from tests.chaos.ledger import Proc, Progress, SagaFigures, Scenario
from tests.chaos.worker import (
    DOOM_TYPE,
    ERROR_QUEUE,
    OPTIMISTIC,
    PESSIMISTIC,
    SAGA_KEYS,
    SAGA_NAME,
    WORK_QUEUE,
    saga_key,
)
from tests.support import eventually

pytestmark = pytest.mark.integration

REDUCED = "reduced"
FULL = "full"
SIZES = [
    pytest.param(REDUCED, marks=pytest.mark.timeout(300)),
    pytest.param(FULL, marks=[pytest.mark.chaos, pytest.mark.timeout(900)]),
]


PROTOCOLS = ["amqp", "amqp10"]
"""The scenarios that hit the transport run on 0-9-1 and on AMQP 1.0."""


def name(scenario: str, size: str, protocol: str = "amqp") -> str:
    """The scenario's name in the ledger."""
    return f"{scenario}[{size}]" if protocol == "amqp" else f"{scenario}[{size}-{protocol}]"


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("size", SIZES)
async def test_worker_killed_inside_the_handler(size: str, protocol: str, tmp_path: Path) -> None:
    """kill -9 in a handler, its effect written and not committed: a fresh worker takes over."""
    intents, at, faults = {REDUCED: (300, 40, 4), FULL: (4000, 300, 10)}[size]
    scenario = name("worker_killed_in_handler", size, protocol)
    async with Scenario(scenario, intents, tmp_path, protocol=protocol) as s:
        workers, _ = await asyncio.gather(
            s.workers(2, faulty=["--die-in-handler-at", str(at)], faults=faults),
            s.driver(),
        )
        figures = await s.finish(drain_timeout=120 if size == REDUCED else 600)
    assert workers.kills == faults
    assert figures.handler_reruns >= workers.kills  # each killed run ran again elsewhere


SAGA_RUNS = [
    pytest.param(REDUCED, OPTIMISTIC, marks=pytest.mark.timeout(300)),
    pytest.param(FULL, OPTIMISTIC, marks=[pytest.mark.chaos, pytest.mark.timeout(900)]),
    # pessimistic only in `make chaos`: make test's time goes to the optimistic run's races
    pytest.param(REDUCED, PESSIMISTIC, marks=[pytest.mark.chaos, pytest.mark.timeout(300)]),
    pytest.param(FULL, PESSIMISTIC, marks=[pytest.mark.chaos, pytest.mark.timeout(900)]),
]


@pytest.mark.parametrize(("size", "mode"), SAGA_RUNS)
async def test_worker_killed_during_saga_handling(size: str, mode: str, tmp_path: Path) -> None:
    """kill -9 while a saga handles a message, again and again, while 2 workers x 16 handlers
    fight over SAGA_KEYS sagas: one worker's faulty processes die inside the saga's method (its
    data changed, the effect written), the other's just before the commit (the saga's row
    written and locked too); nothing committed.

    Every saga ends holding each intent of its key exactly once, at one revision per intent;
    no intent is lost or applied twice. Optimistic: lost races (ConcurrencyConflict) rerun at
    once, and happen; pessimistic: the row lock serializes, only concurrent starts conflict.
    """
    intents, at, faults = {REDUCED: (300, 40, 2), FULL: (4000, 300, 4)}[size]
    label = name(f"worker_killed_in_saga_{mode}", size)
    options = ("--saga", mode, "--concurrency", "16")
    async with Scenario(label, intents, tmp_path) as s:
        checked: list[SagaFigures] = []

        async def sagas() -> dict[str, object]:
            checked.append(await s.saga_figures(WORK_QUEUE, SAGA_NAME, saga_key))
            return {
                **checked[-1].fields(),
                "worker_kills": in_saga.kills + before_commit.kills,
                "kills_in_saga": in_saga.kills,
                "kills_before_commit": before_commit.kills,
            }

        in_saga, before_commit, _ = await asyncio.gather(
            s.workers(1, *options, faulty=["--die-in-handler-at", str(at)], faults=faults),
            s.workers(1, *options, faulty=["--die-before-commit-at", str(at)], faults=faults),
            s.driver(),
        )
        figures = await s.finish(drain_timeout=120 if size == REDUCED else 600, more=sagas)
    (found,) = checked
    assert found.problems == [], "\n".join(found.problems)
    assert found.sagas == SAGA_KEYS
    assert found.saga_ids == intents
    assert found.saga_mismatches == 0
    assert (in_saga.kills, before_commit.kills) == (faults, faults)
    # each killed run and each run that lost a race ran again
    assert figures.handler_reruns >= 2 * faults + found.conflict_reruns
    if mode == OPTIMISTIC:
        assert found.conflict_reruns > 0  # the load made messages of one saga race


@pytest.mark.parametrize("size", SIZES)
async def test_worker_killed_after_commit_before_ack(size: str, tmp_path: Path) -> None:
    """kill -9 between commit and ack: the broker delivers again, the inbox skips the copy."""
    intents, at, faults = {REDUCED: (300, 40, 4), FULL: (4000, 300, 10)}[size]
    async with Scenario(name("worker_killed_after_commit", size), intents, tmp_path) as s:
        workers, _ = await asyncio.gather(
            s.workers(2, faulty=["--die-after-commit-at", str(at)], faults=faults),
            s.driver(),
        )
        figures = await s.finish(drain_timeout=120 if size == REDUCED else 600)
    assert workers.kills == faults
    # at least the committed, unacked message of each kill came again, and was skipped
    assert figures.raw_duplicate_deliveries >= workers.kills


@pytest.mark.parametrize("size", SIZES)
async def test_relay_killed_after_commit_before_publish(size: str, tmp_path: Path) -> None:
    """kill -9 of the relay with rows claimed and unpublished: a restarted driver sends them."""
    intents, at, faults = {REDUCED: (300, 50, 3), FULL: (4000, 400, 6)}[size]
    async with Scenario(name("relay_killed_before_publish", size), intents, tmp_path) as s:
        _, driver = await asyncio.gather(
            s.workers(2),
            s.driver(faulty=["--die-before-send-at", str(at)], faults=faults),
        )
        await s.finish(drain_timeout=120 if size == REDUCED else 600)
    assert driver.kills == faults


@pytest.mark.parametrize("size", SIZES)
async def test_relay_killed_after_confirm_before_delete(size: str, tmp_path: Path) -> None:
    """kill -9 of the relay after the broker confirmed, before the rows were deleted."""
    intents, at, faults = {REDUCED: (300, 50, 3), FULL: (4000, 400, 6)}[size]
    async with Scenario(name("relay_killed_after_confirm", size), intents, tmp_path) as s:
        _, driver = await asyncio.gather(
            s.workers(2),
            s.driver(faulty=["--die-after-send-at", str(at)], faults=faults),
        )
        figures = await s.finish(drain_timeout=120 if size == REDUCED else 600)
    assert driver.kills == faults
    # the confirmed batch of each kill was published again; the inbox dropped the copies
    assert figures.raw_duplicate_deliveries >= driver.kills


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("size", SIZES)
async def test_rabbitmq_outage_while_publishing_and_consuming(
    size: str, protocol: str, tmp_path: Path
) -> None:
    """Reduced: the broker closes every connection; full: RabbitMQ stops and starts again.

    Once while the driver's relay publishes a burst (no worker runs yet), once while the
    workers consume.
    """
    intents, rate, delay = {REDUCED: (300, 80, "0.1"), FULL: (3000, 300, "0.05")}[size]
    full = size == FULL
    scenario = name("rabbitmq_outage", size, protocol)
    async with Scenario(scenario, intents, tmp_path, protocol=protocol) as s:

        async def outage() -> Progress:
            if full:
                await s.restart_rabbitmq(down_for=5.0)
            else:
                await s.close_connections()
            return await s.progress()

        await s.driver("--rate", str(rate))
        await s.until_progress(lambda p: p.committed >= intents // 10, 60, "a tenth committed")
        publishing = await outage()
        await s.until_progress(
            lambda p: p.committed == intents and not p.outbox, 180, "every intent relayed"
        )
        await s.workers(2, "--concurrency", "4", "--handler-delay", delay)
        await s.until_progress(lambda p: p.effected >= intents // 10, 60, "a tenth effected")
        consuming = await outage()
        await s.finish(
            drain_timeout=180 if size == REDUCED else 600,
            fault="stop_app/start_app" if full else "close_all_connections",
            after_publish_fault=f"committed:{publishing.committed},unsent:{publishing.outbox}",
            effected_after_consume_fault=consuming.effected,
        )
    # the faults hit while there was still work: the burst was not relayed, the queue not empty
    assert publishing.committed < intents or publishing.outbox > 0
    assert consuming.effected < intents


@pytest.mark.parametrize("size", SIZES)
async def test_postgres_outage_while_processing(size: str, tmp_path: Path) -> None:
    """Reduced: every backend of the database terminated, twice; full: an immediate restart.

    The pools recover, nothing is lost or applied twice, and no session is left idle in a
    transaction (checked in `finish`).
    """
    intents = {REDUCED: 300, FULL: 3000}[size]
    full = size == FULL
    async with Scenario(name("postgres_outage", size), intents, tmp_path) as s:
        await asyncio.gather(
            s.workers(2, "--handler-delay", "0.02", "--sleep-in-database"),
            s.driver("--rate", "150" if not full else "400"),
        )
        terminated: list[int] = []
        seen: list[int] = []
        for share in (3,) if full else (4, 2):
            await s.until_progress(
                lambda p, share=share: p.effected >= intents // share,
                120,
                f"1/{share} effected",
            )
            if full:
                await s.restart_postgres(down_for=3.0)
            else:
                terminated.append(await s.terminate_backends())
            seen.append((await s.progress()).effected)
        await s.finish(
            drain_timeout=180 if size == REDUCED else 600,
            fault="pg_ctlcluster stop -m immediate/start" if full else "pg_terminate_backend",
            terminated="+".join(map(str, terminated)) or "all",
            effected_after_faults="/".join(map(str, seen)),
        )
    assert all(n < intents for n in seen)
    assert full or all(n > 0 for n in terminated)


@pytest.mark.parametrize("size", SIZES)
async def test_always_failing_handler(size: str, tmp_path: Path) -> None:
    """A burst of messages whose handler always fails ends in the error queue after 4 attempts
    (1 + 1 immediate + 2 delayed), Work keeps flowing meanwhile, and no retry storm builds up."""
    intents, burst = {REDUCED: (300, 200), FULL: (3000, 1000)}[size]
    async with Scenario(name("always_failing_handler", size), intents, tmp_path) as s:
        await s.workers(2, "--concurrency", "8", "--immediate", "1", "--delayed", "0.2,0.2")
        sampler = DepthSampler(s, burst, in_flight=2 * 8)
        async with sampler:
            await s.driver("--doom", str(burst))  # the burst first, in one transaction
            await sampler.run(timeout=120 if size == REDUCED else 600)
        doom = await s.db.fetchrow(
            "SELECT count(*) AS runs, count(DISTINCT message_id) AS ids, min(at) AS first, "
            "max(at) AS last FROM deliveries WHERE stage = 'handled' AND kind = 'doom'"
        )
        overlap = await s.db.fetchrow(
            "SELECT count(*) AS n FROM effects WHERE at BETWEEN $1 AND $2",
            doom["first"],
            doom["last"],
        )
        await s.finish(
            drain_timeout=120 if size == REDUCED else 600,
            burst=burst,
            doom_handler_runs=doom["runs"],
            work_effects_while_doom_retried=overlap["n"],
            max_wait_queue_ready=sampler.max_wait,
            max_doom_ready=sampler.max_doom,
            depth_samples=sampler.samples,
            max_depth_listed=sampler.max_listed,
            max_doom_listed=sampler.max_doom_listed,
            listings=sampler.listings,
        )
        dead = await read_error_queue(s.transport)
    assert len(dead) == burst
    assert {d["type"] for d in dead} == {DOOM_TYPE}
    assert len({d["id"] for d in dead}) == burst
    assert {d["attempts"] for d in dead} == {"4"}
    assert doom["ids"] == burst
    assert doom["runs"] >= 4 * burst
    assert overlap["n"] > 0  # Work was effected while the burst was being retried
    assert sampler.max_wait <= burst
    assert sampler.max_doom <= burst
    # (max_doom_listed is reported, not bounded: the management API lists counts with a lag
    # of seconds, so that sum mixes moments.)


class DepthSampler:
    """Samples the ready messages of the input and wait queues, many times a second.

    Passive declares on a connection of the test's own give each queue's ready count at once;
    the management API's listing (ready and unacknowledged) runs alongside, finds the wait
    queues and gives a second, slower measure (lagging: the broker publishes its counts every
    few seconds). Only
    failing messages enter wait queues; Work ready in the input queue is at most what was
    committed by the end of the sample minus what was effected before it, so the rest of
    the input queue's messages, plus the wait queues', are Doom copies.
    """

    def __init__(self, scenario: Scenario, burst: int, in_flight: int) -> None:
        self.scenario = scenario
        self.burst = burst
        self.in_flight = in_flight
        self.wait_queues = {wait_queue_name("", WORK_QUEUE, wait_milliseconds(0.2))}
        self.max_wait = self.max_doom = self.samples = 0
        self.max_listed = self.max_doom_listed = self.listings = 0
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._channel: aio_pika.abc.AbstractChannel | None = None
        self._lister: asyncio.Task[None] | None = None

    async def __aenter__(self) -> DepthSampler:
        self._connection = await aio_pika.connect(self.scenario.transport)
        self._lister = asyncio.create_task(self._list())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._lister is not None:
            self._lister.cancel()
            await asyncio.gather(self._lister, return_exceptions=True)
        if self._connection is not None:
            await self._connection.close()

    async def _list(self) -> None:
        s = self.scenario
        while True:
            before = await s.progress()
            depths = await s.listed_depths()
            after = await s.progress()
            self.wait_queues |= {queue for queue in depths if ".wait." in queue}
            listed = depths.get(WORK_QUEUE, 0) + sum(
                n for queue, n in depths.items() if ".wait." in queue
            )
            # `messages` counts unacknowledged deliveries too: up to `in_flight` of them may be
            # Work already effected and not yet acked.
            work_at_most = after.committed - before.effected + self.in_flight
            self.max_listed = max(self.max_listed, listed)
            self.max_doom_listed = max(self.max_doom_listed, listed - work_at_most)
            self.listings += 1
            await asyncio.sleep(0.2)

    async def ready(self, queue: str) -> int:
        """Messages ready in `queue` (0 if it does not exist)."""
        assert self._connection is not None
        if self._channel is None or self._channel.is_closed:
            self._channel = await self._connection.channel()
        try:
            declared = await self._channel.declare_queue(queue, passive=True)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            self._channel = None  # the broker closed it
            return 0
        return int(declared.declaration_result.message_count or 0)

    async def run(self, timeout: float) -> None:
        """Sample until the whole burst is in the error queue and every intent was effected."""
        await eventually(
            self.sample,
            "the whole burst in the error queue and every intent effected",
            timeout=timeout,
            interval=0.05,
        )

    async def sample(self) -> bool:
        """Take one sample; whether the whole burst is dead and every intent effected."""
        s = self.scenario
        before = await s.progress()
        ready_work = await self.ready(WORK_QUEUE)
        ready_wait = sum([await self.ready(queue) for queue in sorted(self.wait_queues)])
        dead = await self.ready(ERROR_QUEUE)
        after = await s.progress()
        self.samples += 1
        self.max_wait = max(self.max_wait, ready_wait)
        work_at_most = after.committed - before.effected
        self.max_doom = max(self.max_doom, ready_work + ready_wait - work_at_most)
        return dead >= self.burst and after.effected == s.intents


async def read_error_queue(url: str) -> list[dict[str, str]]:
    """The dead letters in the error queue (consumed): type, id and error-attempts of each."""
    found: list[dict[str, str]] = []
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        queue = await channel.get_queue(ERROR_QUEUE, ensure=False)
        while (message := await queue.get(no_ack=True, fail=False)) is not None:
            headers = {k: str(v) for k, v in (message.headers or {}).items()}
            found.append(
                {
                    "type": message.type or headers.get(Header.TYPE, ""),
                    "id": message.message_id or headers.get(Header.MESSAGE_ID, ""),
                    "attempts": headers.get(Header.ERROR_ATTEMPTS, ""),
                }
            )
    finally:
        await connection.close()
    return found


@pytest.mark.parametrize("size", SIZES)
async def test_slow_handler(size: str, tmp_path: Path) -> None:
    """Every 4th handler (full: 10th) takes 2 s, at concurrency 4: no redelivery, no rerun.

    RabbitMQ's consumer_timeout here is 30 minutes, far beyond a bounded run: this shows slow
    handlers holding their slots (and the prefetched deliveries waiting behind them) cause no
    redelivery or duplicate, not the behaviour at the timeout itself.
    """
    intents, every = {REDUCED: (120, 4), FULL: (2000, 10)}[size]
    async with Scenario(name("slow_handler", size), intents, tmp_path) as s:
        await asyncio.gather(
            s.workers(2, "--concurrency", "4", "--slow", "2.0", "--slow-every", str(every)),
            s.driver(),
        )
        figures = await s.finish(
            drain_timeout=180 if size == REDUCED else 600,
            slow_messages=len(range(0, intents, every)),
            slow_seconds=2.0,
        )
    assert figures.raw_duplicate_deliveries == 0
    assert figures.handler_reruns == 0


@pytest.mark.parametrize("size", SIZES)
async def test_graceful_stop_under_load(size: str, tmp_path: Path) -> None:
    """SIGTERM a worker mid-stream (again and again): it finishes and commits what it started,
    exits 0, and nothing it committed is delivered or applied again."""
    intents, stops, delay = {REDUCED: (400, 3, "0.1"), FULL: (4000, 6, "0.05")}[size]
    async with Scenario(name("graceful_stop", size), intents, tmp_path) as s:
        workers, _ = await asyncio.gather(
            s.workers(2, "--concurrency", "4", "--handler-delay", delay),
            s.driver(),
        )
        stopped = []
        for n in range(1, stops + 1):
            await s.until_progress(
                lambda p, n=n: p.effected >= intents * n // (stops + 1),
                120,
                f"{n}/{stops + 1} effected",
            )
            stopped.append(workers.signal(signal.SIGTERM))

        async def stopped_ended() -> bool:
            return not any(proc.running for proc in stopped)

        await s.until(stopped_ended, 60, "the stopped workers exited")
        unfinished = await s.db.fetchrow(
            "SELECT count(*) AS n FROM deliveries d WHERE d.stage = 'handled' AND d.kind = 'work' "
            "AND d.pid = ANY($1::int[]) AND NOT EXISTS (SELECT 1 FROM effects e "
            "WHERE e.message_id = d.message_id AND e.pid = d.pid)",
            [proc.pid for proc in stopped],
            patience=30,
        )
        figures = await s.finish(
            drain_timeout=120 if size == REDUCED else 600,
            sigterms=len(stopped),
            unfinished_by_stopped=unfinished["n"],
            slowest_stop_s=f"{max(stop_seconds(p) for p in stopped):.2f}",
        )
    ends = {e.pid: e.code for e in s.exits("worker")}
    assert [ends[proc.pid] for proc in stopped] == [0] * len(stopped)
    assert unfinished["n"] == 0  # every handler a stopping worker began, it committed
    assert figures.handler_reruns == 0
    assert figures.raw_duplicate_deliveries == 0


def stop_seconds(proc: Proc) -> float:
    """How long a process took to exit after its signal."""
    return (proc.ended_at or time.monotonic()) - proc.signalled_at
