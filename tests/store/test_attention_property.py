"""Property: over random sequences of verdicts on several steps (the real scripts, a real
Redis), the slot's "needs a decision" index always matches the records, and after a
reconcile the listing is exactly the steps that need a decision.

The model checker (tests/model, I-index) explores every interleaving with faults for two
or three actors on one step; this mixes more steps and operations at random, the store's
API as the service calls it, including voids, relay claims and operator resolutions.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.core.errors import EffectNotUnknown, NotFound
from gateway.core.records import Admitted, Queued, RelayClaim
from gateway.store.keys import JobKeys, attention_hint
from gateway.store.store import Store

pytestmark = pytest.mark.slow

STEPS = ("s1", "s2")  # two steps: the same step meets several verdicts more often
DISPATCH_MS = 60  # short: a "wait" lets deadlines pass for real
_jobs = itertools.count()

ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.sampled_from(STEPS), st.sampled_from(["sync", "async"])),
        st.tuples(
            st.just("record"),
            st.sampled_from(STEPS),
            st.sampled_from(["succeeded", "failed", "unknown", "released"]),
        ),
        st.tuples(st.just("claim"), st.sampled_from(STEPS)),
        st.tuples(st.just("void"), st.sampled_from(STEPS)),
        st.tuples(st.just("resolve"), st.sampled_from(STEPS), st.booleans()),
        st.tuples(st.just("wait")),
        st.tuples(st.just("drop_hints")),  # a crash after the verdicts, before their hints
    ),
    max_size=12,
)


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[Store]:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    s = Store(
        client, registration="required", dispatch_timeout_ms=DISPATCH_MS, retention_seconds=600
    )
    await s.load_scripts()
    await s.initialize(auto=True)
    yield s
    await s.aclose()
    await client.aclose()


async def check_truth(s: Store, keys: JobKeys) -> None:
    """The slot's index holds exactly the unknown and dispatching steps (at their deadline)."""
    c = s.link.client
    rows = await c.zrange(keys.attention, 0, -1, withscores=True)
    # the slot's index also holds other jobs that hash to the same slot
    mine = [(json.loads(m), sc) for m, sc in rows]
    index = {m[2]: sc for m, sc in mine if m[:2] == [keys.tenant, keys.job_id]}
    want: dict[str, float | None] = {}
    for step in STEPS:
        h = await c.hgetall(keys.effect(step))
        if h.get("state") == "unknown":
            want[step] = None
        elif h.get("state") == "dispatching":
            want[step] = float(h["deadline"])
    assert set(index) == set(want), (index, want)
    for step, deadline in want.items():
        if deadline is not None:
            assert index[step] == deadline, (step, index[step], deadline)


async def needing(s: Store, keys: JobKeys) -> set[str]:
    seconds, micros = await s.link.client.time()
    now = int(seconds) * 1000 + int(micros) // 1000
    out = set()
    for step in STEPS:
        h = await s.link.client.hgetall(keys.effect(step))
        if h.get("state") == "unknown" or (
            h.get("state") == "dispatching" and int(h["deadline"]) <= now
        ):
            out.add(step)
    return out


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(program=ops)
async def test_index_follows_every_verdict_and_the_listing_after_a_reconcile(
    store: Store, program: list[tuple[Any, ...]]
) -> None:
    tenant = f"h{next(_jobs)}"  # a fresh tenant per example: nothing left from the last one
    keys = JobKeys(tenant, "job")
    await store.register(keys, 1, None)
    held: dict[str, str] = {}  # step -> the dispatch id that holds it (or held it)
    for op in program:
        kind, step = op[0], (op[1] if len(op) > 1 else "")
        if kind == "admit":
            v = await store.admit(
                keys, step, generation=1, intent_sha256="0" * 64, adapter="hook",
                operation="send", worker_id="w", resolvable=False,
                payload_json='{"a":1}' if op[2] == "async" else "",
            )  # fmt: skip
            if isinstance(v, Admitted):
                held[step] = v.dispatch_id
            assert not isinstance(v, Queued) or v.state in ("pending", "dispatching")
        elif kind == "record" and step in held:
            await store.record(keys, step, held[step], op[2])
        elif kind == "claim":
            c = await store.relay_claim(keys, step)
            if isinstance(c, RelayClaim):
                held[step] = c.dispatch_id
        elif kind == "void" and step in held:
            await store.void(keys, step, held[step])
        elif kind == "resolve":
            with contextlib.suppress(EffectNotUnknown, NotFound):
                await store.resolve(
                    keys, step, delivered=op[2], result=None, operator="op", by="op"
                )
        elif kind == "wait":
            await asyncio.sleep(DISPATCH_MS * 1.5 / 1000)
        elif kind == "drop_hints":
            await store.link.client.delete(attention_hint(tenant))
        await check_truth(store, keys)
        # the listing never shows a step its record does not confirm
        listed = {i["step"] for i in await store.attention(tenant, limit=10)}
        assert listed <= await needing(store, keys), (op, listed)
    # every deadline passes; then one reconcile: the listing is exactly what needs a decision
    await asyncio.sleep(DISPATCH_MS * 1.5 / 1000)
    await store.reconcile_attention()
    listed = {i["step"] for i in await store.attention(tenant, limit=10)}
    assert listed == await needing(store, keys)
