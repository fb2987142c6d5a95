"""Cluster mode against a real 3+3 Valkey Cluster: the router (per-slot routing, MOVED after a
failover, NOSCRIPT on a new primary, ASK/TRYAGAIN during a slot migration), the markers per
slot per node (init, quarantine, the periodic per-slot check) and the per-primary scans."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from gateway.core.errors import StoreUnavailable
from gateway.http import appkeys as K
from gateway.store.keys import SLOTS, JobKeys
from gateway.store.router import ClusterRouter, key_slot_of
from gateway.store.store import Store, connect
from tests.conftest import Gateway, Upstream
from tests.support.cluster_gateway import make_gateway, redis_sync, redis_url  # noqa: F401
from tests.support.valkey_cluster import ValkeyCluster

pytestmark = pytest.mark.cluster


def router_of(gw: Gateway) -> ClusterRouter:
    router = gw.app[K.STORE].batcher
    assert isinstance(router, ClusterRouter)
    return router


def jobs_on_distinct_primaries(cluster: ValkeyCluster) -> dict[int, str]:
    """One job id per primary (port -> job), found by the slot of its hash tag."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < len(cluster.primaries()):
        job = f"job{i}"
        port = cluster.owner(JobKeys("default", job).slot).port
        found.setdefault(port, job)
        i += 1
    return found


async def test_scripts_of_every_primary_go_out_one_batch_per_primary(
    make_gateway: Any,  # noqa: F811 (cluster_support's)
    upstream: Upstream,
    valkey_cluster: ValkeyCluster,
) -> None:
    # what is tested is the batching, not the sends: on a loaded CI machine the 24 sends once
    # waited past the default 2 s for a pooled connection and were released (502)
    gw: Gateway = await make_gateway(bulkheads={"pool_wait_seconds": 30})
    jobs = list(jobs_on_distinct_primaries(valkey_cluster).values())
    for job in jobs:
        assert (await gw.register(job, generation=1)).status == 201
    router = router_of(gw)
    before_batches, before_commands = router.batches, router.commands
    replies = await asyncio.gather(*(gw.effect(job, f"s{n}", 1) for job in jobs for n in range(8)))
    assert {r.status for r in replies} == {200}
    assert len(upstream.received) == 24
    # each primary got its own commands, batched: far fewer batches than commands
    assert router.commands - before_commands >= 48  # admit + record per effect
    assert router.batches - before_batches < router.commands - before_commands
    assert len(router.pipelined_nodes) >= 3 and router.redirects["moved"] == 0


async def test_init_writes_each_slot_marker_on_its_own_primary_and_quarantine_removes_them(
    cluster_url: str, valkey_cluster: ValkeyCluster, tmp_path: Path
) -> None:
    client = connect(cluster_url, timeout=5, max_connections=4, cluster=True)
    store = Store(
        client, registration="required", dispatch_timeout_ms=1000, retention_seconds=60,
        state_file=tmp_path / "fencegate.state",
    )  # fmt: skip
    try:
        assert await store.initialize(auto=False) == "written"
        per_node = {}
        for node in valkey_cluster.primaries():
            keys = valkey_cluster.client(node).keys("fg:marker:*")
            per_node[node.port] = len(keys)
            served = valkey_cluster.client(node).execute_command("CLUSTER", "SLOTS")
            ranges = [(int(r[0]), int(r[1])) for r in served if int(r[2][1]) == node.port]
            for key in keys:  # every marker sits on the primary of its own slot
                assert any(a <= key_slot_of(key) <= b for a, b in ranges)
        assert sum(per_node.values()) == SLOTS and all(n > 5000 for n in per_node.values())
        assert await store.initialize(auto=True) == "present"  # no CROSSSLOT on the check
        from gateway.store import durability

        await durability.quarantine(client)
        for node in valkey_cluster.primaries():
            assert valkey_cluster.client(node).keys("fg:marker*") == []
        with pytest.raises(StoreUnavailable):
            await store.register(JobKeys("default", "after"), 1, None)
    finally:
        await store.aclose()
        await client.aclose()


async def test_noscript_on_a_flushed_primary_is_one_eval(
    gw: Gateway, upstream: Upstream, valkey_cluster: ValkeyCluster
) -> None:
    port, job = next(iter(jobs_on_distinct_primaries(valkey_cluster).items()))
    node = valkey_cluster.node_by_port(port)
    assert (await gw.register(job, generation=1)).status == 201
    valkey_cluster.client(node).script_flush()  # as a restart or a promoted replica has
    assert (await gw.effect(job, "a", 1)).status == 200
    assert (await gw.effect(job, "b", 1)).status == 200
    shas = list(gw.app[K.STORE].link.script_shas.values())
    assert valkey_cluster.client(node).script_exists(shas[0]) == [True]  # EVAL loaded it again
    assert len(upstream.received) == 2


