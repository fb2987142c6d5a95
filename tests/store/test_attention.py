"""The "needs a decision" index, the registration history and the key names behind them.

A real Redis, the real scripts; the index is checked against the records, never against
itself. The model checker (tests/model, I-index) checks every interleaving of the scripts
at its bound; these tests check the listing, the hints, the reconciler and the API.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.http import appkeys as K
from gateway.runtime.settings import ConfigError
from gateway.store.attention import decode_cursor
from gateway.store.keys import JobKeys, attention_hint
from gateway.store.store import Store
from tests.conftest import Gateway, Upstream, key_digest

KEYS = {
    "sched": ("scheduler", "a", "ci-scheduler"),
    "work": ("worker", "a", "worker-fleet"),
    "alice": ("auditor", "a", "alice@example.com"),
    "anon": ("auditor", "a", ""),
    "b": ("admin", "b", ""),
}


def secret(name: str) -> str:
    return f"key-{name}-0123456789abcdef"


def auth() -> dict[str, Any]:
    keys = []
    for name, (role, tenant, key_name) in KEYS.items():
        entry = {"role": role, "sha256": key_digest(secret(name)), "tenant": tenant}
        if key_name:
            entry["name"] = key_name
        keys.append(entry)
    return {"keys": keys}


def as_(name: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret(name)}", **extra}


@pytest.fixture
async def keyed_gw(make_gateway: Any) -> Gateway:
    g: Gateway = await make_gateway(auth=auth(), fencing={"dispatch_timeout_seconds": 5})
    return g


@pytest.fixture
async def gw_short(make_gateway: Any) -> Gateway:
    """Dispatch deadlines of 0.5 s, for the tests that wait one out (they send nothing: a
    real send under a loaded host's scheduling could miss so short a deadline)."""
    g: Gateway = await make_gateway(auth=auth(), fencing={"dispatch_timeout_seconds": 0.5})
    return g


def store(gw: Gateway) -> Store:
    s: Store = gw.app[K.STORE]
    return s


async def register(gw: Gateway, job: str, gen: int, key: str = "sched") -> None:
    resp = await gw.client.post(
        f"/v1/jobs/{job}/generations", json={"generation": gen}, headers=as_(key)
    )
    assert resp.status in (200, 201), await resp.text()


async def effect(gw: Gateway, job: str, step: str, gen: int, key: str = "work") -> int:
    body = {"adapter": "hook", "operation": "send", "payload": {"to": "a@example.com"}}
    resp = await gw.client.post(
        f"/v1/jobs/{job}/effects/{step}", json=body, headers=as_(key, **{"Fencing-Token": str(gen)})
    )
    return resp.status


async def unknown(gw: Gateway, upstream: Upstream, job: str, step: str, key: str = "work") -> None:
    upstream.behaviour = 500  # the downstream answers 500: the outcome is unknown
    assert await effect(gw, job, step, 1, key) == 504
    upstream.behaviour = "ok"


async def attention(gw: Gateway, key: str, **query: str) -> Any:
    resp = await gw.client.get("/v1/attention", params=query, headers=as_(key))
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def resolve(gw: Gateway, job: str, step: str, key: str, outcome: str) -> Any:
    return await gw.client.post(
        f"/v1/jobs/{job}/effects/{step}/resolve", json={"outcome": outcome}, headers=as_(key)
    )


# -- needs a decision ------------------------------------------------------------------


async def test_unknown_step_is_listed_and_leaves_when_resolved_by_a_named_key(
    keyed_gw: Gateway, upstream: Upstream
) -> None:
    await register(keyed_gw, "r", 1)
    await unknown(keyed_gw, upstream, "r", "notify")
    page = await attention(keyed_gw, "alice")
    [item] = page["items"]
    assert page["next_cursor"] is None
    assert (item["job_id"], item["step"], item["state"]) == ("r", "notify", "unknown")
    assert item["adapter"] == "hook" and item["attempts"] == 1 and item["generation"] == 1
    assert item["last_error"] and item["age_ms"] >= 0 and item["since"].endswith("Z")
    assert [i["step"] for i in await store(keyed_gw).attention("a", limit=10)] == ["notify"]

    resp = await resolve(keyed_gw, "r", "notify", "alice", "delivered")
    record = await resp.json()
    assert resp.status == 200 and record["resolved_by"] == "alice@example.com"
    assert (await attention(keyed_gw, "alice"))["items"] == []
    assert await store(keyed_gw).attention("a", limit=10) == []
    # the audit entry names the key, the worker_id stays operator:<role> as before
    entry = (await store(keyed_gw).history(JobKeys("a", "r")))[-1]
    assert entry["reason"] == "operator_resolved_delivered" and entry["by"] == "alice@example.com"
    assert entry["worker_id"] == "operator:auditor"
    # and in the listings: the tenant feed's copy and the job's own stream
    for query in ({}, {"job": "r"}):
        resp = await keyed_gw.client.get("/v1/audit/rejections", params=query, headers=as_("alice"))
        [listed] = (await resp.json())["items"]
        assert listed["reason"] == "operator_resolved_delivered"
        assert listed["by"] == "alice@example.com", query
    check = await store(keyed_gw).verify_audit()
    assert check.broken == [] and check.entries == 2  # the registration and the resolution


async def test_an_unnamed_key_is_recorded_by_its_role(
    keyed_gw: Gateway, upstream: Upstream
) -> None:
    await register(keyed_gw, "r", 1)
    await unknown(keyed_gw, upstream, "r", "notify")
    resp = await resolve(keyed_gw, "r", "notify", "anon", "not_delivered")
    assert resp.status == 200 and (await resp.json())["resolved_by"] == "auditor"
    assert (await store(keyed_gw).history(JobKeys("a", "r")))[-1]["by"] == "auditor"


async def test_two_tenants_never_see_each_others_steps(
    keyed_gw: Gateway, upstream: Upstream
) -> None:
    await register(keyed_gw, "r", 1)
    await unknown(keyed_gw, upstream, "r", "notify")
    resp = await keyed_gw.client.post(
        "/v1/jobs/r/generations", json={"generation": 1}, headers=as_("b")
    )  # the same job id in tenant b
    assert resp.status == 201
    await unknown(keyed_gw, upstream, "r", "mail", key="b")
    a = await attention(keyed_gw, "alice")
    b = await attention(keyed_gw, "b")
    assert [i["step"] for i in a["items"]] == ["notify"]
    assert [i["step"] for i in b["items"]] == ["mail"]
    assert [i["step"] for i in await store(keyed_gw).attention("b", limit=10)] == ["mail"]
    # b cannot resolve a's step (it is not in b's namespace), nor a b's
    assert (await resolve(keyed_gw, "r", "notify", "b", "delivered")).status == 404
    assert (await resolve(keyed_gw, "r", "mail", "alice", "delivered")).status == 404
    # a hint planted in the wrong tenant's key is not believed
    client = store(keyed_gw).link.client
    await client.zadd(attention_hint("b"), {JobKeys("a", "r").member("notify"): 1})
    assert [i["step"] for i in (await attention(keyed_gw, "b"))["items"]] == ["mail"]


async def test_a_lost_hint_is_repaired_by_the_reconciler(
    keyed_gw: Gateway, upstream: Upstream
) -> None:
    """A crash between the verdict (the script indexed the step in its slot) and the hint."""
    await register(keyed_gw, "r", 1)
    await unknown(keyed_gw, upstream, "r", "notify")
    client = store(keyed_gw).link.client
    await client.delete(attention_hint("a"))  # the hint never got written
    assert (await attention(keyed_gw, "alice"))["items"] == []
    assert await client.zscore(JobKeys("a", "r").attention, JobKeys("a", "r").member("notify"))
    stats = await store(keyed_gw).reconcile_attention()
    assert stats["hinted"] == 1 and stats["repaired"] == 0
    assert [i["step"] for i in (await attention(keyed_gw, "alice"))["items"]] == ["notify"]


async def test_a_dispatch_past_its_deadline_is_found_by_the_reconciler_and_resolvable(
    gw_short: Gateway,
) -> None:
    await register(gw_short, "r", 1)
    keys = JobKeys("a", "r")
    held = await store(gw_short).admit(
        keys, "stuck", generation=1, intent_sha256="0" * 64, adapter="hook",
        operation="send", worker_id="w1", resolvable=False,
    )  # fmt: skip  # the holder dies: it never records
    await store(gw_short).reconcile_attention()
    assert (await attention(gw_short, "alice"))["items"] == []  # still within its deadline
    await asyncio.sleep(0.6)
    assert (await attention(gw_short, "alice"))["items"] == []  # nothing ran at the deadline ...
    await store(gw_short).reconcile_attention()  # ... the reconciler finds it
    [item] = (await attention(gw_short, "alice"))["items"]
    assert (item["step"], item["state"], item["worker_id"]) == ("stuck", "dispatching", "w1")
    assert item["deadline"] is not None and item["age_ms"] >= 0
    assert (await resolve(gw_short, "r", "stuck", "alice", "not_delivered")).status == 200
    assert (await attention(gw_short, "alice"))["items"] == []
    # the zombie's late record finds the step resolved: it changes nothing
    assert await store(gw_short).record(keys, "stuck", held.dispatch_id, "succeeded") == (
        False,
        None,
    )  # type: ignore[union-attr]


async def test_one_gateway_of_the_deployment_reconciles_per_interval(
    keyed_gw: Gateway, make_gateway: Any
) -> None:
    other = await make_gateway(auth=auth())
    assert await store(keyed_gw).attention_index.take_turn(2000) is True
    assert await store(other).attention_index.take_turn(2000) is False  # the interval is taken
    assert await store(keyed_gw).attention_index.take_turn(2000) is False
    await asyncio.sleep(2.0)
    assert await store(other).attention_index.take_turn(2000) is True  # the next interval


async def test_an_expired_record_is_repaired_out_of_the_index(
    keyed_gw: Gateway, upstream: Upstream
) -> None:
    await register(keyed_gw, "r", 1)
    await unknown(keyed_gw, upstream, "r", "notify")
    keys = JobKeys("a", "r")
    client = store(keyed_gw).link.client
    await client.delete(keys.effect("notify"))  # its retention ran out, unresolved
    assert (await attention(keyed_gw, "alice"))["items"] == []  # the record is the judge
    stats = await store(keyed_gw).reconcile_attention()
    assert stats["repaired"] == 1 and stats["dropped"] == 1
    assert await client.zscore(keys.attention, keys.member("notify")) is None
    assert await client.zscore(attention_hint("a"), keys.member("notify")) is None


async def test_a_stale_hint_is_skipped_and_dropped_at_read(keyed_gw: Gateway) -> None:
    await register(keyed_gw, "r", 1)
    assert await effect(keyed_gw, "r", "done", 1) == 200
    keys = JobKeys("a", "r")
    client = store(keyed_gw).link.client
    await client.zadd(attention_hint("a"), {keys.member("done"): 1})
    assert (await attention(keyed_gw, "alice"))["items"] == []
    assert await client.zscore(attention_hint("a"), keys.member("done")) is None


async def test_a_worker_key_cannot_list_and_bad_queries_are_400(keyed_gw: Gateway) -> None:
    assert (await keyed_gw.client.get("/v1/attention", headers=as_("work"))).status == 403
    assert (await keyed_gw.client.get("/v1/attention")).status == 401
    for query in ({"limit": "0"}, {"limit": "x"}, {"cursor": "!!"}, {"cursor": "bm90LWpzb24"}):
        resp = await keyed_gw.client.get("/v1/attention", params=query, headers=as_("alice"))
        body = await resp.json()
        assert resp.status == 400 and body["code"] == "invalid_request", (query, body)


async def test_the_api_pages_with_its_cursor(keyed_gw: Gateway, upstream: Upstream) -> None:
    await register(keyed_gw, "r", 1)
    for i in range(5):
        await unknown(keyed_gw, upstream, "r", f"s{i}")
    seen, cursor = [], None
    while True:
        page = await attention(
            keyed_gw, "alice", limit="2", **({"cursor": cursor} if cursor else {})
        )
        seen += [i["step"] for i in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [f"s{i}" for i in range(5)]  # oldest first, each once


# Paging with ties and stale entries: hints and records written directly, any scores.
entries = st.lists(
    st.tuples(
        st.sampled_from(["j1", "j2", "j3"]),
        st.sampled_from(["s1", "s2", "s3", "s4"]),
        st.integers(min_value=1, max_value=4),  # few scores: many ties
        st.sampled_from(["unknown", "unknown", "dispatching", "succeeded", "gone", "future"]),
    ),
    max_size=25,
    unique_by=lambda e: (e[0], e[1]),
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rows=entries, limit=st.integers(min_value=1, max_value=6))
async def test_paging_returns_each_step_once_in_order(
    keyed_gw: Gateway, rows: list[tuple[str, str, int, str]], limit: int
) -> None:
    client = store(keyed_gw).link.client
    await client.delete(attention_hint("p"))
    expected = []
    for job, step, score, state in rows:
        keys = JobKeys("p", job)
        await client.delete(keys.effect(step))
        h = {"unknown": {"state": "unknown", "updated_at": str(score)},
             "dispatching": {"state": "dispatching", "deadline": str(score)},
             "future": {"state": "dispatching", "deadline": str(10**15)},
             "succeeded": {"state": "succeeded"}}.get(state)  # fmt: skip
        if h:
            await client.hset(keys.effect(step), mapping={**h, "adapter": "hook"})
        await client.zadd(attention_hint("p"), {keys.member(step): score})
        if state in ("unknown", "dispatching"):
            expected.append((score, keys.member(step)))
    expected.sort()
    got: list[tuple[int, str]] = []
    after = None
    for _ in range(100):
        page = await store(keyed_gw).attention("p", limit=limit, after=after)
        assert len(page) <= limit
        got += [decode_cursor(i["cursor"]) for i in page]
        if len(page) < limit:
            break
        after = page[-1]["cursor"]
    assert got == expected


# -- registration history --------------------------------------------------------------


async def test_registrations_are_in_the_job_chain_with_who_and_the_old_fence(
    keyed_gw: Gateway,
) -> None:
    await register(keyed_gw, "r", 1)
    await register(keyed_gw, "r", 1)  # already current: no new registration
    await register(keyed_gw, "r", 4)
    assert await effect(keyed_gw, "r", "s", 1) == 409  # the zombie of generation 1
    history = await store(keyed_gw).history(JobKeys("a", "r"))
    regs = [e for e in history if e.get("event") == "registered"]
    assert [(e["generation"], e["previous"], e["by"]) for e in regs] == [
        ("1", "0", "ci-scheduler"),
        ("4", "1", "ci-scheduler"),
    ]
    assert [e.get("event") or e["reason"] for e in history] == [
        "registered", "registered", "stale_generation",
    ]  # fmt: skip
    assert int(regs[0]["at"]) <= int(regs[1]["at"]) <= int(history[2]["at"])
    check = await store(keyed_gw).verify_audit()
    assert check.broken == [] and check.entries == 3
    # the rejections listing of the job leaves registrations out
    resp = await keyed_gw.client.get(
        "/v1/audit/rejections", params={"job": "r"}, headers=as_("alice")
    )
    assert [e["reason"] for e in (await resp.json())["items"]] == ["stale_generation"]


async def test_rejections_listing_pages_past_registrations(keyed_gw: Gateway) -> None:
    for gen in range(1, 6):
        await register(keyed_gw, "r", gen)
        assert await effect(keyed_gw, "r", "s", gen - 1 or 9) == 409
    seen, cursor = [], None
    while True:
        params = {"job": "r", "limit": "1", **({"cursor": cursor} if cursor else {})}
        resp = await keyed_gw.client.get(
            "/v1/audit/rejections", params=params, headers=as_("alice")
        )
        page = await resp.json()
        seen += [(e["reason"], e["presented"]) for e in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    # newest first: generation 5's zombie (4) ... generation 1's call with token 9
    assert seen == [("stale_generation", g) for g in (4, 3, 2, 1)] + [
        ("unregistered_generation", 9)
    ]


async def test_an_implicit_registration_is_recorded_by_the_deciding_script(
    make_gateway: Any,
) -> None:
    keyed_gw = await make_gateway(auth=auth(), fencing={"registration": "implicit"})
    assert await effect(keyed_gw, "r", "s1", 3) == 200  # raises the fence to 3
    resp = await keyed_gw.client.post(
        "/v1/jobs/r/fence", headers=as_("work", **{"Fencing-Token": "5", "Worker-Id": "w-5"})
    )
    assert resp.status == 200
    regs = [e for e in await store(keyed_gw).history(JobKeys("a", "r")) if e.get("event")]
    assert [(e["generation"], e["previous"], e["by"], e["mode"]) for e in regs] == [
        ("3", "0", "worker-fleet", "implicit"),
        ("5", "3", "worker-fleet", "implicit"),
    ]
    assert regs[1]["worker_id"] == "w-5"
    # a checkpoint and a completion raise the fence too: registrations as well
    tok = {"Fencing-Token": "6", "Worker-Id": "w-6"}
    resp = await keyed_gw.client.put(
        "/v1/jobs/r/checkpoints/c", json={"p": 1}, headers=as_("work", **tok)
    )
    assert resp.status == 200, await resp.text()
    tok = {"Fencing-Token": "7", "Worker-Id": "w-7"}
    resp = await keyed_gw.client.post("/v1/jobs/r/complete", json={}, headers=as_("work", **tok))
    assert resp.status in (200, 201), await resp.text()
    regs = [e for e in await store(keyed_gw).history(JobKeys("a", "r")) if e.get("event")]
    assert [(e["generation"], e["previous"], e["by"], e["worker_id"]) for e in regs[2:]] == [
        ("6", "5", "worker-fleet", "w-6"),
        ("7", "6", "worker-fleet", "w-7"),
    ]
    assert (await store(keyed_gw).verify_audit()).broken == []


async def test_an_output_upload_raising_the_fence_is_a_registration(
    make_gateway: Any, tmp_path: Any
) -> None:
    outputs = {"store": "file", "path": str(tmp_path / "objects"), "sweep_interval_seconds": 0}
    keyed_gw = await make_gateway(
        auth=auth(), fencing={"registration": "implicit"}, outputs=outputs
    )
    tok = {"Fencing-Token": "2", "Worker-Id": "w-2", "Content-Type": "text/plain"}
    resp = await keyed_gw.client.put(
        "/v1/jobs/r/outputs/report.txt", data=b"hi", headers=as_("work", **tok)
    )
    assert resp.status == 201, await resp.text()
    [reg] = [e for e in await store(keyed_gw).history(JobKeys("a", "r")) if e.get("event")]
    assert (reg["generation"], reg["previous"], reg["by"], reg["worker_id"]) == (
        "2", "0", "worker-fleet", "w-2",
    )  # fmt: skip
    assert (await store(keyed_gw).verify_audit()).broken == []


# -- overview, chain check, key names ---------------------------------------------------


async def test_overview_counts_from_redis(keyed_gw: Gateway, upstream: Upstream) -> None:
    await register(keyed_gw, "r", 2)
    assert await effect(keyed_gw, "r", "s", 1) == 409
    assert await effect(keyed_gw, "r", "s", 1) == 409
    assert await effect(keyed_gw, "r", "s", 7) == 409
    await register(keyed_gw, "q", 1)
    await unknown(keyed_gw, upstream, "q", "n")
    now = int((await store(keyed_gw).link.client.time())[0]) * 1000 + 1000
    view = await store(keyed_gw).overview("a", now_ms=now)
    assert view["rejections_last_hour"] == {"stale_generation": 2, "unregistered_generation": 1}
    assert view["rejections_total_last_hour"] == 3 and view["open_unknowns"] == 1
    assert view["overdue_dispatches"] == 0 and view["last_chain_check"] is None
    assert (await store(keyed_gw).overview("b", now_ms=now))["rejections_total_last_hour"] == 0
    # an hour later those rejections are out of the window
    later = await store(keyed_gw).overview("a", now_ms=now + 3_600_000 + 5000)
    assert later["rejections_total_last_hour"] == 0

    await store(keyed_gw).record_chain_check(
        "a", {"at_ms": now, "jobs": 2, "entries": 6, "problems": ["x"] * 300}
    )
    kept = (await store(keyed_gw).overview("a", now_ms=now))["last_chain_check"]
    assert kept["jobs"] == 2 and kept["problems_total"] == 300 and len(kept["problems"]) == 200
    assert (await store(keyed_gw).overview("b", now_ms=now))["last_chain_check"] is None
    raw = await store(keyed_gw).link.client.get("fg:chain:t:a")
    assert json.loads(raw)["entries"] == 6


@pytest.mark.parametrize("name", ["", "alice", "ops.bot_1", "a@example.com", "x" * 64])
def test_key_names_that_are_accepted(name: str, tmp_path: Any) -> None:
    from gateway.runtime.settings import load_settings

    key = {"role": "auditor", "sha256": "0" * 64, "name": name}
    assert load_settings(None, auth={"keys": [key]}).auth.keys[0].name == name


@pytest.mark.parametrize("name", ["<svg/onload=1>", "has space", "x" * 65, "-lead", "a\n"])
def test_key_names_that_are_refused(name: str) -> None:
    from gateway.runtime.settings import load_settings

    key = {"role": "auditor", "sha256": "0" * 64, "name": name}
    with pytest.raises((ConfigError, ValueError), match="name"):
        load_settings(None, auth={"keys": [key]})


# -- what a listing reads ----------------------------------------------------------------


async def test_the_listing_reads_the_fields_it_shows_never_a_held_payload(
    gw_short: Gateway, redis_sync: Any
) -> None:
    """The attention listing reads only the fields it shows: an async step whose relay
    claimed it and died is listed past its deadline with its 240 KB payload still held in
    its record; the listing and the overview read the fields they show only (measured on
    Redis: every byte it sent, ``INFO stats``)."""
    gw_short.app[K.SERVICE].relay.stop()  # this gateway's relay does not take it
    await asyncio.sleep(0.5)
    await register(gw_short, "r", 1)
    payload = {f"part{n}": "x" * 60_000 for n in range(4)}
    body = {"adapter": "hook", "operation": "send", "payload": payload}
    headers = as_("work", **{"Fencing-Token": "1", "Prefer": "respond-async"})
    resp = await gw_short.client.post("/v1/jobs/r/effects/big", json=body, headers=headers)
    assert resp.status == 202, await resp.text()
    claim = await store(gw_short).relay_claim(JobKeys("a", "r"), "big")  # a relay that then dies
    assert not isinstance(claim, int | str)
    await asyncio.sleep(0.6)  # past its deadline
    record = "fg:{a/r}:fx:big"
    assert redis_sync.hget(record, "state") == "dispatching"
    assert len(redis_sync.hget(record, "payload") or "") > 240_000  # still held
    await store(gw_short).reconcile_attention()

    before = int(redis_sync.info("stats")["total_net_output_bytes"])
    [item] = (await attention(gw_short, "alice"))["items"]
    view = await store(gw_short).overview("a", now_ms=int(time.time() * 1000))
    spent = int(redis_sync.info("stats")["total_net_output_bytes"]) - before

    assert (item["step"], item["state"], item["adapter"]) == ("big", "dispatching", "hook")
    assert view["overdue_dispatches"] == 1
    assert spent < 50_000, f"Redis sent {spent} bytes for one listed step"
