"""Checkpoints and the fenced completion against a real Redis: the seed's acceptance
sequence (A updates zero rows, B commits), and everything a completed job refuses."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from gateway.store.keys import JobKeys
from tests.conftest import Gateway, Upstream
from tests.support.calls import code, complete, put_checkpoint, record_output

JOB = JobKeys("default", "r")


async def get_checkpoint(gw: Gateway, name: str, *, job: str = "r") -> Any:
    return await gw.client.get(f"/v1/jobs/{job}/checkpoints/{name}", headers=gw.headers)


async def job_view(gw: Gateway, job: str = "r") -> dict[str, Any]:
    resp = await gw.client.get(f"/v1/jobs/{job}", headers=gw.headers)
    assert resp.status == 200, await resp.text()
    return dict(await resp.json())


async def test_the_seed_acceptance_sequence_with_checkpoints_and_completion(
    gw: Gateway, upstream: Upstream, redis_sync: Any
) -> None:
    """A (gen 1) checkpoints and renders, stalls; B (gen 2) resumes from A's checkpoint,
    renders and completes; A's checkpoint and completion update zero rows (audited with both
    generations); B's completion is the job's, its output the promoted one."""
    assert (await gw.register("r", generation=1, lease_ms=60_000)).status == 201
    a = await put_checkpoint(gw, "progress", {"pages": 3, "big": 2**70}, 1, worker="A")
    assert a.status == 200, await a.text()
    assert (await a.json())["generation"] == 1
    record_output(redis_sync, 1, "report.pdf", b"A's draft")
    # A stalls; B takes over
    assert (await gw.register("r", generation=2, lease_ms=60_000)).status == 201
    resumed = await (await get_checkpoint(gw, "progress")).json()
    assert resumed["value"] == {"pages": 3, "big": 2**70} and resumed["generation"] == 1
    assert resumed["worker_id"] == "A"
    assert (await put_checkpoint(gw, "progress", {"pages": 7}, 2, worker="B")).status == 200
    rec_b = record_output(redis_sync, 2, "report.pdf", b"B's report")
    done = await complete(gw, 2, result={"pages": 7}, outputs=["report.pdf"], worker="B")
    assert done.status == 200, await done.text()
    body = await done.json()
    assert body["generation"] == 2 and body["replayed"] is False
    assert "Idempotent-Replayed" not in done.headers
    assert body["outputs"]["report.pdf"] == {
        "generation": 2,
        "key": "default/r/g2/report.pdf",
        "size": rec_b["size"],
        "sha256": rec_b["sha256"],
        "content_type": "application/pdf",
    }
    before = redis_sync.hget(JOB.job, "completed")
    ckpt_before = redis_sync.hgetall(JOB.ckpt)

    # A wakes up: its checkpoint and completion match zero rows
    assert await code(await put_checkpoint(gw, "progress", {"pages": 9}, 1, worker="A")) == (
        409,
        "stale_generation",
    )
    late = await complete(gw, 1, result={"pages": 3}, outputs=["report.pdf"], worker="A")
    assert await code(late) == (409, "stale_generation")
    problem = await late.json()
    assert (problem["presented"], problem["current"]) == (1, 2)
    assert redis_sync.hget(JOB.job, "completed") == before
    assert redis_sync.hgetall(JOB.ckpt) == ckpt_before
    audit = await gw.audit(job="r")
    assert [(e["step"], e["reason"], e["presented"], e["current"], e["worker_id"]) for e in audit][
        :2
    ] == [
        ("job:complete", "stale_generation", 1, 2, "A"),
        ("checkpoint:progress", "stale_generation", 1, 2, "A"),
    ]

    view = await job_view(gw)
    assert view["completion"]["generation"] == 2 and view["completion"]["result"] == {"pages": 7}
    assert view["completion"]["outputs"]["report.pdf"]["key"] == "default/r/g2/report.pdf"
    assert view["checkpoints"]["progress"]["generation"] == 2
    staged = {(o["generation"], o["name"]): o["promoted"] for o in view["outputs"]}
    assert staged == {(1, "report.pdf"): False, (2, "report.pdf"): True}


async def test_after_completion_nothing_new_is_taken_and_replays_still_replay(
    gw: Gateway, upstream: Upstream, redis_sync: Any
) -> None:
    await gw.register("r", generation=4)
    assert (await gw.effect("r", "notify", 4)).status == 200
    done = await complete(gw, 4, result={"ok": True})
    assert done.status == 200
    # the same completion again (a lost answer): replayed, nothing changes
    again = await complete(gw, 4, result={"ok": True})
    assert again.status == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert (await again.json())["replayed"] is True
    assert (await again.json())["completed_at"] == (await done.json())["completed_at"]
    # another body after completion
    assert await code(await complete(gw, 4, result={"ok": False})) == (409, "job_completed")
    # a recorded effect still replays; a new step is refused
    replay = await gw.effect("r", "notify", 4)
    assert replay.status == 200 and (await replay.json())["replayed"] is True
    assert await code(await gw.effect("r", "other", 4)) == (409, "job_completed")
    async_new = await gw.effect("r", "later", 4, headers={"Prefer": "respond-async"})
    assert await code(async_new) == (409, "job_completed")
    assert await code(await put_checkpoint(gw, "c", 1, 4)) == (409, "job_completed")
    assert await code(await gw.heartbeat("r", 4)) == (409, "job_completed")
    # registrations from any generation, the current one too
    assert await code(await gw.register("r", generation=5)) == (409, "job_completed")
    assert await code(await gw.register("r", generation=4)) == (409, "job_completed")
    assert await code(await gw.register("r")) == (409, "job_completed")
    # a zombie stays a zombie; a completed job is not cancelled
    assert await code(await gw.effect("r", "other", 3)) == (409, "stale_generation")
    cancel = await gw.client.post("/v1/jobs/r/cancel")
    assert await code(cancel) == (409, "job_completed")
    assert len(upstream.received) == 1
    assert redis_sync.exists(JOB.effect("other"), JOB.effect("later"), JOB.ckpt) == 0
    assert redis_sync.hget(JOB.job, "fence") == "4"
    assert redis_sync.hget(JOB.job, "cancelled") is None
    reasons = [e["reason"] for e in await gw.audit(job="r")]
    assert reasons.count("job_completed") == 8


async def test_implicit_mode_raises_no_fence_after_completion(
    make_gateway: Any, redis_sync: Any
) -> None:
    gw: Gateway = await make_gateway(fencing={"registration": "implicit"})
    assert (await complete(gw, 3, result=1)).status == 200  # raises the fence to 3 and completes
    assert redis_sync.hget(JOB.job, "fence") == "3"
    for resp in (
        await gw.effect("r", "s", 9),
        await put_checkpoint(gw, "c", 1, 9),
        await gw.heartbeat("r", 9),
        await complete(gw, 9, result=1),
    ):
        assert await code(resp) == (409, "job_completed")
    assert redis_sync.hget(JOB.job, "fence") == "3"
    assert await code(await complete(gw, 2, result=1)) == (409, "stale_generation")


async def test_completion_checks_outputs_recorded_by_this_generation(
    gw: Gateway, redis_sync: Any
) -> None:
    await gw.register("r", generation=1)
    record_output(redis_sync, 1, "a.pdf", b"one")
    await gw.register("r", generation=2)
    record_output(redis_sync, 2, "b.csv", b"staged only", state="staged")
    record_output(redis_sync, 2, "c.txt", b"fine")
    resp = await complete(gw, 2, outputs=["c.txt", "a.pdf", "b.csv", "d.bin"], result=None)
    assert await code(resp) == (422, "output_not_staged")
    assert (await resp.json())["missing"] == ["a.pdf", "b.csv", "d.bin"]  # a.pdf is gen 1's
    assert redis_sync.hexists(JOB.job, "completed") is False
    ok = await complete(gw, 2, outputs=["c.txt"], result=None)
    assert ok.status == 200 and list((await ok.json())["outputs"]) == ["c.txt"]


async def test_a_zombie_that_recorded_before_the_takeover_cannot_complete(
    gw: Gateway, redis_sync: Any
) -> None:
    """A recorded its output while it was current; B took over and has not completed yet:
    A's completion is refused all the same, and B still completes with its own output."""
    await gw.register("r", generation=1)
    record_output(redis_sync, 1, "out", b"A")
    await gw.register("r", generation=2)
    assert await code(await complete(gw, 1, outputs=["out"])) == (409, "stale_generation")
    assert redis_sync.hexists(JOB.job, "completed") is False
    assert await code(await complete(gw, 2, outputs=["out"])) == (422, "output_not_staged")
    record_output(redis_sync, 2, "out", b"B")
    done = await complete(gw, 2, outputs=["out"])
    assert (await done.json())["outputs"]["out"]["key"] == "default/r/g2/out"