async def test_manual_failover_moved_and_noscript_on_the_new_primary(
    gw: Gateway, upstream: Upstream, valkey_cluster: ValkeyCluster
) -> None:
    """The router's map still names the old primary: MOVED, then the promoted replica (which
    never loaded the scripts) gets one EVAL; the fence and the records are intact there."""
    port, job = next(iter(jobs_on_distinct_primaries(valkey_cluster).items()))
    old = valkey_cluster.node_by_port(port)
    assert (await gw.register(job, generation=1)).status == 201
    assert (await gw.effect(job, "before", 1)).status == 200
    assert (await gw.register(job, generation=2)).status == 201
    (replica,) = valkey_cluster.replicas_of(old)
    await asyncio.to_thread(valkey_cluster.failover, replica)  # plain: no write lost
    router = router_of(gw)
    slot = JobKeys("default", job).slot
    for _ in range(5):  # a topology check or the relay's sweep may refresh the map meanwhile
        router.owners[slot] = old.addr  # as the map was before the failover
        moved = router.redirects["moved"]
        zombie = await gw.effect(job, "after", 1)
        assert zombie.status == 409 and (await zombie.json())["code"] == "stale_generation"
        if router.redirects["moved"] > moved:
            break
    ok = await gw.effect(job, "after", 2)
    assert ok.status == 200, await ok.text()
    replay = await gw.effect(job, "before", 1)  # the record of the old primary, replicated
    assert replay.status == 409 or replay.headers.get("Idempotent-Replayed") == "true"
    assert router.redirects["moved"] > moved
    assert router.owners[slot] == replica.addr
    assert [r.headers["Fencing-Token"] for r in upstream.received] == ["1", "2"]
    await asyncio.to_thread(valkey_cluster.failover, old)  # back, for the next tests


async def test_slot_migrating_while_effects_flow(
    gw: Gateway, upstream: Upstream, valkey_cluster: ValkeyCluster
) -> None:
    """A job's slot moves (IMPORTING/MIGRATING, keys MIGRATEd a few at a time, SETSLOT NODE)
    while effects for its jobs flow: every answer is 200 or a 503 (TRYAGAIN past the bound,
    nothing done), never a 500; retried after the move each step is dispatched exactly once,
    the fence and the records moved with the slot, and so did the slot's marker."""
    job = "mig"
    keys = JobKeys("default", job)
    source = valkey_cluster.owner(keys.slot)
    target = next(p for p in valkey_cluster.primaries() if p.port != source.port)
    assert (await gw.register(job, generation=1)).status == 201
    for n in range(20):
        assert (await gw.effect(job, f"pre{n}", 1)).status == 200
    assert (await gw.register(job, generation=2)).status == 201
    statuses: Counter[int] = Counter()
    done: set[str] = set()
    stop = asyncio.Event()

    async def traffic() -> None:
        n = 0
        while not stop.is_set():
            step = f"live{n % 40}"
            resp = await gw.effect(job, step, 2)
            statuses[resp.status] += 1
            if resp.status == 200:
                done.add(step)
            else:
                body = await resp.json()
                assert resp.status == 503 and body["code"] == "store_unavailable", body
            n += 1
            await asyncio.sleep(0.002)

    runner = asyncio.create_task(traffic())
    await asyncio.sleep(0.2)

    def migrate() -> None:
        valkey_cluster.begin_migration(keys.slot, target)
        while valkey_cluster.move_keys(keys.slot, source, target, limit=3):
            import time

            time.sleep(0.05)
        valkey_cluster.finish_migration(keys.slot, target)

    await asyncio.to_thread(migrate)
    await asyncio.sleep(0.3)
    stop.set()
    await runner
    for n in range(40):  # the ones refused meanwhile, again (and the others: replays)
        resp = await gw.effect(job, f"live{n}", 2)
        assert resp.status == 200, await resp.text()
    per_step = Counter(r.headers["Idempotency-Key"] for r in upstream.received)
    assert set(per_step.values()) == {1}, per_step
    zombie = await gw.effect(job, "late", 1)
    assert zombie.status == 409 and (await zombie.json())["code"] == "stale_generation"
    target_client = valkey_cluster.client(target)
    assert target_client.exists(keys.marker, keys.job) == 2  # the marker moved with its slot
    assert (
        valkey_cluster.client(source).execute_command("CLUSTER", "COUNTKEYSINSLOT", keys.slot) == 0
    )
    router = router_of(gw)
    assert statuses[200] > 0
    assert router.redirects["ask"] + router.redirects["tryagain"] + router.redirects["moved"] > 0
    valkey_cluster.migrate_slot(keys.slot, source)  # back, for the next tests


