"""Checkpoints inside the tenant's quotas: the stored checkpoint bytes
per tenant (``quotas.checkpoint_bytes``, 429 quota_exceeded, audited) and the names per job
(``checkpoints.max_per_job``, 413 too_many_checkpoints). Real Redis, two tenants with their
own worker and admin keys, over HTTP."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.conftest import Gateway, key_digest

KEYS = {
    ("acme", "worker"): "acme-worker-key",
    ("acme", "admin"): "acme-admin-key",
    ("globex", "worker"): "globex-worker-key",
    ("globex", "admin"): "globex-admin-key",
}
AUTH = {
    "keys": [
        {"role": role, "sha256": key_digest(key), "tenant": tenant}
        for (tenant, role), key in KEYS.items()
    ]
}
BLOB = "x" * 60_000  # a 60 KB checkpoint value (its JSON: 60,002 bytes)
CAP = 1024 * 1024


def bearer(tenant: str, role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[(tenant, role)]}"}


class Tenant:
    """One tenant's calls: its admin registers and reads the audit feed, its worker writes."""

    def __init__(self, gateway: Gateway, name: str) -> None:
        self.client = gateway.client
        self.name = name
        self.admin = bearer(name, "admin")
        self.worker = bearer(name, "worker")

    async def register(self, job: str) -> None:
        resp = await self.client.post(
            f"/v1/jobs/{job}/generations", json={"generation": 1}, headers=self.admin
        )
        assert resp.status == 201, await resp.text()

    async def put(self, job: str, name: str, value: Any = BLOB) -> Any:
        headers = {**self.worker, "Fencing-Token": "1", "Worker-Id": f"w-{self.name}"}
        return await self.client.put(
            f"/v1/jobs/{job}/checkpoints/{name}", json=value, headers=headers
        )

    async def get(self, job: str, name: str) -> Any:
        return await self.client.get(f"/v1/jobs/{job}/checkpoints/{name}", headers=self.worker)

    async def audit(self) -> list[dict[str, Any]]:
        resp = await self.client.get("/v1/audit/rejections", headers=self.admin)
        assert resp.status == 200, await resp.text()
        items: list[dict[str, Any]] = (await resp.json())["items"]
        return items


async def tenants(make_gateway: Any, **sections: Any) -> tuple[Tenant, Tenant]:
    gateway: Gateway = await make_gateway(auth=AUTH, **sections)
    return Tenant(gateway, "acme"), Tenant(gateway, "globex")


async def test_checkpoint_bytes_quota_stops_one_tenant_at_its_cap_and_not_the_other(
    make_gateway: Any, redis_sync: Any
) -> None:
    acme, globex = await tenants(
        make_gateway, quotas={"tenants": {"acme": {"checkpoint_bytes": CAP}}}
    )
    await acme.register("big")
    stored = 0
    for i in range(60):  # 3.6 MB: far past the cap if nothing stops it
        resp = await acme.put("big", f"c{i}")
        if resp.status != 200:
            break
        stored += 1
    problem = await resp.json()
    assert resp.status == 429 and problem["code"] == "quota_exceeded", problem
    assert problem["quota"] == "checkpoint_bytes" and problem["limit"] == CAP
    assert resp.headers["Retry-After"] == "5"
    # refused at its cap: every stored checkpoint counts its value plus a few hundred bytes
    assert CAP // 61_000 <= stored <= CAP // 60_000, stored
    # nothing of the refused checkpoint was stored
    assert (await acme.get("big", f"c{stored}")).status == 404
    assert redis_sync.hlen("fg:{acme/big}:ckpt") == stored
    # audited in acme's feed, not globex's
    entries = [e for e in await acme.audit() if e["reason"] == "quota_exceeded"]
    assert entries and entries[0]["step"] == f"checkpoint:c{stored}"
    assert entries[0]["worker_id"] == "w-acme"
    assert await globex.audit() == []

    # at the cap a checkpoint written again no larger is still taken
    again = await acme.put("big", "c0")
    assert again.status == 200, await again.text()
    # a smaller replacement charges only the difference: the room it frees takes a new one
    assert (await acme.put("big", "c1", {"page": 1})).status == 200
    assert (await acme.put("big", "fits")).status == 200
    assert (await acme.put("big", "over")).status == 429

    # globex registers and checkpoints on, past what acme may store
    for j in range(3):
        await globex.register(f"g{j}")
        for i in range(8):
            resp = await globex.put(f"g{j}", f"c{i}")
            assert resp.status == 200, await resp.text()
    assert await globex.audit() == []

    # acme's checkpoints expire with the retention: their charge is given back
    redis_sync.pexpire("fg:{acme/big}:ckpt", 1)
    await acme.register("next")
    deadline = time.monotonic() + 10
    while (resp := await acme.put("next", "c0")).status != 200:
        assert resp.status == 429 and time.monotonic() < deadline, await resp.text()
        await asyncio.sleep(0.3)


