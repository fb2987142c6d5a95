"""The ACL user documented in config/redis.conf is enough for the whole gateway flow."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import redis

from gateway.http import appkeys as K
from tests.conftest import Gateway, Upstream

ROOT = Path(__file__).parents[2]


def acl_rule() -> list[str]:
    line = next(
        line
        for line in (ROOT / "config" / "redis.conf").read_text().splitlines()
        if line.startswith("# user fencegate ")
    )
    return line[len("# user fencegate ") :].replace(">CHANGE-ME", ">acl-test-password").split()


async def test_documented_acl_user_runs_the_gateway(
    make_gateway: Any, upstream: Upstream, redis_url: str
) -> None:
    admin = redis.Redis.from_url(redis_url)
    admin.acl_setuser("fencegate", reset=True)
    admin.execute_command("ACL", "SETUSER", "fencegate", *acl_rule())
    try:
        limited = re.sub(r"^redis://", "redis://fencegate:acl-test-password@", redis_url)
        gw: Gateway = await make_gateway(
            redis={"url": limited}, audit={"anchor_interval_seconds": 0.05}
        )
        assert (await gw.client.get("/readyz")).status == 200  # init ran through the limited user
        assert (await gw.register("r", generation=2)).status == 201
        assert (await gw.effect("r", "s", 2)).status == 200
        assert (await gw.effect("r", "s", 2)).status == 200  # replay
        assert (await gw.effect("r", "s", 1)).status == 409  # stale, audited
        assert (await gw.heartbeat("r", 2)).status == 200
        # a checkpoint, written again (its charge settled on the tenant's quota counters)
        for value in ([1] * 100, [1]):
            put = await gw.client.put(
                "/v1/jobs/r/checkpoints/c", json=value, headers={"Fencing-Token": "2"}
            )
            assert put.status == 200, await put.text()
        assert (await gw.client.get("/v1/jobs/r/checkpoints/c")).status == 200
        assert (await gw.client.get("/v1/jobs/r")).status == 200
        assert len(await gw.audit()) == 1
        # the "needs a decision" side: an unknown step, the reconciler, listing, the overview
        upstream.behaviour = 500
        assert (await gw.effect("r", "u", 2)).status == 504
        upstream.behaviour = "ok"
        store = gw.app[K.STORE]
        assert (await store.reconcile_attention())["hinted"] == 1
        assert [i["step"] for i in await store.attention("default", limit=5)] == ["u"]
        await store.record_chain_check("default", {"at_ms": 1, "jobs": 1, "entries": 1})
        assert (await store.overview("default", now_ms=2**41))["open_unknowns"] == 1
        assert (await gw.client.post("/v1/jobs/r/cancel")).status == 200
        # and the user really is limited
        user = redis.Redis.from_url(limited)
        try:
            user.flushall()
            raise AssertionError("FLUSHALL must be refused")
        except redis.exceptions.NoPermissionError:
            pass
        try:
            user.set("not-fencegate", "x")
            raise AssertionError("keys outside fg:* must be refused")
        except redis.exceptions.NoPermissionError:
            pass
        user.close()
        assert len(upstream.received) == 2
        await gw.client.close()  # the shutdown anchors what the interval left
        anchors = (Path(gw.settings.redis.data_dir) / "audit-anchors.jsonl").read_text()
        assert '"job_id":"r"' in anchors  # the anchorer's reads (MULTI, XLEN) are allowed
    finally:
        admin.acl_deluser("fencegate")
        admin.close()