async def test_a_slot_gone_back_fails_closed_and_the_periodic_check_reads_every_slot(
    make_gateway: Any,  # noqa: F811 (cluster_support's)
    valkey_cluster: ValkeyCluster,
) -> None:
    """The per-slot markers are the epochs on Cluster: the periodic check reads all 16,384
    through the router and keeps them as marks — so a slot this gateway never wrote, whose
    counter then goes back (a lagging replica promoted, a restored shard), is caught too."""
    a: Gateway = await make_gateway()
    store: Store = a.app[K.STORE]
    assert await store.heartbeat_epoch() is True
    assert len(store.link.slot_seen) == SLOTS
    never = JobKeys("default", "never-written")
    node = valkey_cluster.owner(never.slot)
    valkey_cluster.client(node).decrby(never.marker, 10)  # the slot went back
    assert (await a.register("never-written", generation=1)).status == 503
    assert await store.heartbeat_epoch() is False  # quarantined: every marker removed
    for primary in valkey_cluster.primaries():
        assert valkey_cluster.client(primary).keys("fg:marker*") == []
    other = await a.register("elsewhere", generation=1)
    assert other.status == 503


async def test_the_periodic_marks_check_under_traffic_on_every_shard_quarantines_nothing(
    make_gateway: Any,  # noqa: F811 (cluster_support's)
    valkey_cluster: ValkeyCluster,
) -> None:
    """The periodic check reads all 16,384 markers (hundreds of ms) while registrations on
    jobs of every shard raise their slots' counters: a counter read before a write that then
    raised the slot's mark is not a slot gone back. No quarantine; every call a verdict.
    (Redis and replica acknowledgements get seconds, not the default fractions: what is
    tested is the marks check, not a loaded machine's replica within 500 ms.)"""
    gw: Gateway = await make_gateway(redis={"timeout_seconds": 10, "replica_ack_timeout_ms": 4000})
    store: Store = gw.app[K.STORE]
    jobs = [f"busy{i}" for i in range(24)]
    owners = {valkey_cluster.owner(JobKeys("default", job).slot).port for job in jobs}
    assert owners == {p.port for p in valkey_cluster.primaries()}
    statuses: Counter[tuple[int, str]] = Counter()
    stop, under_way = asyncio.Event(), asyncio.Event()

    async def traffic(job: str) -> None:
        generation = 0
        while not stop.is_set():
            generation += 1
            resp = await gw.register(job, generation=generation)
            code = "" if resp.status == 201 else (await resp.json()).get("code", "")
            statuses[(resp.status, code)] += 1
            if sum(statuses.values()) >= len(jobs):
                under_way.set()

    tasks = [asyncio.create_task(traffic(job)) for job in jobs]
    try:
        await under_way.wait()  # every slot written before the first check
        checks = [await store.heartbeat_epoch() for _ in range(4)]
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    assert checks == [True] * 4
    assert set(statuses) == {(201, "")}, statuses
    primaries = [valkey_cluster.client(p) for p in valkey_cluster.primaries()]
    assert sum(len(c.keys("fg:marker*")) for c in primaries) == SLOTS + 1  # and the global one
    assert (await gw.register(jobs[0], generation=10**6)).status == 201


async def test_audit_verify_and_scans_cover_every_primary(
    gw: Gateway, valkey_cluster: ValkeyCluster
) -> None:
    jobs = list(jobs_on_distinct_primaries(valkey_cluster).values())
    for job in jobs:
        await gw.register(job, generation=2)
        assert (await gw.effect(job, "s", 1)).status == 409  # one audited rejection each
    check = await gw.app[K.STORE].verify_audit()
    # per job its registration (the registration history) and one rejection
    assert check.jobs == len(jobs) and check.entries == 2 * len(jobs) and not check.broken
    feed = await gw.audit()  # the tenant feed: best effort, separate commands, all three
    assert {e["job_id"] for e in feed} == set(jobs)


