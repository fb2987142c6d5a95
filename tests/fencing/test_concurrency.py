"""Real concurrency: many tasks and many processes against one gateway and one Redis."""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

from tests.conftest import Gateway, Upstream
from tests.support import loadproc


async def test_fifty_simultaneous_calls_one_step_one_dispatch(
    gw: Gateway, upstream: Upstream
) -> None:
    await gw.register("r", generation=1)
    upstream.delay = 0.2  # keep the first dispatch in flight while the rest arrive
    responses = await asyncio.gather(*(gw.effect("r", "notify", 1) for _ in range(50)))
    outcomes = Counter()
    for resp in responses:
        body = await resp.json(content_type=None)
        outcomes[
            (resp.status, body.get("code") or ("replayed" if body["replayed"] else "sent"))
        ] += 1
    assert len(upstream.received) == 1
    assert outcomes[(200, "sent")] == 1
    assert set(outcomes) <= {(200, "sent"), (200, "replayed"), (409, "effect_in_progress")}
    assert sum(outcomes.values()) == 50


async def test_calls_from_many_processes_one_dispatch(gw: Gateway, upstream: Upstream) -> None:
    await gw.register("r", generation=1)
    upstream.delay = 0.3
    url = str(gw.client.make_url("/v1/jobs/r/effects/notify"))
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("spawn")) as pool:
        batches = await asyncio.gather(
            *(
                loop.run_in_executor(pool, loadproc.fire, url, 15, "1", {"to": "a"})
                for _ in range(4)
            )
        )
    outcomes = Counter(o for batch in batches for o in batch)
    assert sum(outcomes.values()) == 60
    assert outcomes[(200, "sent")] == 1
    assert set(outcomes) <= {(200, "sent"), (200, "replayed"), (409, "effect_in_progress")}
    assert len(upstream.received) == 1


async def test_racing_registrations_fence_only_rises_and_no_stale_dispatch(
    gw: Gateway, upstream: Upstream
) -> None:
    rng = random.Random(7)
    gens = list(range(1, 51))
    rng.shuffle(gens)
    acked: dict[int, float] = {}  # generation -> when its 201 arrived
    invoked: dict[str, tuple[int, float]] = {}  # step -> (generation, when the call started)
    fences: list[int] = []
    stop = asyncio.Event()

    async def register(g: int) -> None:
        await asyncio.sleep(rng.random() * 0.05)
        resp = await gw.register("r", generation=g)
        if resp.status == 201:
            acked[g] = time.monotonic()
            # the new owner acts at once (the owner of 50 is never superseded)
            await effect(f"own{g}", g)
        else:
            assert resp.status == 409 and (await resp.json())["code"] == "generation_regression"

    async def effect(step: str, g: int) -> None:
        invoked[step] = (g, time.monotonic())
        resp = await gw.effect("r", step, g)
        assert resp.status in (200, 409), await resp.text()

    async def watch() -> None:
        while not stop.is_set():
            resp = await gw.client.get("/v1/jobs/r")
            fences.append((await resp.json())["fence"] if resp.status == 200 else 0)
            await asyncio.sleep(0.002)

    watcher = asyncio.create_task(watch())

    async def zombie_or_not(i: int) -> None:
        await asyncio.sleep(rng.random() * 0.05)
        await effect(f"s{i}", rng.randint(1, 50))

    await asyncio.gather(*(register(g) for g in gens), *(zombie_or_not(i) for i in range(100)))
    stop.set()
    await watcher

    assert fences == sorted(fences), "the fence decreased"
    final = (await (await gw.client.get("/v1/jobs/r")).json())["fence"]
    assert final == 50
    # C1: no effect of generation g was dispatched if register(g' > g) was acknowledged
    # before the call was made.
    dispatched = [(r.path, int(r.headers["Fencing-Token"])) for r in upstream.received]
    steps_sent = Counter()
    for rec in upstream.received:
        g = int(rec.headers["Fencing-Token"])
        step = rec.headers["Idempotency-Key"].split(":")[1]
        steps_sent[step] += 1
        call_gen, call_at = invoked[step]
        assert call_gen == g
        newer_acked_before = [h for h, at in acked.items() if h > g and at < call_at]
        assert not newer_acked_before, (
            f"{step}: gen {g} dispatched after {newer_acked_before} registered"
        )
    assert all(n == 1 for n in steps_sent.values())
    assert ("/hook", 50) in dispatched, "the owner of the last generation must get through"