async def test_checkpoint_charge_is_what_the_job_stores(make_gateway: Any, redis_sync: Any) -> None:
    acme, _ = await tenants(make_gateway)
    await acme.register("j")
    await acme.register("k")
    assert (await acme.put("j", "a")).status == 200
    assert (await acme.put("j", "b", {"n": 1})).status == 200
    assert (await acme.put("j", "a", [1, 2, 3])).status == 200  # replaces a 60 KB one
    assert (await acme.put("k", "a")).status == 200
    raised = await acme.client.post(
        "/v1/jobs/k/generations", json={"generation": 2}, headers=acme.admin
    )
    assert raised.status == 201
    stale = await acme.put("k", "z")
    assert stale.status == 409  # refused by the fence: charged nothing
    assert (await acme.get("j", "a")).status == 200
    # the settlements are not waited for by the calls (on a Cluster the tenant's counters are
    # on another node than the job: a later reply says nothing of them): every reservation
    # closed first
    for _ in range(250):
        if not redis_sync.hlen("fg:quota:{acme}:ckpt_pending"):
            break
        await asyncio.sleep(0.02)

    def charge(job: str) -> int:
        fields = redis_sync.hgetall(f"fg:{{acme/{job}}}:ckpt")
        return sum(len(v.encode()) + len(n) + 256 for n, v in fields.items())

    per_job = redis_sync.hgetall("fg:quota:{acme}:ckpt")
    assert {job: int(c) for job, c in per_job.items()} == {"j": charge("j"), "k": charge("k")}
    assert int(redis_sync.get("fg:quota:{acme}:ckpt_bytes")) == charge("j") + charge("k")


async def test_checkpoint_names_per_job_are_capped_and_replacements_still_taken(
    make_gateway: Any, redis_sync: Any
) -> None:
    acme, _ = await tenants(make_gateway, checkpoints={"max_per_job": 5})
    await acme.register("j")
    for i in range(5):
        assert (await acme.put("j", f"c{i}", {"i": i})).status == 200
    over = await acme.put("j", "c5", {"i": 5})
    problem = await over.json()
    assert over.status == 413 and problem["code"] == "too_many_checkpoints", problem
    assert problem["limit"] == 5
    assert (await acme.get("j", "c5")).status == 404
    entries = [e for e in await acme.audit() if e["reason"] == "quota_exceeded"]
    assert entries[0]["step"] == "checkpoint:c5"
    # a replacement of a stored name is always taken
    resp = await acme.put("j", "c0", {"i": 10})
    assert resp.status == 200 and (await resp.json())["value"] == {"i": 10}
    # the cap is per job, and decided in the job's script: of ten new names sent at once on
    # another job, exactly five are stored
    await acme.register("k")
    answers = await asyncio.gather(*(acme.put("k", f"n{i}", {"i": i}) for i in range(10)))
    assert sorted(r.status for r in answers) == [200] * 5 + [413] * 5
    assert redis_sync.hlen("fg:{acme/k}:ckpt") == 5