async def test_lease_and_cancel_rules_as_for_effects(gw: Gateway, redis_sync: Any) -> None:
    await gw.register("r", generation=1, lease_ms=1000)
    assert (await put_checkpoint(gw, "c", [1], 1)).status == 200
    await asyncio.sleep(1.1)
    assert await code(await put_checkpoint(gw, "c", [2], 1)) == (409, "lease_expired")
    assert await code(await complete(gw, 1)) == (409, "lease_expired")
    assert await code(await put_checkpoint(gw, "c", [2], 2)) == (409, "unregistered_generation")
    await gw.register("r", generation=2)
    await gw.client.post("/v1/jobs/r/cancel")
    assert await code(await put_checkpoint(gw, "c", [3], 2)) == (409, "job_cancelled")
    assert await code(await complete(gw, 2)) == (409, "job_cancelled")
    assert json.loads(redis_sync.hget(JOB.ckpt, "c"))["value"] == [1]
    assert redis_sync.hexists(JOB.job, "completed") is False


async def test_checkpoints_read_by_roles_and_listed(make_gateway: Any) -> None:
    from tests.conftest import key_digest

    keys = [
        {"role": r, "sha256": key_digest(f"{r}-key")} for r in ("worker", "scheduler", "auditor")
    ]
    gw: Gateway = await make_gateway(auth={"keys": keys})

    def as_(role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {role}-key"}

    gw.headers = as_("scheduler")
    await gw.register("r", generation=1)
    gw.headers = as_("worker")
    assert (await put_checkpoint(gw, "step-1", {"n": 1}, 1)).status == 200
    assert (await put_checkpoint(gw, "step-2", None, 1)).status == 200
    for role in ("worker", "scheduler", "auditor"):
        gw.headers = as_(role)
        got = await get_checkpoint(gw, "step-2")
        assert got.status == 200 and (await got.json())["value"] is None
        assert await code(await get_checkpoint(gw, "nope")) == (404, "not_found")
        listed = await gw.client.get("/v1/jobs/r/checkpoints", headers=gw.headers)
        assert sorted((await listed.json())["checkpoints"]) == ["step-1", "step-2"]
    for role in ("scheduler", "auditor"):
        gw.headers = as_(role)
        assert await code(await put_checkpoint(gw, "x", 1, 1)) == (403, "forbidden")
        assert await code(await complete(gw, 1)) == (403, "forbidden")


async def _race(gw: Gateway, offset: int, register_2_during: bool) -> list[Any]:
    """15 completions, generations 1 and 2 alternating (and maybe the registration of 2)."""
    calls: list[Any] = []
    for i in range(15):
        gen = 1 + (i + offset) % 2
        calls.append(complete(gw, gen, result={"by": gen}))
        if register_2_during and i == 5:
            calls.append(gw.register("r", generation=2))
    return list(await asyncio.gather(*calls))


async def test_thirty_racing_completions_from_two_generations_complete_once(
    make_gateway: Any, redis_sync: Any
) -> None:
    """Two gateways on one Redis, 30 completions at once from generations 1 and 2.

    Both registered first: generation 2 completes, exactly once (the rest of its calls
    replay), every generation-1 call is stale. Generation 2 registered in the middle of the
    race: still exactly one completion, by one generation, and every other answer agrees."""
    gws: list[Gateway] = [await make_gateway(), await make_gateway()]
    for order in ("registered first", "registered during"):
        redis_sync.delete(JOB.job, JOB.audit)
        await gws[0].register("r", generation=1)
        if order == "registered first":
            await gws[0].register("r", generation=2)
        answers = await asyncio.gather(
            _race(gws[0], 0, order == "registered during"), _race(gws[1], 1, False)
        )
        firsts, replays, refusals = [], [], []
        for resp in (r for batch in answers for r in batch):
            if "/generations" in str(resp.url):
                continue
            body = await resp.json()
            if resp.status == 200:
                (replays if body["replayed"] else firsts).append(body["generation"])
            else:
                refusals.append((resp.status, body["code"]))
        assert len(firsts) + len(replays) + len(refusals) == 30
        assert len(firsts) == 1, (order, firsts)
        winner = firsts[0]
        stored = json.loads(redis_sync.hget(JOB.job, "completed"))
        assert stored["generation"] == winner and stored["result"] == {"by": winner}
        assert set(replays) <= {winner}  # every success is the winner's own completion
        if order == "registered first":
            assert winner == 2 and len(replays) == 14
            assert refusals == [(409, "stale_generation")] * 15
        else:
            allowed = {"stale_generation", "unregistered_generation", "job_completed"}
            assert {c for _, c in refusals} <= allowed and {s for s, _ in refusals} <= {409}


async def test_implicit_mode_a_checkpoint_raises_the_fence_like_an_effect(
    make_gateway: Any, redis_sync: Any
) -> None:
    gw: Gateway = await make_gateway(fencing={"registration": "implicit"})
    assert (await put_checkpoint(gw, "c", {"n": 1}, 5)).status == 200
    assert redis_sync.hmget(JOB.job, "fence", "lease_exp") == ["5", "0"]
    resp = await put_checkpoint(gw, "c", {"n": 0}, 4, worker="old")
    assert await code(resp) == (409, "stale_generation")
    assert json.loads(redis_sync.hget(JOB.ckpt, "c"))["value"] == {"n": 1}
    assert (await put_checkpoint(gw, "c", {"n": 2}, 6)).status == 200
    assert redis_sync.hget(JOB.job, "fence") == "6"
    entry = (await gw.audit(job="r"))[0]
    assert (entry["step"], entry["presented"], entry["current"], entry["worker_id"]) == (
        "checkpoint:c",
        4,
        5,
        "old",
    )
