"""What several benchmarks share: a private RabbitMQ vhost, and latency percentiles."""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

RABBITMQ_HOST = os.environ.get("MERSAL_BENCH_RABBITMQ_HOST", "127.0.0.1")
SBIN = "/usr/local/sbin:/usr/sbin:/sbin"


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
