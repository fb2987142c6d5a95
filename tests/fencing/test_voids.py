"""Admits the gateway gave up (their reply never came): a copy of one that reaches Redis late
never claims the step (admit-8's "run before", void-5's mark; docs/reliability.md)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

from gateway.core.intents import intent_digest
from gateway.core.records import Admitted
from gateway.http import appkeys as K
from gateway.store.keys import JobKeys
from gateway.store.scripts import lua_source
from tests.conftest import Gateway, Upstream
from tests.support.wire import Fault, WireProxy

ADMIT_SHA = hashlib.sha1(lua_source("admit-8").encode(), usedforsecurity=False).hexdigest()


async def register(gw: Gateway, job: str, generation: int) -> None:
    for _ in range(20):  # a 503 through a short Redis timeout changed nothing: again
        resp = await gw.register(job, generation=generation)
        if resp.status in (200, 201):
            return
        assert resp.status == 503, await resp.text()
    raise AssertionError("the registration never answered")


async def test_an_admit_held_on_the_wire_past_the_request_memory_does_not_claim_the_step(
    make_gateway: Any, wire: WireProxy, upstream: Upstream
) -> None:
    """Both sends of an admit are held on the wire 8 s; the gateway gives the
    call up (503) and voids it; the void's mark outlives the request memory (5 s) only up to
    the admit's bound. The held copies reach Redis after it: they do nothing (before, the
    first ran as a fresh admit under a dispatch id nobody uses, and the worker's retries got
    409 effect_in_progress, then the step read unknown with nothing sent)."""
    gw: Gateway = await make_gateway(
        redis={
            "url": f"redis://127.0.0.1:{wire.port}",
            "timeout_seconds": 0.5,
            "request_memory_seconds": 5,
        },
        fencing={"dispatch_timeout_seconds": 2},
    )
    await register(gw, "r", 1)
    for _ in range(2):  # the send and its re-send (same request id)
        wire.arm(Fault("hold_request", ADMIT_SHA.encode(), hold=8.0), within=5.0)
    given_up = await gw.effect("r", "s", 1)
    assert given_up.status == 503, await given_up.text()
    assert len(wire.hits) == 2
    # both copies reach Redis 8 s after they were held: past the request memory
    await asyncio.sleep(wire.hits[-1].hit_at + 8.0 - time.monotonic() + 0.3)
    assert not wire.held
    view = await gw.client.get("/v1/jobs/r/effects/s")
    assert view.status == 404, await view.text()  # nothing ran: no step record at all
    retry = await gw.effect("r", "s", 1)
    assert retry.status == 200, await retry.text()
    assert len(upstream.received) == 1
    done = await gw.client.get("/v1/jobs/r/effects/s")
    assert (await done.json())["state"] == "succeeded"


async def test_an_admit_refused_because_this_hosts_clock_is_behind_redis_is_sent_again(
    gw: Gateway,
) -> None:
    """The admit's bound is this process's estimate of Redis's clock plus the request memory.
    An estimate an hour behind puts the bound in the past: the script refuses ({11}, with
    Redis's time), the store learns the clock from that reply and sends the admit once more
    with a fresh bound; the caller sees an ordinary admission, not a 503."""
    await gw.register("r", generation=1)
    store = gw.app[K.STORE]
    store.clock_at(int(time.time() * 1000) - 3_600_000)  # as if Redis ran an hour behind
    payload = {"to": "a@example.com"}
    verdict = await store.admit(
        JobKeys("default", "r"), "s", generation=1,
        intent_sha256=intent_digest("hook", "send", payload), adapter="hook", operation="send",
        worker_id="", resolvable=False,
    )  # fmt: skip
    assert isinstance(verdict, Admitted)
    assert abs(store.redis_clock_ms() - time.time() * 1000) < 60_000  # learnt from the reply
