"""Lost writes fail closed: a restored backup, a wiped Redis, several workers sharing the state.

Real components only: a durable redis-server of its own per test (``appendonly yes``,
``appendfsync always``; Redis 6.2 keeps one ``appendonly.aof`` in its dir, which is what a
file-level backup copies), the gateway in process or as ``fencegate serve`` processes, a
loopback receiver that counts what it is sent.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.http import appkeys as K
from gateway.http.app import create_app
from gateway.store import durability, statefile
from gateway.store.keys import EPOCH, MARKER, JobKeys, slot_marker
from gateway.store.store import connect
from tests.conftest import Gateway, Upstream, gateway_settings
from tests.support.calls import lasting_keys
from tests.support.processes import DurableRedis, Serve, children_of, init, wait_dead


@pytest.fixture
async def durable_gateways(
    durable: DurableRedis, upstream: Upstream, tmp_path: Path
) -> AsyncIterator[Any]:
    """In-process gateways on the test's own Redis; ``data`` names the data dir."""
    clients: list[TestClient[Any, Any]] = []

    async def start(data: str = "state", **redis_section: Any) -> Gateway:
        settings = gateway_settings(
            durable.url,
            upstream.url,
            tmp_path / data,
            redis={"timeout_seconds": 1, **redis_section},
        )
        app = create_app(settings, redis_url=durable.url, state_file=state_file(tmp_path, data))
        client = TestClient(TestServer(app, host="127.0.0.1", port=0))
        await client.start_server()
        clients.append(client)
        return Gateway(client=client, app=app, settings=settings)

    yield start
    for c in clients:
        await c.close()


def state_file(tmp_path: Path, data: str = "state") -> Path:
    return tmp_path / data / "state" / "fencegate.state"


async def code(resp: Any) -> tuple[int, str]:
    body = await resp.json(content_type=None)
    return resp.status, body.get("code", "")


async def readiness(gw: Gateway) -> tuple[int, str | None, str | None]:
    """/readyz's status, cause and (for a missing marker) what the data says happened."""
    resp = await gw.client.get("/readyz")
    body = await resp.json()
    return resp.status, body["cause"], body["marker"]


async def register2_after_backup(gw: Gateway, durable: DurableRedis, tmp_path: Path) -> Path:
    """register(1), the backup, then register(2) (acknowledged), gen 2's effect and more
    writes: the backup is from before register(2)."""
    assert (await gw.register("r", generation=1, lease_ms=600_000)).status == 201
    backup = durable.backup(tmp_path / "before-register-2.aof")
    assert (await gw.register("r", generation=2, lease_ms=600_000)).status == 201
    assert (await gw.effect("r", "a", 2)).status == 200
    assert (await gw.heartbeat("r", 2)).status == 200
    return backup


async def test_restored_backup_refused_while_the_gateway_runs(
    durable_gateways: Any, durable: DurableRedis, upstream: Upstream, tmp_path: Path
) -> None:
    """The gateway keeps running across the restore: its in-memory marks refuse the restored
    slot on the next call, and its periodic check quarantines the whole Redis."""
    gw: Gateway = await durable_gateways()
    backup = await register2_after_backup(gw, durable, tmp_path)
    durable.restore(backup)
    c = durable.client()
    assert c.hget(JobKeys("default", "r").job, "fence") == "1"  # the restore really went back
    for _ in range(50):  # the gateway's connections to the restarted Redis are back
        if (await gw.register("other", generation=1)).status == 201:
            break
    else:
        raise AssertionError("the gateway did not reconnect")
    # the epoch the old check compares: the backup is from after the last bump, so it passes
    assert int(c.get(EPOCH)) == statefile.read(state_file(tmp_path)).epoch
    # the zombie of generation 1, on the step generation 2 completed: not delivered
    assert await code(await gw.effect("r", "a", 1)) == (503, "store_unavailable")
    assert await code(await gw.effect("r", "b", 1)) == (503, "store_unavailable")
    assert await code(await gw.heartbeat("r", 1)) == (503, "store_unavailable")
    assert [r.headers["Fencing-Token"] for r in upstream.received] == ["2"]
    # the periodic check (redis.epoch_interval_seconds) finds it without a call: quarantined
    assert await gw.app[K.STORE].heartbeat_epoch() is False
    assert c.get(MARKER) is None
    ready = await gw.client.get("/readyz")
    body = await ready.json()
    assert ready.status == 503 and body["checks"]["marker"] is False
    assert (body["cause"], body["marker"]) == ("marker_missing", "quarantined")
    c.close()


