"""Roles and tenants (docs/api.md, docs/security.md): every endpoint by every kind of caller."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.http import appkeys as K
from gateway.runtime.settings import ConfigError, load_settings
from gateway.store.keys import JobKeys
from tests.conftest import Gateway, Upstream, key_digest

KEYS = {
    "worker": "wk-acme-0123456789",
    "scheduler": "sc-acme-0123456789",
    "auditor": "au-acme-0123456789",
    "admin": "ad-acme-0123456789",
    "other-scheduler": "sc-other-0123456789",
    "other-worker": "wk-other-0123456789",
    "other-auditor": "au-other-0123456789",
    # worker keys with claims = true: they register their own jobs' generations
    "claimer": "wc-acme-0123456789",
    "other-claimer": "wc-other-0123456789",
}


def auth_section() -> dict[str, Any]:
    keys = []
    for name, key in KEYS.items():
        tenant = "other" if name.startswith("other-") else "acme"
        role = name.removeprefix("other-")
        entry: dict[str, Any] = {"role": role, "sha256": key_digest(key), "tenant": tenant}
        if role == "claimer":
            entry.update(role="worker", claims=True, name=f"arq-{tenant}")
        keys.append(entry)
    return {"keys": keys}


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


@pytest.fixture
async def secured(make_gateway: Any) -> Gateway:
    gw: Gateway = await make_gateway(auth=auth_section())
    r = await gw.client.post(
        "/v1/jobs/r/generations", json={"generation": 1}, headers=bearer("scheduler")
    )
    assert r.status == 201
    return gw


EFFECT = {"adapter": "hook", "operation": "send", "payload": {}}
ENDPOINTS = [
    ("POST", "/v1/jobs/r/generations", {}, {"scheduler"}),
    ("POST", "/v1/jobs/r/fence", None, {"worker"}),
    ("POST", "/v1/jobs/r/effects/s", EFFECT, {"worker"}),
    ("GET", "/v1/jobs/r/effects/s", None, {"worker", "auditor"}),
    ("GET", "/v1/jobs/r", None, {"scheduler", "auditor"}),
    ("POST", "/v1/jobs/r/cancel", None, {"scheduler"}),
    ("GET", "/v1/audit/rejections", None, {"auditor"}),
]
CALLERS = ["none", "wrong", "malformed", "worker", "claimer", "scheduler", "auditor", "admin"]


@pytest.mark.parametrize(("method", "path", "body", "allowed"), ENDPOINTS)
async def test_role_matrix(
    secured: Gateway, upstream: Upstream, method: str, path: str, body: Any, allowed: set[str]
) -> None:
    # a claim-scoped worker key: what a worker may, and registering generations
    claimer_may = "worker" in allowed or path.endswith("/generations")
    for caller in CALLERS:
        headers = {"Fencing-Token": "1"}
        if caller == "wrong":
            headers["Authorization"] = "Bearer not-a-configured-key"
        elif caller == "malformed":
            headers["Authorization"] = KEYS["admin"]  # no "Bearer "
        elif caller != "none":
            headers.update(bearer(caller))
        resp = await secured.client.request(method, path, json=body, headers=headers)
        doc = await resp.json(content_type=None)
        if caller in ("none", "wrong", "malformed"):
            assert (resp.status, doc["code"]) == (401, "unauthorized"), (caller, path)
        elif caller == "admin" or caller in allowed or (caller == "claimer" and claimer_may):
            assert resp.status not in (401, 403), (caller, path, doc)
        else:
            assert (resp.status, doc["code"]) == (403, "forbidden"), (caller, path)
    # the rejected probes above reached no adapter (only the permitted worker/admin calls did)
    assert len(upstream.received) <= 1


async def test_a_claim_scoped_worker_key_registers_its_jobs_generations(
    secured: Gateway, upstream: Upstream
) -> None:
    c = secured.client
    gen = "/v1/jobs/c/generations"
    # allocated by fencegate (fence + 1), then the framework's own counter, then a regression
    first = await c.post(gen, json={}, headers=bearer("claimer"))
    assert (first.status, (await first.json())["generation"]) == (201, 1)
    own = await c.post(gen, json={"generation": 5, "lease_ms": 5000}, headers=bearer("claimer"))
    assert (own.status, (await own.json())["generation"]) == (201, 5)
    back = await c.post(gen, json={"generation": 3}, headers=bearer("claimer"))
    assert (back.status, (await back.json())["code"]) == (409, "generation_regression")
    # the claim made generation 1 a zombie at once
    stale = await c.post(
        "/v1/jobs/c/effects/s", json=EFFECT, headers={**bearer("claimer"), "Fencing-Token": "1"}
    )
    assert (stale.status, (await stale.json())["code"]) == (409, "stale_generation")
    # audited as registrations by that key
    history = await secured.app[K.STORE].history(JobKeys("acme", "c"))
    regs = [(e["generation"], e["by"]) for e in history if e.get("event") == "registered"]
    assert regs == [("1", "arq-acme"), ("5", "arq-acme")]
    # nothing else a scheduler may do
    cancel = await c.post("/v1/jobs/c/cancel", headers=bearer("claimer"))
    assert (cancel.status, (await cancel.json())["code"]) == (403, "forbidden")
    read = await c.get("/v1/jobs/c", headers=bearer("scheduler"))
    assert (await read.json())["fence"] == 5 and upstream.received == []


async def test_a_plain_worker_key_may_not_register(secured: Gateway) -> None:
    c = secured.client
    for body in ({}, {"generation": 2}):
        resp = await c.post("/v1/jobs/r/generations", json=body, headers=bearer("worker"))
        doc = await resp.json()
        assert (resp.status, doc["code"]) == (403, "forbidden")
        assert "claims = true" in doc["detail"]
    job = await (await c.get("/v1/jobs/r", headers=bearer("scheduler"))).json()
    assert job["fence"] == 1  # nothing changed


async def test_a_claim_registers_in_its_own_tenant_only(secured: Gateway) -> None:
    c = secured.client
    # "other"'s claimer asks for acme's job r: it names its own tenant's r, a different job
    resp = await c.post(
        "/v1/jobs/r/generations", json={"generation": 7}, headers=bearer("other-claimer")
    )
    assert (resp.status, (await resp.json())["generation"]) == (201, 7)
    acme = await (await c.get("/v1/jobs/r", headers=bearer("scheduler"))).json()
    assert acme["fence"] == 1
    # acme's generation 1 still acts; the other tenant's token 7 is nothing in acme
    ok = await c.post(
        "/v1/jobs/r/effects/s", json=EFFECT, headers={**bearer("worker"), "Fencing-Token": "1"}
    )
    assert ok.status == 200
    foreign = await c.post(
        "/v1/jobs/r/effects/t", json=EFFECT, headers={**bearer("claimer"), "Fencing-Token": "7"}
    )
    assert (foreign.status, (await foreign.json())["code"]) == (409, "unregistered_generation")
    history = await secured.app[K.STORE].history(JobKeys("acme", "r"))
    assert [e.get("by") for e in history if e.get("event") == "registered"] == ["scheduler"]


@pytest.mark.parametrize("role", ["scheduler", "auditor", "admin"])
def test_claims_is_only_for_worker_keys(role: str) -> None:
    key = {"role": role, "sha256": key_digest("k" * 20), "claims": True}
    with pytest.raises(ConfigError, match="claims = true is for worker keys"):
        load_settings(None, auth={"keys": [key]})


async def test_open_endpoints_need_no_key(secured: Gateway) -> None:
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
        assert (await secured.client.get(path)).status == 200, path


async def test_tenants_are_separate_namespaces(secured: Gateway, upstream: Upstream) -> None:
    c = secured.client
    # tenant "other" cannot see or use acme's job r
    assert (await c.get("/v1/jobs/r", headers=bearer("other-scheduler"))).status == 404
    resp = await c.post(
        "/v1/jobs/r/effects/s",
        json=EFFECT,
        headers={**bearer("other-worker"), "Fencing-Token": "1"},
    )
    assert (resp.status, (await resp.json())["code"]) == (409, "unregistered_generation")
    # its own job r is a different job with its own fence
    resp = await c.post(
        "/v1/jobs/r/generations", json={"generation": 9}, headers=bearer("other-scheduler")
    )
    assert resp.status == 201
    acme = await (await c.get("/v1/jobs/r", headers=bearer("scheduler"))).json()
    assert acme["fence"] == 1
    # acme's worker on generation 1 is unaffected by the other tenant's generation 9
    resp = await c.post(
        "/v1/jobs/r/effects/s", json=EFFECT, headers={**bearer("worker"), "Fencing-Token": "1"}
    )
    assert resp.status == 200
    # each tenant's audit log holds only its own rejections
    other_audit = await (
        await c.get("/v1/audit/rejections", headers=bearer("other-auditor"))
    ).json()
    acme_audit = await (await c.get("/v1/audit/rejections", headers=bearer("auditor"))).json()
    assert [e["reason"] for e in other_audit["items"]] == ["unregistered_generation"]
    assert acme_audit["items"] == []
    assert len(upstream.received) == 1


async def test_tenant_prefix_in_every_key_with_two_tenants(
    make_gateway: Any, upstream: Upstream
) -> None:
    sections = auth_section()
    gw: Gateway = await make_gateway(
        auth=sections,
        adapters={"shared": {"type": "webhook", "url": upstream.url, "tenant_in_key": True}},
    )
    c = gw.client
    for tenant_sched, tenant_worker in (
        ("scheduler", "worker"),
        ("other-scheduler", "other-worker"),
    ):
        await c.post("/v1/jobs/r/generations", json={"generation": 1}, headers=bearer(tenant_sched))
        for adapter in ("hook", "shared"):
            resp = await c.post(
                "/v1/jobs/r/effects/" + adapter,
                json={"adapter": adapter, "operation": "x", "payload": {}},
                headers={**bearer(tenant_worker), "Fencing-Token": "1"},
            )
            assert resp.status == 200
    keys = [r.headers["Idempotency-Key"] for r in upstream.received]
    # two tenants: every adapter's key carries the tenant, set or not
    assert keys == ["acme/r:hook", "acme/r:shared", "other/r:hook", "other/r:shared"]


def test_keys_new_prints_a_working_key_and_config(tmp_path: Any) -> None:
    import hashlib
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "gateway", "keys", "new", "--role", "auditor", "--tenant", "acme"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    key = lines[1].strip()
    digest = next(line for line in lines if line.startswith("sha256")).split('"')[1]
    assert hashlib.sha256(key.encode()).hexdigest() == digest and len(key) >= 40
    assert 'role = "auditor"' in out.stdout and 'tenant = "acme"' in out.stdout
    cfg = tmp_path / "k.toml"
    cfg.write_text("\n".join(lines[lines.index("[[auth.keys]]") :]) + "\n")
    check = subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", str(cfg)], capture_output=True, text=True
    )
    assert check.returncode == 0 and "1 keys" in check.stdout


async def test_every_endpoint_probed_from_another_tenant_leaves_acme_untouched(
    secured: Gateway, upstream: Upstream, redis_sync: Any
) -> None:
    c = secured.client
    await c.post(
        "/v1/jobs/r/effects/s", json=EFFECT, headers={**bearer("worker"), "Fencing-Token": "1"}
    )
    before = {k: redis_sync.dump(k) for k in redis_sync.keys("fg:{acme/r}*")}
    sent = len(upstream.received)
    role_for = {
        "scheduler": "other-scheduler",
        "worker": "other-worker",
        "auditor": "other-auditor",
    }
    probes = 0
    # reads and worker calls first: "other" has no job r of its own yet, so each must miss
    # or be refused; its scheduler calls then act on its own namespace only
    ordered = sorted(
        ENDPOINTS, key=lambda e: (e[0] != "GET", "generations" in e[1] or "cancel" in e[1])
    )
    for method, path, body, allowed in ordered:
        for role in allowed:
            resp = await c.request(
                method, path, json=body, headers={**bearer(role_for[role]), "Fencing-Token": "1"}
            )
            probes += 1
            if method == "GET" and path != "/v1/audit/rejections":
                assert resp.status == 404, (role, path)  # acme's job does not exist for "other"
            elif path == "/v1/audit/rejections":
                assert (await resp.json())["items"] == []  # none of acme's entries
            elif path.endswith(("/fence", "/effects/s")):
                assert resp.status == 409, (role, path)  # no generation 1 in "other"
    assert probes == 9
    assert {k: redis_sync.dump(k) for k in redis_sync.keys("fg:{acme/r}*")} == before
    assert len(upstream.received) == sent


def test_keys_new_prints_a_claim_scoped_worker_key(tmp_path: Any) -> None:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "gateway", "keys", "new", "--tenant", "acme", "--claims"]
    out = subprocess.run([*cmd, "--role", "worker"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "claims = true" in out.stdout.splitlines()
    lines = out.stdout.splitlines()
    cfg = tmp_path / "k.toml"
    cfg.write_text("\n".join(lines[lines.index("[[auth.keys]]") :]) + "\n")
    check = subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", str(cfg)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr
    refused = subprocess.run([*cmd, "--role", "scheduler"], capture_output=True, text=True)
    assert refused.returncode == 2 and "for worker keys" in refused.stderr
    assert refused.stdout == ""  # no key printed
