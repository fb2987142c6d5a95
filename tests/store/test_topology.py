"""The replication topology that replicas_acked relies on, checked against real Valkey
primaries and replicas (tests.support.valkey_replicas), and the refusal to start without it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.cli.serve import check_replication
from gateway.http.app import create_app
from gateway.runtime.settings import ConfigError, load_settings
from gateway.store.embedded import free_port
from gateway.store.topology import check_topology
from tests.conftest import Upstream, gateway_settings
from tests.support.valkey_cluster import ValkeyCluster, running_cluster
from tests.support.valkey_replicas import ReplicaSet


def test_one_replica_and_r1_is_supported_anything_else_is_not(tmp_path: Path) -> None:
    rs = ReplicaSet(tmp_path / "v", replicas=1).start()
    try:
        url = rs.primary.url
        ok = asyncio.run(check_topology(url, 1))
        assert ok.ok and ok.warnings == [], ok
        assert [len(s.replicas) for s in ok.shards] == [1]
        # more acknowledgements than replicas: nothing could ever be acknowledged
        assert (
            "has 1 online replica(s), replicas_acked = 2"
            in asyncio.run(check_topology(url, 2)).problems[0]
        )
        # the URL names a replica: WAIT/WAITAOF do not work there
        on_replica = asyncio.run(check_topology(rs.replicas[0].url, 1))
        assert any("not a primary" in p for p in on_replica.problems), on_replica.problems
        # a second replica, with fsync everysec: WAIT 1 could be satisfied by either one, so a
        # promoted one may lack an acknowledged write; and its AOF is not fsynced per write
        rs.add_replica(extra=("--appendfsync", "everysec"))
        two = asyncio.run(check_topology(url, 1)).problems
        assert any("has 2 replicas, replicas_acked = 1" in p for p in two), two
        assert any("appendfsync is 'everysec'" in p for p in two), two
        assert not any("has 2 replicas" in p for p in asyncio.run(check_topology(url, 2)).problems)
    finally:
        rs.stop()


def test_serve_refuses_a_topology_it_cannot_rely_on(tmp_path: Path) -> None:
    rs = ReplicaSet(tmp_path / "v", replicas=1).start()
    try:
        url = rs.primary.url
        assert check_replication(load_settings(None, redis={"url": url, "replicas_acked": 1}))
        two = load_settings(None, redis={"url": url, "replicas_acked": 2})
        assert not check_replication(two)  # exit code 3 in `fencegate serve`
        waived = load_settings(
            None, redis={"url": url, "replicas_acked": 2, "allow_volatile": True}
        )
        assert check_replication(waived)  # warned, started
        assert check_replication(load_settings(None, redis={"url": url}))  # R = 0: not checked
    finally:
        rs.stop()


def test_both_waits_must_fit_in_the_redis_timeout() -> None:
    with pytest.raises(ConfigError, match="replica_ack_timeout_ms"):
        load_settings(
            None,
            redis={"replicas_acked": 1, "replica_ack_timeout_ms": 1000, "timeout_seconds": 2},
        )
    load_settings(None, redis={"replicas_acked": 1, "replica_ack_timeout_ms": 900})


@pytest.mark.cluster
def test_a_brand_new_cluster_is_supported_and_a_stopped_replica_is_not(tmp_path: Path) -> None:
    """Before any write, ``CLUSTER SHARDS`` calls every replica ``loading``: the check judges
    a replica by its primary's INFO replication (link online) and its own settings instead,
    and takes the first seed that answers."""
    with running_cluster(tmp_path / "c", primaries=3, replicas=1, node_timeout_ms=1000) as c:
        c.wait_synced()
        fresh = asyncio.run(check_topology(c.url, 1))
        assert fresh.ok and fresh.cluster, fresh.problems
        assert [len(s.replicas) for s in fresh.shards] == [1, 1, 1]
        # the first seed is dead: the next one tells the layout
        dead_first = c.url.replace("redis://", f"redis://127.0.0.1:{free_port()},")
        assert asyncio.run(check_topology(dead_first, 1)).ok
        primary = c.primaries()[0]
        replica = c.replicas_of(primary)[0]
        c.pause(replica)  # its primary still lists the link online: the replica is asked
        try:
            paused = asyncio.run(check_topology(c.url, 1, io_timeout=0.5)).problems
            assert any(f"replica 127.0.0.1:{replica.port} is unreachable" in p for p in paused)
        finally:
            c.resume(replica)
        c.kill(replica)  # the link is gone: the primary has no replica to acknowledge
        gone = asyncio.run(check_topology(c.url, 1)).problems
        assert gone == [
            f"primary 127.0.0.1:{primary.port} has 0 online replica(s), replicas_acked = 1: "
            "no write could be acknowledged"
        ], gone


@pytest.mark.cluster
async def test_readyz_of_a_brand_new_cluster(tmp_path: Path, upstream: Upstream) -> None:
    """A fresh 3+3 cluster with replicas_acked = 1: ready before any job was written; a
    stopped replica makes it not ready."""
    c = ValkeyCluster(tmp_path / "c", primaries=3, replicas=1, node_timeout_ms=1000)
    await asyncio.to_thread(c.start)
    try:
        await asyncio.to_thread(c.wait_synced)
        redis = {"cluster": True, "replicas_acked": 1, "topology_interval_seconds": 0.3}
        settings = gateway_settings(c.url, upstream.url, tmp_path / "g", redis=redis)
        app = create_app(settings, redis_url=c.url, state_file=tmp_path / "g" / "fg.state")
        async with TestClient(TestServer(app, host="127.0.0.1", port=0)) as client:
            # bounded: each new replica rewrites its AOF once before WAITAOF counts it
            deadline = time.monotonic() + 30
            while (ready := await client.get("/readyz")).status != 200:
                assert time.monotonic() < deadline, await ready.text()
                await asyncio.sleep(0.2)
            replica = c.replicas_of(c.primaries()[0])[0]
            c.kill(replica)
            deadline = time.monotonic() + 10
            while (ready := await client.get("/readyz")).status != 503:
                assert time.monotonic() < deadline, "still ready without a replica"
                await asyncio.sleep(0.2)
            assert (await ready.json())["checks"]["replicas_acked"] is False
    finally:
        await asyncio.to_thread(c.stop)