async def test_restored_backup_refused_by_a_restarted_gateway(
    durable_gateways: Any, durable: DurableRedis, upstream: Upstream, tmp_path: Path
) -> None:
    """The backup was taken after the last epoch bump, and the gateway
    restarts on the restored Redis. Its persisted slot marks refuse it at start."""
    gw: Gateway = await durable_gateways()
    backup = await register2_after_backup(gw, durable, tmp_path)
    await gw.client.close()  # a clean stop writes the marks of the last writes
    durable.restore(backup)
    c = durable.client()
    restored_counter = int(c.get(JobKeys("default", "r").marker))
    # the old check alone would pass this Redis: its epoch is the one the gateway last saw
    assert int(c.get(EPOCH)) == statefile.read(state_file(tmp_path)).epoch
    again: Gateway = await durable_gateways()  # the same data dir
    assert await code(await again.effect("r", "a", 1)) == (503, "store_unavailable")
    assert await code(await again.register("r", generation=3)) == (503, "store_unavailable")
    assert (await again.client.get("/readyz")).status == 503
    assert c.get(MARKER) is None, "quarantined at start"
    assert [r.headers["Fencing-Token"] for r in upstream.received] == ["2"]
    # what caught it: the mark the first gateway persisted for the job's slot
    assert statefile.read(state_file(tmp_path)).slots[JobKeys("default", "r").slot] > (
        restored_counter
    )
    # until an operator confirms the loss: then the scheduler re-registers and work resumes
    assert await again.app[K.STORE].initialize(auto=False, confirm_data_loss=True) == "written"
    assert (await again.register("r", generation=3)).status == 201
    assert (await again.effect("r", "c", 3)).status == 200
    c.close()


async def test_a_wiped_redis_is_not_initialised_by_a_gateway_with_a_fresh_data_dir(
    durable_gateways: Any, durable: DurableRedis, upstream: Upstream, tmp_path: Path
) -> None:
    """An external Redis is initialised by `fencegate init`, never by a starting gateway: a
    new gateway with a fresh data dir meeting a wiped Redis does not send a completed step
    again."""
    first: Gateway = await durable_gateways("first", auto_init=False)
    refused = await first.register("r", generation=1)
    assert await code(refused) == (503, "store_unavailable")
    assert "fencegate init" in (await refused.json())["detail"]
    assert await readiness(first) == (503, "marker_missing", "uninitialised")
    c = durable.client()
    assert lasting_keys(c) == [], "nothing written to a Redis nobody initialised"
    assert await first.app[K.STORE].initialize(auto=False) == "written"  # `fencegate init`
    assert (await first.register("r", generation=1)).status == 201
    assert (await first.effect("r", "notify", 1)).status == 200
    c.flushall()  # the Redis is wiped (or replaced by an empty one)
    assert await readiness(first) == (503, "marker_missing", "wiped")  # its data dir knows
    fresh: Gateway = await durable_gateways(
        "fresh", auto_init=False
    )  # the default outside the tests
    assert await readiness(fresh) == (503, "marker_missing", "uninitialised")
    reg = await fresh.register("r", generation=1)
    assert await code(reg) == (503, "store_unavailable")
    assert "fencegate init" in (await reg.json())["detail"]
    assert await code(await fresh.effect("r", "notify", 1)) == (503, "store_unavailable")
    assert lasting_keys(c) == []
    assert len(upstream.received) == 1, "the completed step was sent again"
    c.close()


