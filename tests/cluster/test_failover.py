"""Faults on the three-node cluster, counted with the chaos ledger: lost = 0, duplicated = 0.

The producer (its outbox relay publishing), two consumers and the broker all run while a node
goes away: every program connects with the failover URL, the queues are quorum queues.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.ledger import Progress
from tests.chaos.test_scenarios import read_error_queue
from tests.chaos.worker import WORK_QUEUE
from tests.cluster.nodes import NODES, Cluster
from tests.cluster.scenario import ClusterScenario

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


async def test_the_node_leading_the_queue_is_killed_under_load(
    cluster: Cluster, tmp_path: Path
) -> None:
    """kill -9 of the leader while the relay publishes and two workers consume."""
    intents = 600
    async with ClusterScenario(cluster, "cluster_leader_killed", intents, tmp_path) as s:
        leader = await s.leader(WORK_QUEUE)
        await s.workers(2, "--concurrency", "4", "--handler-delay", "0.01")
        await s.driver("--rate", "30")
        await s.until_progress(lambda p: p.effected >= intents // 5, 90, "a fifth effected")
        await s.kill(leader)
        at_kill = await s.progress()
        await s.until_progress(
            lambda p: p.effected >= min(intents, at_kill.effected + 60),
            90,
            "progress after the kill",
        )
        await s.start_node(leader)
        await s.finish(
            drain_timeout=240,
            killed=leader,
            committed_at_kill=at_kill.committed,
            effected_at_kill=at_kill.effected,
        )
    assert at_kill.committed < intents  # the relay was still publishing when the node died


async def test_a_rolling_restart_under_load(cluster: Cluster, tmp_path: Path) -> None:
    """Each node in turn stops gracefully and starts again while work flows."""
    intents = 1200
    async with ClusterScenario(cluster, "cluster_rolling_restart", intents, tmp_path) as s:
        await s.workers(2, "--concurrency", "4", "--handler-delay", "0.01")
        await s.driver("--rate", "20")
        marks: list[Progress] = []
        for node in NODES:
            before = await s.progress()
            await s.until_progress(
                lambda p, b=before: p.effected >= min(intents, b.effected + 20),
                90,
                f"progress before {node}",
            )
            await s.stop_node(node)
            marks.append(await s.progress())
            await s.start_node(node)
        await s.finish(
            drain_timeout=240,
            effected_at_stops=",".join(str(mark.effected) for mark in marks),
        )
    assert marks[-1].effected < intents  # work was still flowing when the last node stopped


async def test_delayed_retries_waiting_on_a_dead_node_are_still_delivered(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A burst of failing messages waits in a quorum wait queue when its leader is killed."""
    intents, burst = 100, 60
    async with ClusterScenario(cluster, "cluster_wait_queue_leader_killed", intents, tmp_path) as s:
        await s.workers(2, "--concurrency", "8", "--immediate", "0", "--delayed", "4,4")
        await s.driver("--doom", str(burst))
        wait_queue = f"{WORK_QUEUE}.wait.4000"

        async def waiting() -> bool:
            return (await s.queue_depths()).get(wait_queue, 0) >= burst // 2

        await s.until(waiting, 60, "the burst waiting in the wait queue", interval=0.2)
        leader = await s.leader(wait_queue)
        await s.kill(leader)
        await s.start_node(leader)
        await s.finish(drain_timeout=240, burst=burst, killed=leader)
        running = await s.ctl("list_queues", "-p", s.vhost, "name", "messages", "-q")
        node = next(n for n in NODES if n != leader)
        dead = await read_error_queue(cluster.url(node, s.vhost))
    assert len(dead) == burst, running
    assert {d["attempts"] for d in dead} == {"3"}
