"""Ordered partitions across two app instances on the cluster, while one instance is killed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from mersal import App, OutcomeUnknown
from tests.chaos.ledger import LEDGER_LINES, ROOT
from tests.cluster.nodes import Cluster
from tests.cluster.ordered import QUEUE, STEPS_TABLE, Step
from tests.cluster.scenario import ClusterScenario

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

KEYS = 30
STEPS = 20


@contextlib.asynccontextmanager
async def instance(s: ClusterScenario, log: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """One process of the partitioned app, READY on stdout; killed at the end."""
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    with log.open("ab") as errors:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.cluster.ordered",
            "--database",
            s.database,
            "--transport",
            s.transport,
            cwd=ROOT,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=errors,
        )
    try:
        assert process.stdout is not None
        async with asyncio.timeout(60):
            while (line := await process.stdout.readline()) and line.strip() != b"READY":
                pass
        assert line.strip() == b"READY", f"not READY; see {log}"
        yield process
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def send_until_sure(app: App, step: Step) -> None:
    """Send, again while the outcome is unknown (the receiver's inbox drops a copy)."""
    for _ in range(100):
        try:
            await app.send(step, partition_key=step.key)
            return
        except OutcomeUnknown:
            await asyncio.sleep(0.1)
    raise AssertionError(f"could not send {step}")


async def test_per_key_order_holds_across_instances_while_the_active_one_is_killed(
    cluster: Cluster, tmp_path: Path
) -> None:
    total = KEYS * STEPS
    async with ClusterScenario(cluster, "cluster_partitions", total, tmp_path) as s:
        database = await asyncpg.connect(s.dsn)
        try:
            await database.execute(STEPS_TABLE)
            sender = App("cluster.sender", transport=s.transport, consume=False)
            sender.route(Step, QUEUE)
            async with (
                instance(s, tmp_path / "first.log") as first,
                instance(s, tmp_path / "second.log") as second,
                sender,
            ):
                for seq in range(STEPS):
                    for key in range(KEYS):
                        await send_until_sure(sender, Step(f"k{key}", seq))
                    if seq == STEPS // 3:
                        done = await database.fetchval("SELECT count(*) FROM steps")
                        first.send_signal(signal.SIGKILL)  # the active one: it started first
                        await first.wait()
                        killed_after = done

                async def all_done() -> bool:
                    return await database.fetchval("SELECT count(*) FROM steps") >= total

                await s.until(all_done, 120, "every step taken", interval=0.3)
                rows = await database.fetch("SELECT key, seq, pid FROM steps ORDER BY id")
                second_pid = second.pid
        finally:
            await database.close()
    seen: dict[str, list[int]] = {}
    for row in rows:
        seen.setdefault(row["key"], []).append(row["seq"])
    out_of_order = sum(1 for seqs in seen.values() if seqs != sorted(seqs))
    pairs = {(row["key"], row["seq"]) for row in rows}
    lost = total - len(pairs)
    duplicated = len(rows) - len(pairs)
    by_second = sum(1 for row in rows if row["pid"] == second_pid)
    line = (
        f"scenario=cluster_partitions_instance_killed intents={total} lost={lost} "
        f"duplicated_effects={duplicated} out_of_order_keys={out_of_order} "
        f"taken_before_kill={killed_after} taken_by_second={by_second}"
    )
    LEDGER_LINES.append(line)
    print(line, flush=True)
    assert lost == 0, line
    assert duplicated == 0, line
    assert out_of_order == 0, {key: seqs for key, seqs in seen.items() if seqs != sorted(seqs)}
    assert all(seqs == list(range(STEPS)) for seqs in seen.values())
    assert 0 < killed_after < total
    assert by_second > 0  # the second instance took over the partitions
