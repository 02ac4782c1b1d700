"""What several benchmarks share: a private RabbitMQ vhost, phase tallies, percentiles, CPU µs."""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import make_url

from mersal import App
from mersal.settings import prefetch_of

RABBITMQ_HOST = os.environ.get("MERSAL_BENCH_RABBITMQ_HOST", "127.0.0.1")
SBIN = "/usr/local/sbin:/usr/sbin:/sbin"
PHASE_TIMEOUT = 120.0

CONCURRENCY: int = inspect.signature(App).parameters["concurrency"].default
PREFETCH = prefetch_of(None, CONCURRENCY)
"""An App's default concurrency and prefetch, which the hand-written sides copy."""

QUEUE_TYPE = "quorum"
"""The queue type of raw baselines: what an App declares by default."""


@asynccontextmanager
async def private_vhost(prefix: str = "mersal-bench") -> AsyncIterator[str]:
    """The URL of a new vhost that guest may use; the vhost and its queues go afterwards."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    await rabbitmqctl("add_vhost", name)
    try:
        await rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        yield f"amqp://guest:guest@{RABBITMQ_HOST}/{name}"
    finally:
        await rabbitmqctl("delete_vhost", name)


async def rabbitmqctl(*args: str) -> None:
    """Run `rabbitmqctl -q ARGS`; a `RuntimeError` with its output if it fails."""
    command = shutil.which("rabbitmqctl", path=f"{os.environ.get('PATH', '')}:{SBIN}")
    if command is None:
        raise RuntimeError(
            "this benchmark makes a RabbitMQ vhost of its own with rabbitmqctl, which is not on "
            "PATH: run it as root where RabbitMQ's tools are installed"
        )
    process = await asyncio.create_subprocess_exec(
        command, "-q", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    output, _ = await process.communicate()
    if process.returncode:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {output.decode(errors='replace')}")


def percentile_ms(seconds: list[float], percent: float) -> float:
    """The nearest-rank percentile of latencies in seconds, in milliseconds (NaN for none)."""
    ordered = sorted(seconds)
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(percent / 100 * len(ordered)))
    return ordered[rank - 1] * 1000


@dataclass
class Phase:
    """What one phase measured."""

    rate: float
    """Items (messages, chains) per second, first send to last arrival."""
    latencies: list[float]
    """Seconds per item, as the benchmark defines its latency."""
    cpu_seconds: float
    """This process's CPU time per item (the broker's and the database's not included)."""


class Tally:
    """The items of one phase that arrived, each with its latency (None: not measured)."""

    def __init__(self, expected: int, what: str = "messages arrived") -> None:
        self.expected = expected
        self.what = what
        self.arrived = 0
        self.latencies: list[float] = []
        self.finished_at = 0.0
        self.cpu_at_finish = 0.0
        self.done = asyncio.Event()

    def record(self, latency: float | None) -> None:
        """Count an arrival."""
        self.arrived += 1
        if latency is not None:
            self.latencies.append(latency)
        if self.arrived == self.expected:
            self.finished_at, self.cpu_at_finish = time.perf_counter(), time.process_time()
            self.done.set()

    async def wait(self) -> None:
        """Until every expected item has arrived; a `TimeoutError` naming the shortfall."""
        try:
            async with asyncio.timeout(PHASE_TIMEOUT):
                await self.done.wait()
        except TimeoutError:
            raise TimeoutError(
                f"only {self.arrived} of {self.expected} {self.what} within {PHASE_TIMEOUT:g}s"
            ) from None

    def phase(self, started: float, cpu: float) -> Phase:
        """The phase's figures, given when its first send began and the CPU time then."""
        return Phase(
            rate=self.expected / (self.finished_at - started),
            latencies=self.latencies,
            cpu_seconds=(self.cpu_at_finish - cpu) / self.expected,
        )


def per_call_us(call: Callable[[Any], object], argument: object, calls: int) -> float:
    """CPU µs per call of `call(argument)` over `calls` calls, after a short warm-up.

    CPU time, not wall time: other work on the machine does not count against the call.
    """
    for _ in range(calls // 50):
        call(argument)
    started = time.process_time()
    for _ in range(calls):
        call(argument)
    return (time.process_time() - started) / calls * 1e6


def asyncpg_dsn(database: str) -> str:
    """The DSN bare asyncpg connects with to the database of a SQLAlchemy URL."""
    url = make_url(database).set(drivername="postgresql")
    return url.render_as_string(hide_password=False)