async def test_a_slot_read_below_its_mark_is_read_again_before_a_quarantine(
    durable: DurableRedis,
) -> None:
    """A marker read below its mark (a read that raced the write raising the mark) is read
    again before Redis is quarantined: at or above its mark then, it is no loss. Still below,
    Redis is quarantined."""
    c = durable.client()
    client = connect(durable.url, timeout=2, max_connections=2)
    assert await durability.initialize(client, None, auto=True) == "written"
    slot = JobKeys("default", "r").slot
    now = int(c.get(slot_marker(slot)))
    try:
        raced = {slot: str(now - 5)}  # what a first read saw before the write
        assert await durability.compare_marks(client, {slot: now}, raced) is True
        assert c.get(MARKER) is not None and c.get(slot_marker(slot)) == str(now)
        assert await durability.compare_marks(client, {slot: now + 1}, raced) is False
        assert c.get(MARKER) is None and c.get(slot_marker(slot)) is None  # quarantined
    finally:
        await client.aclose()
        c.close()


async def test_a_confirmed_init_is_not_quarantined_by_a_gateway_with_another_data_dir(
    durable_gateways: Any, durable: DurableRedis
) -> None:
    """`fencegate init --confirm-data-loss` resets the state file of the data dir it runs
    with; a gateway of another data dir (another host) recorded a higher epoch before the loss
    and must not take the new baseline for a restored snapshot (no quarantine, it serves)."""
    a: Gateway = await durable_gateways("a")
    b: Gateway = await durable_gateways("b")
    for gw in (a, b, a, b):  # both record epochs (their periodic checks)
        assert await gw.app[K.STORE].heartbeat_epoch() is True
    assert (await b.register("r", generation=3)).status == 201
    c = durable.client()
    c.flushall()  # the data is lost; the operator looks, then confirms from a's data dir
    assert await a.app[K.STORE].initialize(auto=False, confirm_data_loss=True) == "written"
    assert await b.app[K.STORE].heartbeat_epoch() is True
    assert c.get(MARKER) is not None
    assert (await b.register("r", generation=1)).status == 201  # re-registered after the loss
    assert (await a.register("r", generation=2)).status == 201
    c.close()


def _update_many(path: str, worker: int, rounds: int) -> None:
    for i in range(1, rounds + 1):
        statefile.update(Path(path), epoch=i, slots={worker * 1000 + s: i for s in range(50)})


