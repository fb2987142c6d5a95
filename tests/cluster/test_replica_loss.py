"""The loss scenario on a 3-primary / 3-replica Valkey Cluster, with replicas_acked 0 and 1.

A replica held behind (SIGSTOP and 40 MB queued behind it), a registration on its primary,
``kill -9`` of the primary, the lagging replica promoted by the cluster's own automatic
failover (1 s node timeout), the old primary back as its replica. With R = 0 the
registration was acknowledged and lost, and the worker of the old generation is dispatched
(why R exists); with R = 1 it was never acknowledged (503), the scheduler registered again
on the new primary, and the zombie is refused. Two gateways (a scheduler's and a worker's,
each with its own data dir) in this process, a loopback receiver counting dispatches.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.http.app import create_app
from gateway.store.keys import key_slot
from tests.conftest import Gateway, Upstream, gateway_settings
from tests.support.valkey_cluster import ValkeyCluster

pytestmark = pytest.mark.cluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ValkeyCluster]:
    """A cluster of its own: this test kills a primary and leaves the shard re-arranged."""
    # validity factor 0: the held-back replica may be promoted however long it was stopped
    # (by default it refuses once its link was down ~10 node timeouts: a slow run would
    # then never fail over at all)
    c = ValkeyCluster(
        tmp_path / "cluster",
        primaries=3,
        replicas=1,
        node_timeout_ms=1000,
        extra_args=("--cluster-replica-validity-factor", "0"),
    )
    c.start()
    try:
        c.write_markers()
        c.wait_synced()
        yield c
    finally:
        c.stop()


@pytest.fixture
async def cluster_gateways(
    cluster: ValkeyCluster, upstream: Upstream, tmp_path: Path
) -> AsyncIterator[Any]:
    clients: list[TestClient[Any, Any]] = []

    async def make(name: str, replicas_acked: int) -> Gateway:
        redis = {
            "cluster": True,
            "replicas_acked": replicas_acked,
            "replica_ack_timeout_ms": 300,
            "timeout_seconds": 2,
        }
        settings = gateway_settings(cluster.url, upstream.url, tmp_path / name, redis=redis)
        app = create_app(
            settings, redis_url=cluster.url, state_file=tmp_path / name / "fencegate.state"
        )
        client = TestClient(TestServer(app, host="127.0.0.1", port=0))
        await client.start_server()
        clients.append(client)
        # after the cluster's creation each replica rewrites its AOF before its fsynced
        # offset counts for WAITAOF: wait until every shard acknowledges (bounded)
        deadline = time.monotonic() + 30
        while (ready := await client.get("/readyz")).status != 200:
            assert time.monotonic() < deadline, await ready.text()
            await asyncio.sleep(0.2)
        return Gateway(client=client, app=app, settings=settings)

    yield make
    for client in clients:
        async with asyncio.timeout(30):
            await client.close()


async def _loss_scenario(
    cluster: ValkeyCluster, cluster_gateways: Any, replicas_acked: int
) -> tuple[int, int, int]:
    """Returns (the registration's status, the promoted node's fence, the zombie's status)."""
    scheduler: Gateway = await cluster_gateways("scheduler", replicas_acked)
    worker: Gateway = await cluster_gateways("worker", replicas_acked)
    assert (await scheduler.register("j", generation=1)).status == 201
    assert (await worker.effect("j", "s1", 1)).status == 200
    primary = await asyncio.to_thread(cluster.owner, key_slot("default/j"))
    replica = (await asyncio.to_thread(cluster.replicas_of, primary))[0]
    cluster.pause(replica)
    filler = cluster.client(primary)
    blob = "x" * (1 << 20)
    pipe = filler.pipeline(transaction=False)
    for i in range(40):  # in the job's slot: on this primary
        pipe.set(f"filler:{{default/j}}:{i}", blob)
    await asyncio.to_thread(pipe.execute)
    filler.close()
    registered = (await scheduler.register("j", generation=2)).status
    cluster.kill(primary)
    cluster.resume(replica)
    await asyncio.to_thread(cluster.wait_primary, replica, 30.0)  # the automatic failover
    fence = int(cluster.client(replica).hget("fg:{default/j}:job", "fence") or 0)
    await asyncio.to_thread(cluster.restart, primary)  # rejoins as the new primary's replica
    await asyncio.to_thread(cluster.wait_ok, 30.0)
    await asyncio.to_thread(cluster.wait_synced, 30.0)
    if registered != 201:  # never acknowledged: the scheduler registers again
        deadline = time.monotonic() + 30
        while (again := await scheduler.register("j", generation=2)).status not in (200, 201):
            assert time.monotonic() < deadline, await again.text()
            await asyncio.sleep(0.2)
    zombie = await worker.effect("j", "s2", 1)
    return registered, fence, zombie.status


async def test_cluster_loss_scenario_with_r0_admits_a_zombie(
    cluster: ValkeyCluster, cluster_gateways: Any, upstream: Upstream
) -> None:
    registered, fence, zombie = await _loss_scenario(cluster, cluster_gateways, 0)
    assert registered == 201  # acknowledged ...
    assert fence == 1  # ... lost in the failover ...
    assert zombie == 200  # ... and the zombie went through
    assert [r.headers["Idempotency-Key"] for r in upstream.received] == ["j:s1", "j:s2"]


async def test_cluster_loss_scenario_with_r1_never_acknowledges_what_it_loses(
    cluster: ValkeyCluster, cluster_gateways: Any, upstream: Upstream
) -> None:
    registered, fence, zombie = await _loss_scenario(cluster, cluster_gateways, 1)
    assert registered == 503  # never acknowledged
    assert fence == 1  # the promoted replica never got it either
    assert zombie == 409  # the re-registration was acknowledged: the zombie is refused
    assert [r.headers["Idempotency-Key"] for r in upstream.received] == ["j:s1"]


async def test_readyz_names_the_shard_whose_replica_does_not_acknowledge(
    cluster: ValkeyCluster, cluster_gateways: Any
) -> None:
    gw: Gateway = await cluster_gateways("a", 1)  # ready: every shard acknowledges
    primary = await asyncio.to_thread(cluster.owner, key_slot("default/j"))
    replica = (await asyncio.to_thread(cluster.replicas_of, primary))[0]
    cluster.pause(replica)
    try:
        resp = await gw.client.get("/readyz")
        checks = (await resp.json())["checks"]
        shards = {k: v for k, v in checks.items() if k.startswith("replicas_acked ")}
        assert resp.status == 503 and checks["replicas_acked"] is False
        assert len(shards) == 3 and [k for k, ok in shards.items() if not ok] == [
            f"replicas_acked 127.0.0.1:{primary.port}"
        ], shards
    finally:
        cluster.resume(replica)
    deadline = time.monotonic() + 20
    while (await gw.client.get("/readyz")).status != 200:
        assert time.monotonic() < deadline, "not ready again after the replica came back"
        await asyncio.sleep(0.2)
