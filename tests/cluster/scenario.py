"""The chaos ledger harness on the local three-node cluster: a vhost there, the failover URL."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.chaos.ledger import Scenario
from tests.cluster.nodes import NODES, Cluster


class ClusterScenario(Scenario):
    """A ledger scenario whose vhost lives on the cluster and whose programs get all three URLs.

    Every program connects with the failover URL (c1;c2;c3): the first node that answers, and
    the next when it goes down. Nodes a scenario left down are started again at the end.
    """

    def __init__(self, cluster: Cluster, name: str, intents: int, logs: Path) -> None:
        super().__init__(name, intents, logs)
        self.cluster = cluster
        self.vhost = f"mersal-cluster-{self.key}"
        self.transport = cluster.failover_url(self.vhost)

    async def ctl(self, *args: str) -> str:
        """`rabbitmqctl -q ARGS` against a running node of the cluster."""
        return await asyncio.to_thread(self.cluster.ctl, *args)

    async def leader(self, queue: str) -> str:
        """The node leading quorum queue `queue` of the scenario's vhost."""
        return await asyncio.to_thread(self.cluster.leader, queue, self.vhost)

    async def kill(self, node: str) -> None:
        """SIGKILL the node."""
        await asyncio.to_thread(self.cluster.kill, node)

    async def stop_node(self, node: str) -> None:
        """Stop the node gracefully."""
        await asyncio.to_thread(self.cluster.stop_node, node)

    async def start_node(self, node: str) -> None:
        """Start the node again and wait until it runs in the cluster."""
        await asyncio.to_thread(self.cluster.start_node, node)

    async def _teardown(self) -> list[str]:
        running = await asyncio.to_thread(self.cluster.running)
        for node in NODES:
            if node not in running:
                await self.start_node(node)
        return await super()._teardown()
