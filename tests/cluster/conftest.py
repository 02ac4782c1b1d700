"""Fixtures for the tests on a local three-node RabbitMQ cluster (`make cluster-test`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from uuid import uuid4

import pytest

from tests.cluster.nodes import NODES, SERVER, Cluster, ClusterError


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """c1..c3 booted and joined for this session, stopped after it (MERSAL_CLUSTER_KEEP=1 keeps)."""
    if not SERVER.exists():
        pytest.skip(f"RabbitMQ is not installed here: {SERVER} is missing")
    nodes = Cluster()
    try:
        nodes.start()
        yield nodes
    finally:
        if not os.environ.get("MERSAL_CLUSTER_KEEP"):
            nodes.teardown()


@pytest.fixture
def cluster_vhost(cluster: Cluster) -> Iterator[str]:
    """A vhost of this test's own on the cluster; nodes the test left down are started after."""
    name = f"mersal-cluster-{uuid4().hex[:8]}"
    cluster.add_vhost(name)
    try:
        yield name
    finally:
        running = cluster.running()
        for node in NODES:
            if node not in running:
                cluster.start_node(node)
        with contextlib.suppress(ClusterError):
            cluster.delete_vhost(name)
