"""The deployment survives a full disk and a full memory: the outputs' free-space floor, the
embedded Redis's memory bound, and its supervisor.

Real components only: the file store on this machine's real volume (the floor is set
relative to the free space measured now, so the test writes tens of MiB, not a disk's worth),
`fencegate serve` with its embedded redis-server (killed with SIGKILL, filled to its bound).
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from gateway.objects.space import CHECK_EVERY
from tests.support.outputs import JOB, register
from tests.support.processes import Serve, write_config

MiB = 1024 * 1024


def free_mib(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize // MiB


@pytest.fixture
async def floored(make_gateway: Any, tmp_path: Path) -> Any:
    """A gateway whose file store keeps all but 20 MiB of the volume's free space free."""
    root = tmp_path / "objects"
    root.mkdir()
    gw = await make_gateway(
        outputs={
            "store": "file",
            "path": str(root),
            "sweep_interval_seconds": 0,
            "max_bytes": 64 * MiB,
            "min_free_mb": free_mib(root) - 20,
        }
    )
    gw.root = root
    return gw


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file() and "#" in p.name)


async def test_uploads_stop_at_the_free_space_floor_with_507_and_leave_nothing(
    floored: Any,
) -> None:
    """One worker uploads 8 MiB outputs under new names: it is refused once the next bytes
    would go below the floor — within 20 MiB of the reading, while it streams — and the other
    calls keep being served."""
    assert MiB >= CHECK_EVERY  # checked at least every MiB: the 20 MiB margin counts on it
    gen = await register(floored)
    chunk = b"x" * MiB

    async def body() -> Any:  # chunked: the floor is checked while it streams
        for _ in range(8):
            yield chunk

    statuses = []
    for i in range(6):  # 48 MiB at most: more than the 20 MiB of room
        resp = await floored.client.put(
            f"/v1/jobs/{JOB}/outputs/part-{i}",
            data=body(),
            headers={"Fencing-Token": str(gen), "Content-Type": "application/octet-stream"},
        )
        statuses.append(resp.status)
        if resp.status == 507:
            problem = await resp.json()
            assert problem["code"] == "insufficient_storage"
            assert resp.headers["Content-Type"].startswith("application/problem+json")
            break
    assert statuses[-1] == 507, statuses
    assert set(statuses[:-1]) <= {201}
    assert len(statuses) <= 4, "more than the room was written before the refusal"
    refused = f"part-{len(statuses) - 1}"
    assert leftovers(floored.root) == [], "a refused upload left its partial file"
    assert (await floored.client.get(f"/v1/jobs/{JOB}/outputs/{refused}")).status == 404
    # the floor holds for the uploads only: registrations and effects are still served
    assert (await floored.register("other-job", generation=1)).status == 201
    ready = await floored.client.get("/readyz")  # the uploads' floor is not Redis's
    assert ready.status == 200, await ready.text()


async def test_an_upload_whose_length_exceeds_the_room_is_refused_before_a_byte(
    floored: Any,
) -> None:
    gen = await register(floored)
    resp = await floored.client.put(
        f"/v1/jobs/{JOB}/outputs/big",
        data=io.BytesIO(b"y" * (60 * MiB)),  # Content-Length: 60 MiB, three times the room
        headers={"Fencing-Token": str(gen), "Content-Type": "application/octet-stream"},
    )
    assert resp.status == 507
    assert leftovers(floored.root) == [] and not any(floored.root.rglob("big*"))
    assert (await floored.client.get(f"/v1/jobs/{JOB}/outputs/big")).status == 404


def test_the_embedded_redis_is_restarted_after_it_dies_and_keeps_its_data(
    tmp_path: Path,
) -> None:
    """kill -9 of the embedded redis-server (as the kernel's OOM killer or an AOF write error
    would end it): calls fail closed meanwhile, the supervisor starts it again from its AOF,
    and every call is served again within seconds, the fence intact."""
    s = Serve(tmp_path, write_config(tmp_path))
    try:
        s.wait_ready()
        assert s.call("POST", "/v1/jobs/r/generations", {"generation": 4})[0] == 201
        first = s.redis_pid()
        os.kill(first, signal.SIGKILL)
        killed = time.monotonic()
        statuses: set[int] = set()
        while True:
            status, _ = s.call("POST", "/v1/jobs/r2/generations", {"generation": 1})
            statuses.add(status)
            if status == 201:
                break
            assert status == 503, status  # fails closed, never a 500
            assert time.monotonic() - killed < 15, s.output()
            time.sleep(0.05)
        recovered = time.monotonic() - killed
        assert s.call("GET", "/v1/jobs/r")[1]["fence"] == 4  # replayed from the AOF
        assert s.call("GET", "/readyz")[0] == 200
        lines = [json.loads(x) for x in s.output().splitlines() if x.startswith("{")]
        events = [e["event"] for e in lines]
        assert "embedded_redis_exited" in events and "embedded_redis_restarted" in events
        assert recovered < 10
    finally:
        s.stop()
        s.log.close()


def test_the_embedded_redis_refuses_writes_at_its_memory_bound_and_stays_up(
    tmp_path: Path,
) -> None:
    """`redis.embedded_maxmemory_mb` with noeviction: a worker storing checkpoints until Redis
    is full gets 503 (nothing stored, nothing evicted), Redis is not killed, /readyz names
    the cause (`memory`), and reads still answer."""
    s = Serve(tmp_path, _with_redis(tmp_path, "embedded_maxmemory_mb = 4"))
    try:
        s.wait_ready()
        pid = s.redis_pid()
        assert s.call("POST", "/v1/jobs/r/generations", {"generation": 1})[0] == 201
        value = {"blob": "z" * 60_000}
        refused = None
        for i in range(400):  # 24 MB at most, six times the bound
            status, body = s.call(
                "PUT", f"/v1/jobs/r/checkpoints/c{i}", value, {"Fencing-Token": "1"}
            )
            if status != 200 and status != 201:
                refused = (status, body)
                break
        assert refused is not None, "the memory bound never refused a write"
        assert refused[0] == 503 and "out of memory" in refused[1]["detail"]
        assert s.call("GET", "/v1/jobs/r")[1]["fence"] == 1  # reads still answer
        ready = s.call("GET", "/readyz")
        # the probe write refused (out of memory) or memory above 95 % of the bound
        assert ready[0] == 503, ready
        assert ready[1]["cause"] in ("out_of_memory", "memory_nearly_full"), ready
        assert _alive(pid), "the bound must refuse writes, not end Redis"
    finally:
        s.stop()
        s.log.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _with_redis(tmp: Path, line: str) -> Path:
    cfg = write_config(tmp)
    text = cfg.read_text().replace("[redis]\n", f"[redis]\n{line}\n", 1)
    cfg.write_text(text)
    return cfg
