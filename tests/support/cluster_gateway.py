"""Fixtures for the Cluster tests: in-process gateways on the session's Valkey Cluster.

test_contract_on_cluster.py re-runs the contract modules with these fixtures in place of the
standalone ones: ``redis_url`` is the cluster's seed URL, every gateway runs with
``[redis] cluster = true`` and ``replicas_acked = 1``, and ``redis_sync`` is a sync
``RedisCluster`` (``keys()`` reads every primary).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from aiohttp.test_utils import TestClient

from tests.conftest import Gateway, Upstream, gateway_settings, start_gateway
from tests.support.valkey_cluster import ValkeyCluster


class ClusterSync(redis.RedisCluster):
    """A sync ``RedisCluster`` whose ``keys()`` lists the keys of every primary."""

    fencegate_cluster: ValkeyCluster

    def keys(self, pattern: Any = "*", **kwargs: Any) -> list[Any]:  # type: ignore[override]
        found: list[Any] = []
        for node in self.fencegate_cluster.primaries():
            found += self.fencegate_cluster.client(node).keys(pattern)
        return found


def cluster_sync(cluster: ValkeyCluster) -> ClusterSync:
    client = ClusterSync(
        startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in cluster.seeds],
        decode_responses=True,
    )
    client.fencegate_cluster = cluster
    return client


@pytest.fixture
def redis_url(initialised_cluster_url: str) -> str:
    return initialised_cluster_url


@pytest.fixture
def redis_sync(redis_url: str, valkey_cluster: ValkeyCluster) -> Iterator[ClusterSync]:
    client = cluster_sync(valkey_cluster)
    yield client
    client.close()


@pytest.fixture
async def make_gateway(redis_url: str, upstream: Upstream, tmp_path: Path) -> AsyncIterator[Any]:
    """As tests/conftest.py's, with ``[redis] cluster = true`` and ``replicas_acked = 1``."""
    clients: list[TestClient[Any, Any]] = []

    async def make(headers: dict[str, str] | None = None, **sections: Any) -> Gateway:
        # R = 1: every verdict waits for the primary and its replica to fsync (the supported
        # deployment); a test may ask for replicas_acked = 0
        sections["redis"] = {
            "cluster": True,
            "replicas_acked": 1,
            "replica_ack_timeout_ms": 500,
            **sections.get("redis", {}),
        }
        settings = gateway_settings(redis_url, upstream.url, tmp_path, **sections)
        return await start_gateway(settings, tmp_path, clients, headers)

    yield make
    for c in clients:
        await c.close()