async def test_tenant_feed_is_best_effort(
    make_gateway: Any,  # noqa: F811 (cluster_support's)
    upstream: Upstream,
    valkey_cluster: ValkeyCluster,
) -> None:
    """The feed (fg:audit:<t>) lives in another slot than the job: written in its own command
    after the verdict. Its primary stopped (for less than the node timeout: no failover, no
    CLUSTERDOWN), the verdicts still hold."""
    gw: Gateway = await make_gateway(redis={"timeout_seconds": 0.3, "replicas_acked": 0})
    feed_node = valkey_cluster.owner(key_slot_of("fg:audit:default"))
    job = next(
        j for p, j in jobs_on_distinct_primaries(valkey_cluster).items() if p != feed_node.port
    )
    # connections open (a first exchange may pass 0.3 s on a loaded host, the registration
    # first; one that timed out may have registered, so a later one answers 200)
    for _ in range(20):
        if (await gw.register(job, generation=2)).status in (200, 201):
            break
    else:
        raise AssertionError("no registration answered within 0.3 s in 20 tries")
    for _ in range(20):
        if (await gw.effect(job, "warm", 2)).status == 200:
            break
    else:
        raise AssertionError("no warm-up call answered within 0.3 s in 20 tries")
    valkey_cluster.pause(feed_node)
    try:
        ok = await asyncio.wait_for(gw.effect(job, "s", 2), 15)
        stale = await asyncio.wait_for(gw.effect(job, "s", 1), 15)
    finally:
        valkey_cluster.resume(feed_node)
    assert ok.status == 200
    assert stale.status == 409, await stale.text()  # a true 409 stays a 409
    entries, _ = await gw.app[K.STORE].audit("default", job_id=job, limit=10, cursor=None)
    assert [e.reason for e in entries] == ["stale_generation"]  # the job's own stream has it
    assert len(upstream.received) == 2


async def test_replicas_acked_on_a_cluster_waits_per_primary(
    make_gateway: Any,  # noqa: F811 (cluster_support's)
    upstream: Upstream,
    valkey_cluster: ValkeyCluster,
) -> None:
    """With replicas_acked = 1 each primary's batches end with their own acknowledgement: the
    replica of one primary stopped, that shard's verdicts answer 503 (nothing dispatched), the
    other shards' keep coming; resumed, the shard serves again."""
    gw: Gateway = await make_gateway(redis={"replicas_acked": 1, "replica_ack_timeout_ms": 300})
    jobs = jobs_on_distinct_primaries(valkey_cluster)
    for job in jobs.values():
        assert (await gw.register(job, generation=1)).status == 201
        assert (await gw.effect(job, "before", 1)).status == 200
    port, held = next(iter(jobs.items()))
    (replica,) = valkey_cluster.replicas_of(valkey_cluster.node_by_port(port))
    valkey_cluster.pause(replica)
    try:
        refused = await gw.effect(held, "during", 1)
        others = [await gw.effect(j, "during", 1) for p, j in jobs.items() if p != port]
    finally:
        valkey_cluster.resume(replica)
    assert refused.status == 503 and (await refused.json())["code"] == "store_unavailable"
    assert [r.status for r in others] == [200, 200]
    assert "during" not in {r.headers["Idempotency-Key"].split(":")[1] for r in upstream.received
                            if r.headers["Idempotency-Key"].startswith(held)}  # fmt: skip
    router = router_of(gw)
    assert router.ack is not None and router.ack_failures is not None
    assert router.ack_failures[0] >= 1
    await asyncio.to_thread(valkey_cluster.wait_synced)
    for _ in range(50):  # the admit that ran unacknowledged is given up, then it goes out
        again = await gw.effect(held, "during", 1)
        if again.status == 200:
            break
        await asyncio.sleep(0.1)
    assert again.status == 200, await again.text()


def test_a_resent_script_carries_the_slot_counter_seen_by_then() -> None:
    """The prelude's SEEN (ARGV[#ARGV - 2]) of a script sent again after a redirection or a
    lost reply is the highest counter of its slot seen when it is re-sent, not when it was
    first sent: a new owner behind a reply given meanwhile answers {8, 'behind'}."""
    seen: dict[int, int] = {}
    router = ClusterRouter([("127.0.0.1", 1)], {}, max_connections=1, slot_seen=seen)
    # the trailer: request id, memory, seen, audit key, tenant feed ('' on a Cluster)
    command = ("EVALSHA", "sha", 2, "k1", "k2", "arg", "rid", "60000", "5", "", "")
    seen[7] = 9
    assert router.reseen(7, command) == (*command[:-3], "9", "", "")
    seen[7] = 3  # never lowered below what the command already carried
    assert router.reseen(7, command) == command