def test_state_file_is_safe_with_several_processes(tmp_path: Path) -> None:
    """Four processes merging into one state file at once (as `serve --workers 4` does): no
    write fails, nothing is lost, every mark and the epoch keep their maximum."""
    path = tmp_path / "fencegate.state"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_update_many, args=(str(path), w, 60)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    state = statefile.read(path)
    assert state.epoch == 60 and state.initialised is False
    assert state.slots == {w * 1000 + s: 60 for w in range(4) for s in range(50)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fencegate.state", "fencegate.state.lock"]
    # a lower mark never lowers the file; init's reset is the only way down
    statefile.update(path, slots={0: 1}, epoch=1)
    assert statefile.read(path).slots[0] == 60 and statefile.read(path).epoch == 60
    statefile.update(path, epoch=3, initialised=True, reset=True)
    assert statefile.read(path) == statefile.State(initialised=True, epoch=3)


def test_restored_backup_refused_after_serve_workers_were_killed(tmp_path: Path) -> None:
    """`fencegate serve --workers 2` on an external Redis: the workers write their marks every
    `redis.marks_interval_seconds` into one state file; SIGKILLed (no shutdown write), the
    marks already written are enough to refuse the restored backup at the next start."""
    durable = DurableRedis(tmp_path / "redis")
    data = tmp_path / "data"
    cfg = tmp_path / "fencegate.toml"
    cfg.write_text(
        f'[redis]\nurl = "{durable.url}"\ndata_dir = "{data}"\nmarks_interval_seconds = 0.1\n'
        f'[adapters.hook]\ntype = "webhook"\nurl = "http://127.0.0.1:1/hook"\n'
    )
    served: list[Serve] = []
    try:
        assert init(cfg, tmp_path).returncode == 0
        s = Serve(tmp_path, cfg, "--workers", "2")
        served.append(s)
        s.wait_ready()
        jobs = [f"j{i}" for i in range(12)]
        for job in jobs:
            assert s.call("POST", f"/v1/jobs/{job}/generations", {"generation": 1})[0] == 201
        backup = durable.backup(tmp_path / "backup.aof")
        for job in jobs:
            assert s.call("POST", f"/v1/jobs/{job}/generations", {"generation": 2})[0] == 201
        c = durable.client()
        counters = {
            JobKeys("default", j).slot: int(c.get(JobKeys("default", j).marker)) for j in jobs
        }
        c.close()
        slots = set(counters)
        deadline = time.monotonic() + 10
        while True:  # the periodic write of both workers has caught up with every slot
            marks = statefile.read(data / "fencegate.state").slots
            if all(marks.get(slot, 0) >= n for slot, n in counters.items()):
                break
            assert time.monotonic() < deadline, f"the marks never reached the state file: {marks}"
            time.sleep(0.05)
        workers = children_of(s.proc.pid)
        for pid in workers:  # no shutdown write: the periodic one must have been enough
            os.kill(pid, signal.SIGKILL)
        s.stop(signal.SIGKILL)
        assert all(wait_dead(p) for p in workers)
        durable.restore(backup)
        s2 = Serve(tmp_path, cfg)
        served.append(s2)
        deadline = time.monotonic() + 20
        while True:
            assert s2.proc.poll() is None and time.monotonic() < deadline, s2.output()
            try:
                if s2.call("GET", "/healthz")[0] == 200:
                    break
            except OSError:
                time.sleep(0.05)
        headers = {"Fencing-Token": "1", "Content-Type": "application/json"}
        body = {"adapter": "hook", "operation": "x", "payload": {}}
        for job in jobs:
            status, problem = s2.call("POST", f"/v1/jobs/{job}/effects/s", body, headers)
            assert (status, problem["code"]) == (503, "store_unavailable"), job
        assert s2.call("GET", "/readyz")[0] == 503
        went_back = next(
            json.loads(line) for line in s2.output().splitlines() if "redis_slots_went_back" in line
        )
        assert went_back["slots_behind"] == len(slots)
    finally:
        for s in served:
            if s.proc.poll() is None:
                s.proc.kill()
                s.proc.wait()
            s.log.close()
        durable.stop()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


async def test_a_redis_made_volatile_while_serving_is_noticed_by_the_periodic_check(
    durable_gateways: Any, durable: DurableRedis
) -> None:
    """`CONFIG SET appendfsync everysec` after the start: the next periodic check logs
    `redis_not_durable` and `/readyz` turns 503 (`durable`); set back, it is ready again."""
    gw: Gateway = await durable_gateways(epoch_interval_seconds=0.1)
    c = durable.client()
    assert (await gw.client.get("/readyz")).status == 200
    c.config_set("appendfsync", "everysec")
    try:
        for _ in range(100):
            ready = await gw.client.get("/readyz")
            if ready.status == 503:
                break
            await asyncio.sleep(0.05)
        body = await ready.json()
        assert ready.status == 503 and body["checks"]["durable"] is False, body
        assert (await gw.register("r", generation=1)).status == 201  # verdicts go on
    finally:
        c.config_set("appendfsync", "always")
    for _ in range(100):
        if (await gw.client.get("/readyz")).status == 200:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("not ready again after appendfsync always")
    c.close()
