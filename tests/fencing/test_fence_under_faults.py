"""The fence on every path a lost, late or re-sent reply opens: the relay after a takeover,
re-sent scripts, timeouts, voids, the audit feed, one named test per path. They use a
real redis-server, real loopback receivers and, where a reply must be lost or late, a real
TCP proxy between the gateway and Redis (:mod:`tests.support.wire`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from gateway.core.intents import intent_digest
from gateway.core.records import Admitted
from gateway.http import appkeys as K
from gateway.store.embedded import free_port
from gateway.store.keys import JobKeys
from tests.conftest import Gateway, Received, Upstream
from tests.support.wire import WireProxy

ASYNC = {"Prefer": "respond-async"}


class Receiver:
    """A webhook receiver on a fixed loopback port that can be down (connection refused:
    known not delivered) and come up later. Records every request with its arrival time."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self.received: list[tuple[float, Received]] = []
        self._runner: web.AppRunner | None = None

    async def up(self) -> None:
        async def handle(request: web.Request) -> web.Response:
            body = await request.read()
            self.received.append((time.time(), Received(request.path, dict(request.headers), body)))
            return web.json_response({"ok": True, "n": len(self.received)})

        app = web.Application()
        app.router.add_post("/{tail:.*}", handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def down(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def bodies(self) -> list[Any]:
        return [r.json() for _, r in self.received]

    def tokens(self) -> list[str]:
        return [r.headers["Fencing-Token"] for _, r in self.received]


@pytest.fixture
async def flaky_receiver() -> AsyncIterator[Receiver]:
    r = Receiver()
    yield r
    await r.down()


async def flaky_gateway(make_gateway: Any, flaky_receiver: Receiver, **sections: Any) -> Gateway:
    adapters = {"flaky": {"type": "webhook", "url": flaky_receiver.url, "timeout_seconds": 1}}
    gw: Gateway = await make_gateway(adapters=adapters, **sections)
    return gw


async def record(gw: Gateway, step: str, job: str = "r") -> dict[str, Any]:
    resp = await gw.client.get(f"/v1/jobs/{job}/effects/{step}")
    assert resp.status == 200, await resp.text()
    return dict(await resp.json())


async def wait_for(gw: Gateway, step: str, states: set[str], job: str = "r") -> dict[str, Any]:
    view: dict[str, Any] = {}
    for _ in range(400):
        resp = await gw.client.get(f"/v1/jobs/{job}/effects/{step}")
        if resp.status == 200:  # a 503 while a test's proxy refuses connections: look again
            view = dict(await resp.json())
            if view["state"] in states:
                return view
        await asyncio.sleep(0.02)
    raise AssertionError(f"{job}:{step} never reached {states}: {view}")


async def released_then_performed_once(gw: Gateway, upstream: Upstream) -> None:
    """Step ``r:s`` was given up: it reads ``released`` (never ``unknown``), nothing was
    sent, and the worker's retry is performed, once."""
    view = await wait_for(gw, "s", {"released", "unknown"})
    assert view["state"] == "released", view
    assert upstream.received == []
    ok = await gw.effect("r", "s", 1)
    assert ok.status == 200, await ok.text()
    assert len(upstream.received) == 1


async def register(gw: Gateway, job: str, generation: int) -> None:
    """Register through a gateway with a short Redis timeout on a busy machine: a 503 there
    changed nothing (the same registration again is idempotent)."""
    for _ in range(20):
        resp = await gw.register(job, generation=generation)
        if resp.status in (200, 201):
            return
        assert resp.status == 503, await resp.text()
    raise AssertionError("could not register")


def refund(amount: int) -> dict[str, Any]:
    return {"amount": amount, "currency": "eur"}


async def test_relay_never_sends_a_superseded_payload_under_a_new_intent(
    make_gateway: Any, flaky_receiver: Receiver
) -> None:
    """A (gen 1) queues an async refund of 10,000; the downstream is down, the step is
    released. B (gen 2) re-pins the step to 2,500 (sync, also refused). The downstream comes
    back: it must never receive A's 10,000; B's retry sends 2,500 under token 2, once."""
    gw = await flaky_gateway(make_gateway, flaky_receiver)
    await gw.register("r", generation=1)
    a = await gw.effect("r", "refund", 1, adapter="flaky", payload=refund(10_000), headers=ASYNC)
    assert a.status == 202
    await wait_for(gw, "refund", {"released"})
    await gw.register("r", generation=2)
    b = await gw.effect("r", "refund", 2, adapter="flaky", payload=refund(2_500))
    assert b.status == 502 and (await b.json())["code"] == "adapter_unavailable"
    await flaky_receiver.up()
    await asyncio.sleep(1.6)  # past the relay's retry of a released async step
    assert flaky_receiver.received == []
    again = await gw.effect("r", "refund", 2, adapter="flaky", payload=refund(2_500))
    body = await again.json()
    assert again.status == 200 and body["replayed"] is False, body
    assert flaky_receiver.bodies() == [refund(2_500)] and flaky_receiver.tokens() == ["2"]
    view = await record(gw, "refund")
    pinned = intent_digest("flaky", "send", refund(2_500))
    assert (view["generation"], view["intent_sha256"]) == (2, pinned)


async def test_relay_never_dispatches_below_the_fence(
    make_gateway: Any, flaky_receiver: Receiver
) -> None:
    """An async step of gen 1 that the downstream refused is retried by the relay; once
    register(2) is acknowledged it must never be sent with token 1: the claim re-checks the
    fence, releases the step and audits it as superseded. Gen 2 can then take it over."""
    gw = await flaky_gateway(make_gateway, flaky_receiver)
    await gw.register("r", generation=1)
    assert (await gw.effect("r", "s", 1, adapter="flaky", headers=ASYNC)).status == 202
    await wait_for(gw, "s", {"released"})
    assert (await gw.register("r", generation=2)).status == 201
    await flaky_receiver.up()
    await asyncio.sleep(1.6)
    assert flaky_receiver.received == []
    view = await record(gw, "s")
    assert view["state"] == "released" and "superseded" in view["error"]["reason"]
    entries = await gw.audit(job="r")
    assert [(e["reason"], e["presented"], e["current"]) for e in entries] == [("superseded", 1, 2)]
    ok = await gw.effect("r", "s", 2, adapter="flaky")
    assert ok.status == 200 and flaky_receiver.tokens() == ["2"]


async def test_a_rejected_call_never_rearms_the_relay(
    make_gateway: Any, flaky_receiver: Receiver, upstream: Upstream
) -> None:
    """An operator resolved an async step not_delivered; a stale async call on that step gets
    409 — and nothing is ever sent for it (the old code re-armed the relay, which sent the old
    payload with token 1 60 ms later)."""
    gw: Gateway = await make_gateway(fencing={"dispatch_timeout_seconds": 0.5})
    await gw.register("r", generation=1)
    upstream.behaviour = "hang"  # the relay's dispatch times out after sending: unknown
    assert (await gw.effect("r", "s", 1, headers=ASYNC)).status == 202
    await wait_for(gw, "s", {"unknown"})
    assert len(upstream.received) == 1
    resolved = await gw.client.post(
        "/v1/jobs/r/effects/s/resolve", json={"outcome": "not_delivered"}
    )
    assert resolved.status == 200, await resolved.text()
    await gw.register("r", generation=2)
    upstream.behaviour = "ok"
    stale = await gw.effect("r", "s", 1, headers=ASYNC)
    assert stale.status == 409 and (await stale.json())["code"] == "stale_generation"
    await asyncio.sleep(1.3)
    assert len(upstream.received) == 1
    assert (await record(gw, "s"))["state"] == "released"


async def _unknown_step(gw: Gateway, keys: JobKeys, step: str, payload: Any) -> None:
    """A step left unknown by a dispatch that died (its admit ran, nothing was recorded)."""
    store = gw.app[K.STORE]
    digest = intent_digest("hook", "send", payload)
    first = await store.admit(
        keys, step, generation=1, intent_sha256=digest, adapter="hook", operation="send",
        worker_id="", resolvable=True,
    )  # fmt: skip
    assert isinstance(first, Admitted)
    await store.record(keys, step, first.dispatch_id, "unknown", error={"reason": "test"})


async def test_a_resent_admit_remembers_that_it_was_resolving(
    make_gateway: Any, wire: WireProxy
) -> None:
    """The connection drops after the admit of an unknown step ran (it claimed the step to
    resolve it by lookup); the auto-pipeline sends it again. The re-sent admit must answer
    what the first one did — resolving — or the gateway sends instead of looking up (Jira
    got a second ticket)."""
    gw: Gateway = await make_gateway(redis={"url": wire.url})
    await gw.register("r", generation=1)
    keys = JobKeys("default", "r")
    payload = {"to": "a@example.com"}
    await _unknown_step(gw, keys, "s", payload)
    store = gw.app[K.STORE]
    lost = wire.on_reply_to(b"zz-resolve-me", "lose")
    verdict = await store.admit(
        keys, "s", generation=1, intent_sha256=intent_digest("hook", "send", payload),
        adapter="hook", operation="send", worker_id="zz-resolve-me", resolvable=True,
    )  # fmt: skip
    assert lost.fired.is_set(), "the proxy never dropped the reply"
    assert isinstance(verdict, Admitted) and verdict.resolving is True


async def test_the_relay_never_sends_after_the_steps_deadline(
    make_gateway: Any, wire: WireProxy, upstream: Upstream
) -> None:
    """The relay's deadline counts from before its claim, like the sync path's from before
    the admit: a claim whose reply arrives late must not lead to a send after the deadline
    Redis recorded (an operator may resolve an overdue step)."""
    gw: Gateway = await make_gateway(
        redis={"url": wire.url, "timeout_seconds": 2},
        fencing={"dispatch_timeout_seconds": 0.4},
    )
    await gw.register("r", generation=1)
    # requests naming the step's queue member: the admit (it writes the relay's hint), then
    # the claim
    held = wire.on_reply_to(b'"default","r","s"]', "hold", seconds=0.6, skip=1)
    marker = {"to": "a@example.com", "tag": "HOLD-THE-CLAIM"}
    resp = await gw.effect("r", "s", 1, payload=marker, headers=ASYNC)
    assert resp.status == 202
    view = await wait_for(gw, "s", {"succeeded", "unknown"})
    assert held.fired.is_set()
    # every send happened before the deadline of the claim that authorised it
    assert view["state"] == "succeeded" and len(upstream.received) == 1
    assert view["attempts"] >= 2  # the late claim was not sent; a later claim was


async def test_a_resent_relay_claim_is_recognised(
    make_gateway: Any, wire: WireProxy, upstream: Upstream
) -> None:
    """The relay's claim ran but its reply was lost; the auto-pipeline sends it again. The
    re-sent claim must be recognised as the same claim (the old code answered 'someone else
    holds it': the accepted effect was never sent and ended unknown)."""
    gw: Gateway = await make_gateway(
        redis={"url": wire.url}, fencing={"dispatch_timeout_seconds": 1}
    )
    await gw.register("r", generation=1)
    # requests naming the step's queue member: the admit, the relay hint, then the claim
    lost = wire.on_reply_to(b'"default","r","s"]', "lose", skip=2)
    resp = await gw.effect("r", "s", 1, headers=ASYNC)
    assert resp.status == 202
    view = await wait_for(gw, "s", {"succeeded", "unknown"})
    assert view["state"] == "succeeded", view
    assert len(upstream.received) == 1 and view["attempts"] == 1
    assert lost.fired.is_set()
    # the re-send's remembered answer carries no payload: it was read again, and sent whole
    assert upstream.received[0].json() == {"to": "a@example.com"}


async def test_a_timed_out_admit_that_ran_is_not_reported_as_nothing_dispatched(
    make_gateway: Any, wire: WireProxy, upstream: Upstream
) -> None:
    """The admit ran but its reply came after the Redis timeout. The old gateway answered 503
    'nothing was dispatched' and left the step held until it read unknown, with nothing
    sent. Now the admit is sent again with the same request id: it answers its verdict and
    the call goes on."""
    gw: Gateway = await make_gateway(redis={"url": wire.url, "timeout_seconds": 0.8})
    await register(gw, "r", 1)
    # a first call: the connections and this window's quota counters are read before the
    # held admit, so nothing else of the call can be what times out
    assert (await gw.effect("r", "warm", 1)).status == 200
    held = wire.on_reply_to(b"zz-late-admit", "hold", seconds=2.0)
    resp = await gw.effect("r", "s", 1, worker_id="zz-late-admit")
    assert held.fired.is_set()
    assert resp.status == 200, await resp.text()
    assert len(upstream.received) == 2 and (await record(gw, "s"))["state"] == "succeeded"
    # async: the same, 202 and performed once
    held = wire.on_reply_to(b"zz-late-async", "hold", seconds=2.0)
    resp = await gw.effect("r", "a", 1, worker_id="zz-late-async", headers=ASYNC)
    assert held.fired.is_set()
    assert resp.status == 202, await resp.text()
    await wait_for(gw, "a", {"succeeded"})
    assert len(upstream.received) == 3


async def test_an_admit_given_up_is_released_not_left_unknown(
    make_gateway: Any, wire: WireProxy, upstream: Upstream
) -> None:
    """Redis stops answering right after a sync admit ran: the gateway gives the call up
    (503, nothing sent) and, once Redis answers again, releases the step its admit held —
    known not delivered, never unknown."""
    # 1 s, not less: after the heal every connection is new (a handshake through the wire
    # proxy), and on a loaded 2-core CI machine that alone has taken more than 0.3 s
    gw: Gateway = await make_gateway(
        redis={"url": wire.url, "timeout_seconds": 1.0},
        fencing={"dispatch_timeout_seconds": 2},
    )
    await register(gw, "r", 1)
    stall = wire.on_reply_to(b"zz-given-up", "blackhole")
    resp = await gw.effect("r", "s", 1, worker_id="zz-given-up")
    assert stall.fired.is_set()
    body = await resp.json()
    assert resp.status == 503 and "nothing was sent" in body["detail"], body
    wire.heal()
    await released_then_performed_once(gw, upstream)


async def test_an_admit_whose_request_was_cancelled_releases_the_step(
    make_gateway: Any, wire: WireProxy, upstream: Upstream
) -> None:
    """The request is cancelled while the admit's reply is on its way (the client hung up
    under a server that cancels handlers, a shutdown): the admit ran and holds the step for
    a dispatch that never starts. The gateway gives it up as for a lost reply — released,
    known not delivered — so the worker's retry is performed at once, not told
    ``effect_in_progress`` until the dispatch deadline."""
    gw: Gateway = await make_gateway(
        redis={"url": wire.url}, fencing={"dispatch_timeout_seconds": 30}
    )
    await register(gw, "r", 1)
    held = wire.on_reply_to(b"zz-cancelled", "hold", seconds=1.0)
    body = {"adapter": "hook", "operation": "send", "payload": {"to": "a@example.com"}}
    headers = {**gw.headers, "Fencing-Token": "1", "Worker-Id": "zz-cancelled"}
    call = asyncio.create_task(gw.client.post("/v1/jobs/r/effects/s", json=body, headers=headers))
    await asyncio.wait_for(held.fired.wait(), 10)  # the admit ran; its reply is held
    call.cancel()  # the client hangs up: its connection is closed, the handler cancelled
    with contextlib.suppress(asyncio.CancelledError):
        await call
    await released_then_performed_once(gw, upstream)


async def test_a_queued_step_always_has_a_queue_entry(gw: Gateway, redis_sync: Any) -> None:
    """The queue entry is written by the admit itself, in the step's slot: a pending step
    without an entry (the old code: an async admit that landed after the relay's grace) can
    not exist; a rejected call writes none."""
    await gw.register("r", generation=1)
    keys = JobKeys("default", "r")
    store = gw.app[K.STORE]
    payload = {"to": "a@example.com"}
    verdict = await store.admit(
        keys, "s", generation=1, intent_sha256=intent_digest("hook", "send", payload),
        adapter="hook", operation="send", worker_id="", resolvable=False,
        payload_json=json.dumps(payload),
    )  # fmt: skip
    assert verdict.state == "pending"  # type: ignore[union-attr]
    assert redis_sync.zscore(keys.relayq, keys.member("s")) is not None


async def test_one_tenants_rejected_calls_do_not_delay_another_tenant(
    make_gateway: Any, upstream: Upstream, redis_sync: Any
) -> None:
    """1,500 stale async calls of one tenant filled the one shared relay queue and delayed
    another tenant's effect from 0.05 s to 4.3 s. Rejected calls now write nothing to any
    queue, and the relay takes due steps fairly across tenants."""
    keys = {
        "a-sched": ("scheduler", "a"), "a-work": ("worker", "a"),
        "b-sched": ("scheduler", "b"), "b-work": ("worker", "b"),
    }  # fmt: skip
    auth = {
        "keys": [
            {"role": role, "key_env": f"FG_TEST_{name.upper().replace('-', '_')}",
             "tenant": tenant}
            for name, (role, tenant) in keys.items()
        ]
    }  # fmt: skip
    import os

    for name in keys:
        os.environ[f"FG_TEST_{name.upper().replace('-', '_')}"] = f"secret-{name}"
    gw: Gateway = await make_gateway(auth=auth)

    def h(name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer secret-{name}"}

    async def post(path: str, name: str, **kw: Any) -> Any:
        return await gw.client.post(path, headers={**h(name), **kw.pop("headers", {})}, **kw)

    await post("/v1/jobs/flood/generations", "a-sched", json={"generation": 2})
    await post("/v1/jobs/j/generations", "b-sched", json={"generation": 1})
    body = {"adapter": "hook", "operation": "send", "payload": {"to": "x@example.com"}}
    stale = [
        post(f"/v1/jobs/flood/effects/s{i}", "a-work", json=body,
             headers={"Fencing-Token": "1", **ASYNC})
        for i in range(300)
    ]  # fmt: skip
    results = await asyncio.gather(*stale)
    assert {r.status for r in results} == {409}
    assert redis_sync.keys("fg:rq:*") == [] and redis_sync.keys("fg:relay:*") == []
    ok = await post("/v1/jobs/j/effects/s", "b-work", json=body,
                    headers={"Fencing-Token": "1", **ASYNC})  # fmt: skip
    assert ok.status == 202
    await asyncio.wait_for(upstream.arrived.wait(), 5)
    assert len(upstream.received) == 1


async def test_the_relay_interleaves_tenants(gw: Gateway) -> None:
    """Due steps are taken per tenant and interleaved: a tenant with a backlog does not
    push another tenant's step to the back."""
    store = gw.app[K.STORE]
    later = int(time.time() * 1000) + 3_600_000  # not due yet for the gateway's own relay
    for i in range(50):
        await store.relay_hint(JobKeys("a", f"j{i}"), "s", later - 1000 + i)
    await store.relay_hint(JobKeys("b", "j"), "s", later)
    due = await store.relay_due(later + 1, per_tenant=16)
    tenants = [k.tenant for k, _, _ in due]
    assert tenants[:2] == ["a", "b"] and tenants.count("a") == 16


async def test_an_async_call_during_a_sync_dispatch_is_not_dropped(
    gw: Gateway, upstream: Upstream
) -> None:
    """An async call accepted (202) while a sync dispatch held the step was dropped silently
    when that dispatch ended released. It is now told the step is in progress (409)."""
    await gw.register("r", generation=1)
    upstream.hold()
    upstream.behaviour = 503
    sync = asyncio.create_task(gw.effect("r", "s", 1))
    await upstream.arrived.wait()
    again = await gw.effect("r", "s", 1, headers=ASYNC)
    assert again.status == 409 and (await again.json())["code"] == "effect_in_progress"
    upstream.gate.set()
    await sync


async def test_a_resent_stale_admit_writes_one_audit_entry(
    make_gateway: Any, wire: WireProxy
) -> None:
    """The connection dropped after a stale admit ran; the re-sent admit wrote a second audit
    entry for the one 409 the caller saw."""
    gw: Gateway = await make_gateway(redis={"url": wire.url})
    await gw.register("r", generation=2)
    lost = wire.on_reply_to(b"zz-stale-worker", "lose")
    resp = await gw.effect("r", "s", 1, worker_id="zz-stale-worker")
    assert resp.status == 409
    assert lost.fired.is_set()
    entries = await gw.audit(job="r")
    assert len(entries) == 1 and entries[0]["reason"] == "stale_generation"


async def test_a_succeeded_record_keeps_no_earlier_error(
    make_gateway: Any, flaky_receiver: Receiver
) -> None:
    gw = await flaky_gateway(make_gateway, flaky_receiver)
    await gw.register("r", generation=1)
    assert (await gw.effect("r", "s", 1, adapter="flaky", headers=ASYNC)).status == 202
    await wait_for(gw, "s", {"released"})
    await flaky_receiver.up()
    view = await wait_for(gw, "s", {"succeeded"})
    assert view["error"] is None and view["result"]["status"] == 200


async def test_a_rejected_call_leaves_no_key_without_a_ttl(gw: Gateway, redis_sync: Any) -> None:
    """A rejected call for a job that was never registered wrote the job hash (its audit
    chain head) with no TTL: one worker key could fill Redis with keys that never expire.
    Everything such a call leaves now expires with the audit retention; a registration
    makes the fence permanent."""
    for i in range(20):
        resp = await gw.effect(f"ghost{i}", "s", 7)
        assert resp.status == 409
    keys = [k for k in redis_sync.scan_iter("fg:{*") if "ghost" in k]
    assert keys and all(redis_sync.ttl(k) > 0 for k in keys), {k: redis_sync.ttl(k) for k in keys}
    assert (await gw.register("ghost0", generation=9)).status == 201
    assert redis_sync.ttl("fg:{default/ghost0}:job") == -1


# -- a newer generation, a void, a remembered reply, the feed ---------------------------------


async def test_a_newer_generations_async_call_is_not_accepted_into_an_old_dispatch(
    gw: Gateway, upstream: Upstream
) -> None:
    """Gen 1's relay dispatch is in flight; gen 2 (after a takeover) sends the same async
    call. It was answered 202 'the relay has it' — then gen 1's dispatch ended released, the
    claim found gen 1 below the fence and dropped the step: gen 2's accepted call was never
    performed. It is now told the step is in progress (409) and retries."""
    await gw.register("r", generation=1)
    upstream.hold()
    upstream.behaviour = 429  # known not delivered
    assert (await gw.effect("r", "s", 1, headers=ASYNC)).status == 202
    await upstream.arrived.wait()
    await gw.register("r", generation=2)
    again = await gw.effect("r", "s", 2, headers=ASYNC)
    assert again.status == 409 and (await again.json())["code"] == "effect_in_progress"
    upstream.gate.set()
    await wait_for(gw, "s", {"released"})  # gen 1's attempt: not delivered, then superseded
    upstream.behaviour = "ok"
    ok = await gw.effect("r", "s", 2, headers=ASYNC)
    assert ok.status == 202
    view = await wait_for(gw, "s", {"succeeded"})
    assert view["generation"] == 2
    assert [r.headers["Fencing-Token"] for r in upstream.received] == ["1", "2"]


async def test_a_claim_that_ran_is_voided_when_its_resend_finds_no_connection(
    make_gateway: Any, wire: WireProxy, upstream: Upstream
) -> None:
    """The relay's claim ran; its reply was lost and the re-send found no connection (Redis
    refused new ones for a while). The claim held the step with nothing sent: it must be
    given up in Redis (the step performed later), never left to turn unknown."""
    gw: Gateway = await make_gateway(
        redis={"url": wire.url, "timeout_seconds": 0.5},
        fencing={"dispatch_timeout_seconds": 2},
    )
    await register(gw, "r", 1)
    lost = wire.on_reply_to(b'"default","r","s"]', "lose_and_refuse", seconds=0.6, skip=2)
    assert (await gw.effect("r", "s", 1, headers=ASYNC)).status == 202
    view = await wait_for(gw, "s", {"succeeded", "unknown"})
    assert lost.fired.is_set()
    assert view["state"] == "succeeded", view
    assert len(upstream.received) == 1


async def test_a_void_recognises_an_admit_whose_remembered_reply_expired(
    gw: Gateway, redis_sync: Any
) -> None:
    """Redis was away longer than the request memory: the admit's remembered reply is gone
    when the gateway voids it. The step held under its unique dispatch id still proves it
    ran: the void releases it (it used to write 'voided' and leave the step to turn
    unknown with nothing sent)."""
    await gw.register("r", generation=1)
    keys = JobKeys("default", "r")
    store = gw.app[K.STORE]
    payload = {"to": "a@example.com"}
    verdict = await store.admit(
        keys, "s", generation=1, intent_sha256=intent_digest("hook", "send", payload),
        adapter="hook", operation="send", worker_id="", resolvable=False,
    )  # fmt: skip
    assert isinstance(verdict, Admitted)
    redis_sync.delete(keys.req(verdict.dispatch_id))  # the memory expired
    assert await store.void(keys, "s", verdict.dispatch_id) == "released"
    assert (await record(gw, "s"))["state"] == "released"


async def test_a_lost_feed_reply_does_not_copy_a_rejection_twice(
    make_gateway: Any, wire: WireProxy
) -> None:
    """The tenant feed's copy (XADD with an automatic id) ran, its reply was lost, and the
    auto-pipeline sent it again: two feed entries for one 409. Now the rejecting script copies
    it (its trailer names the feed): the reply lost is the script's, and the script re-sent
    answers from its request memory, copying nothing again."""
    gw: Gateway = await make_gateway(redis={"url": wire.url})
    await gw.register("r", generation=2)
    lost = wire.on_reply_to(b"fg:audit:default", "lose")
    assert (await gw.effect("r", "s", 1)).status == 409
    assert lost.fired.is_set()
    feed = await gw.audit()
    assert [e["reason"] for e in feed] == ["stale_generation"]
