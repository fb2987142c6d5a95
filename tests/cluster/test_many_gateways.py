"""Many gateways on one Valkey Cluster: two real `fencegate serve` processes (each its own data
dir, as on two hosts) behind which workers hop between attempts, a real loopback receiver
counting every delivery, `fencegate init` from the CLI, and a primary killed under traffic."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.store.keys import JobKeys
from tests.conftest import Upstream
from tests.support.processes import Serve
from tests.support.valkey_cluster import ValkeyCluster

pytestmark = pytest.mark.cluster

ASYNC = {"Prefer": "respond-async"}


def cluster_config(tmp: Path, name: str, url: str, hook: str, extra: str = "") -> Path:
    data = tmp / name
    data.mkdir(parents=True, exist_ok=True)
    cfg = data / "fencegate.toml"
    cfg.write_text(
        f"""
[redis]
url = "{url}"
cluster = true
data_dir = "{data / "data"}"
timeout_seconds = 2
replicas_acked = 1
replica_ack_timeout_ms = 500
[fencing]
relay_sweep_seconds = 2
[adapters.hook]
type = "webhook"
url = "{hook}"
timeout_seconds = 5
{extra}
"""
    )
    return cfg


class Gw:
    """One serve process, called over real HTTP."""

    def __init__(self, serve: Serve, session: aiohttp.ClientSession) -> None:
        self.serve, self.session = serve, session

    async def post(self, path: str, body: Any = None, **headers: str) -> tuple[int, Any]:
        async with self.session.post(self.serve.url(path), json=body, headers=headers) as r:
            return r.status, await r.json(content_type=None)

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.session.get(self.serve.url(path)) as r:
            return r.status, await r.json(content_type=None)

    async def register(self, job: str, generation: int | None = None) -> tuple[int, Any]:
        body = {} if generation is None else {"generation": generation}
        return await self.post(f"/v1/jobs/{job}/generations", body)

    async def effect(
        self, job: str, step: str, token: int, worker: str = "w", **headers: str
    ) -> tuple[int, Any]:
        body = {"adapter": "hook", "operation": "send", "payload": {"to": "a@example.com"}}
        hdr = {"Fencing-Token": str(token), "Worker-Id": worker, **headers}
        return await self.post(f"/v1/jobs/{job}/effects/{step}", body, **hdr)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


async def two_gateways(
    tmp: Path, url: str, upstream: Upstream, serves: list[Serve], session: Any, extra: str = ""
) -> tuple[Gw, Gw]:
    out = []
    for name in ("a", "b"):
        cfg = cluster_config(tmp, name, url, upstream.url, extra)
        serve = Serve(tmp / name, cfg)
        serves.append(serve)
        out.append(serve)
    for serve in out:
        await asyncio.to_thread(serve.wait_ready, 60)
    return Gw(out[0], session), Gw(out[1], session)


async def test_cli_init_then_the_seed_timeline_across_two_gateways(
    cluster_url: str, upstream: Upstream, serves: list[Serve], session: Any, tmp_path: Path
) -> None:
    """`fencegate init` on the empty cluster; gen 1's worker stalls (gateway A), the scheduler
    registers gen 2 at takeover (gateway B), gen 2's effect succeeds (B), gen 1's wakes and is
    refused 409 stale (A), audited with both generations; then the other outcome rows, each
    asked of the other gateway than the one that decided."""
    cfg = cluster_config(tmp_path, "init", cluster_url, upstream.url)
    init = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "gateway", "init", "--config", str(cfg)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert init.returncode == 0 and "initialised" in init.stdout, init.stdout + init.stderr
    a, b = await two_gateways(tmp_path, cluster_url, upstream, serves, session)

    assert (await a.register("seed", 1))[0] == 201
    assert (await b.register("seed", 2))[0] == 201  # takeover while gen 1 stalls
    status, ok = await b.effect("seed", "notify", 2, worker="w2")
    assert status == 200 and ok["state"] == "succeeded" and ok["generation"] == 2
    status, zombie = await a.effect("seed", "notify", 1, worker="w1")
    assert status == 409 and zombie["code"] == "stale_generation"
    assert (zombie["presented"], zombie["current"]) == (1, 2)
    assert [r.headers["Fencing-Token"] for r in upstream.received] == ["2"]
    for gw in (a, b):
        _, audit = await gw.get("/v1/audit/rejections?job_id=seed")
        [entry] = audit["items"]
        assert (entry["presented"], entry["current"], entry["worker_id"]) == (1, 2, "w1")

    # replay through the other gateway
    status, again = await a.effect("seed", "notify", 2)
    assert status == 200 and again["replayed"] is True
    # unregistered generation, regression, intent mismatch (422), cancel: decided in Redis
    status, body = await a.effect("seed", "other", 7)
    assert status == 409 and body["code"] == "unregistered_generation"
    status, body = await b.register("seed", 1)
    assert status == 409 and body["code"] == "generation_regression"
    body = {"adapter": "hook", "operation": "send", "payload": {"to": "b@example.com"}}
    status, mismatch = await a.post("/v1/jobs/seed/effects/notify", body, **{"Fencing-Token": "2"})
    assert status == 422 and mismatch["code"] == "intent_mismatch"
    assert (await b.post("/v1/jobs/seed/cancel"))[0] == 200
    status, body = await a.effect("seed", "late", 2)
    assert status == 409 and body["code"] == "job_cancelled"
    _, view = await a.get("/v1/jobs/seed")
    assert view["fence"] == 2 and view["cancelled"] is True
    assert len(upstream.received) == 1


async def test_two_generations_race_through_two_gateways(
    initialised_cluster_url: str, upstream: Upstream, serves: list[Serve], session: Any,
    tmp_path: Path,
) -> None:  # fmt: skip
    """Many tasks, jobs on every primary; for each job the scheduler registers gen 2 through
    one gateway while gen 1 and gen 2 workers call through both: no effect of gen 1 is
    dispatched once gen 2's registration was acknowledged before the call, every step goes
    out at most once, and the fence of every job ends at 2."""
    a, b = await two_gateways(tmp_path, initialised_cluster_url, upstream, serves, session)
    rng = random.Random(15)
    jobs = [f"race{i}" for i in range(12)]
    for job in jobs:
        assert (await rng.choice((a, b)).register(job, 1))[0] == 201
    acked: dict[str, float] = {}
    registered = {job: asyncio.Event() for job in jobs}
    invoked: dict[tuple[str, str], tuple[int, float]] = {}

    async def takeover(job: str) -> None:
        await asyncio.sleep(rng.random() * 0.2)
        status, _ = await rng.choice((a, b)).register(job, 2)
        assert status == 201
        acked[job] = time.monotonic()
        registered[job].set()

    async def worker(job: str, gen: int, n: int) -> None:
        if gen == 2:  # the new owner starts once the scheduler registered it
            await registered[job].wait()
        await asyncio.sleep(rng.random() * 0.3)
        step = f"g{gen}-{n % 3}"
        # the earliest call of this step: a dispatch may come from any of its calls
        invoked.setdefault((job, step), (gen, time.monotonic()))
        status, body = await rng.choice((a, b)).effect(job, step, gen)
        assert status in (200, 409), body
        if status == 409:
            assert body["code"] in ("stale_generation", "effect_in_progress"), body

    await asyncio.gather(
        *(takeover(j) for j in jobs),
        *(worker(j, g, n) for j in jobs for g in (1, 2) for n in range(6)),
    )
    sent = Counter()
    for rec in upstream.received:
        job, step = rec.headers["Idempotency-Key"].split(":")
        gen = int(rec.headers["Fencing-Token"])
        sent[(job, step)] += 1
        called_gen, called_at = invoked[(job, step)]
        assert called_gen == gen
        if gen == 1:
            assert not (job in acked and acked[job] < called_at), f"{job}: stale dispatch"
    assert set(sent.values()) <= {1}
    for job in jobs:
        _, view = await a.get(f"/v1/jobs/{job}")
        assert view["fence"] == 2


async def test_relays_on_two_gateways_never_send_a_step_twice(
    initialised_cluster_url: str, upstream: Upstream, serves: list[Serve], session: Any,
    tmp_path: Path,
) -> None:  # fmt: skip
    a, b = await two_gateways(tmp_path, initialised_cluster_url, upstream, serves, session)
    upstream.delay = 0.01
    jobs = [f"relay{i}" for i in range(60)]
    for job in jobs:
        assert (await a.register(job, 1))[0] == 201
    replies = await asyncio.gather(
        *((a if i % 2 else b).effect(job, "notify", 1, **ASYNC) for i, job in enumerate(jobs))
    )
    assert {status for status, _ in replies} == {202}
    deadline = time.monotonic() + 60
    while len({r.headers["Idempotency-Key"] for r in upstream.received}) < 60:
        assert time.monotonic() < deadline, f"{len(upstream.received)} delivered"
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)  # a double send would land now
    per_key = Counter(r.headers["Idempotency-Key"] for r in upstream.received)
    assert set(per_key.values()) == {1} and len(per_key) == 60
    for job in jobs[:5]:
        _, view = await b.get(f"/v1/jobs/{job}")
        assert view["effects"]["notify"]["state"] == "succeeded"


async def test_a_primary_killed_under_traffic_through_two_gateways(
    initialised_cluster_url: str, upstream: Upstream, serves: list[Serve], session: Any,
    tmp_path: Path, valkey_cluster: ValkeyCluster,
) -> None:  # fmt: skip
    """kill -9 of the primary of some jobs while zombies (gen 1) and owners (gen 2) call through
    both gateways (replicas_acked = 1): the shard answers 503 until its replica is promoted and
    has a replica again (the killed node, restarted: with R = 1 a primary without a replica
    acknowledges nothing), then writes resume (MOVED/reconnect handled, one EVAL per script on
    the new primary), no stale generation is ever dispatched, every fence is intact."""
    a, b = await two_gateways(tmp_path, initialised_cluster_url, upstream, serves, session)
    primaries = valkey_cluster.primaries()
    victim = primaries[0]
    on_victim = [
        j for j in (f"k{i}" for i in range(200))
        if valkey_cluster.owner(JobKeys("default", j).slot).port == victim.port
    ][:4]  # fmt: skip
    elsewhere = [
        j for j in (f"k{i}" for i in range(200))
        if valkey_cluster.owner(JobKeys("default", j).slot).port != victim.port
    ][:4]  # fmt: skip
    for job in on_victim + elsewhere:
        assert (await a.register(job, 1))[0] == 201
        assert (await b.register(job, 2))[0] == 201
    results: list[tuple[float, str, int, int]] = []  # (when, job, generation, status)
    stop = asyncio.Event()

    async def traffic(gw: Gw, job: str, gen: int) -> None:
        n = 0
        name = "a" if gw is a else "b"
        while not stop.is_set():
            try:
                status, body = await gw.effect(job, f"t{gen}{name}-{n}", gen)
            except aiohttp.ClientError:
                status = -1
            else:
                # 504 outcome_unknown: dispatched, then its primary died before the record
                expected = {200, 503, 504} if gen == 2 else {409, 503}
                assert status in expected, (gen, status, body)
                if status == 504:
                    assert body["code"] == "outcome_unknown", body
            results.append((time.monotonic(), job, gen, status))
            n += 1
            await asyncio.sleep(0.02)

    tasks = [
        asyncio.create_task(traffic(gw, job, gen))
        for job in on_victim + elsewhere
        for gw, gen in ((a, 2), (b, 1), (b, 2))
    ]
    try:
        await asyncio.sleep(1.0)
        (replica,) = valkey_cluster.replicas_of(victim)
        killed_at = time.monotonic()
        valkey_cluster.kill(victim)
        await asyncio.to_thread(valkey_cluster.wait_primary, replica, 20)
        promoted_at = time.monotonic()
        await asyncio.to_thread(valkey_cluster.restart, victim)  # rejoins as the replica
        deadline = time.monotonic() + 30
        while True:
            ok_after = [
                r for r in results if r[0] > promoted_at and r[1] in on_victim and r[3] == 200
            ]
            if len(ok_after) >= 8:
                break
            assert time.monotonic() < deadline, "writes on the failed-over shard did not resume"
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    shard = [r for r in results if r[0] > killed_at and r[1] in on_victim]
    resumed_after = ok_after[0][0] - killed_at  # the first write acknowledged after it
    others = [r for r in results if r[0] > killed_at and r[1] in elsewhere and r[2] == 2]
    print(
        f"failed-over shard: replica promoted {promoted_at - killed_at:.2f} s, writes resumed "
        f"{resumed_after:.2f} s after kill -9 (the old primary restarted as its replica); "
        f"{Counter(r[3] for r in shard)}; other shards: {Counter(r[3] for r in others)}"
    )
    assert resumed_after < 20, resumed_after
    assert any(r[3] == 200 for r in others)
    # no stale dispatch, ever; no step twice
    tokens = Counter(r.headers["Fencing-Token"] for r in upstream.received)
    assert set(tokens) == {"2"}, tokens
    per_key = Counter(r.headers["Idempotency-Key"] for r in upstream.received)
    assert set(per_key.values()) == {1}
    for job in on_victim:
        _, view = await a.get(f"/v1/jobs/{job}")
        assert view["fence"] == 2
