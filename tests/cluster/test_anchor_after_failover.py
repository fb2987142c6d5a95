"""The audit anchorer on a Cluster after a failover: redis-py's RedisCluster runs each command
queued on a *transaction* pipeline in a thread with its own event loop and joins it; once the
client marked itself for re-initialisation (what a MOVED or a failover does) that thread waits
on the main loop's connections forever and the join blocked the whole gateway (found by
tests/chaos/cluster.py: a gateway stopped answering even /healthz after a failover)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from gateway.store.anchors import Anchorer
from gateway.store.cluster import connect_cluster
from gateway.store.keys import JobKeys

pytestmark = pytest.mark.cluster


@pytest.mark.timeout(60)
async def test_the_anchor_read_does_not_block_the_loop_after_a_failover(
    cluster_url: str, tmp_path: object
) -> None:
    client = connect_cluster(cluster_url, timeout=2, max_connections=8)
    job = JobKeys("default", "j")
    try:
        await client.initialize()
        entry = await client.xadd(job.audit, {"reason": "x"})
        await client.hset(job.job, mapping={"audit_head": "h", "audit_last": entry})
        path = tmp_path / "anchors.jsonl"  # type: ignore[operator]
        anchorer = Anchorer(client, {job: entry}, path, [])
        client._initialize = True  # what redis-py sets on MOVED / a connection error
        # a watchdog outside the loop: a blocked loop cannot time itself out
        blocked = threading.Event()
        timer = threading.Timer(10, blocked.set)
        timer.start()
        started = time.monotonic()
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        anchored = await anchorer.anchor_once()
        ticker.cancel()
        timer.cancel()
        assert not blocked.is_set(), "the anchor read blocked the event loop for 10 s"
        [record] = [json.loads(line) for line in path.read_text().splitlines()]
        assert anchored == 1 and record["entry"] == entry and record["count"] == 1
        assert time.monotonic() - started < 5
    finally:
        await client.aclose()
