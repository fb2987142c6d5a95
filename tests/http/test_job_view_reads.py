"""A job view never loads the stored async payloads (were it to, 278 steps of 240 KB
would take the gateway from 113 to 371 MB).

Measured on the Redis side, with no timing: ``INFO stats`` ``total_net_output_bytes`` is
every byte Redis sent to any client, so what a job view costs is the difference around it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.http import appkeys as K
from tests.conftest import Gateway

STEPS, CHUNK, STRINGS = 12, 60_000, 3  # each payload: 3 strings of 60 KB (~180 KB)


def _sent(redis_sync: Any) -> int:
    return int(redis_sync.info("stats")["total_net_output_bytes"])


async def _queue_payloads(gw: Gateway, job: str) -> None:
    gw.app[K.SERVICE].relay.stop()  # nothing delivers them: the payloads stay stored
    await asyncio.sleep(0.5)
    await gw.register(job, generation=1)
    for i in range(STEPS):
        payload = {f"part{n}": chr(97 + n) * CHUNK for n in range(STRINGS)}
        resp = await gw.effect(
            job, f"s{i}", 1, payload=payload, headers={"Prefer": "respond-async"}
        )
        assert resp.status == 202, await resp.text()


async def test_job_views_never_read_the_stored_payloads(gw: Gateway, redis_sync: Any) -> None:
    await _queue_payloads(gw, "bulk")
    stored = sum(
        len(redis_sync.hget(f"fg:{{default/bulk}}:fx:s{i}", "payload") or "") for i in range(STEPS)
    )
    assert stored > STEPS * CHUNK * STRINGS  # the payloads are there, in Redis

    before = _sent(redis_sync)
    views = await asyncio.gather(*(gw.client.get("/v1/jobs/bulk") for _ in range(4)))
    bodies = [await v.json() for v in views]
    step = await gw.client.get("/v1/jobs/bulk/effects/s0")
    assert step.status == 200
    page = await gw.client.get("/console/jobs/bulk")  # open mode: no login on loopback
    assert page.status == 200 and "s11" in await page.text()
    spent = _sent(redis_sync) - before

    for body in bodies:
        assert sorted(body["effects"]) == sorted(f"s{i}" for i in range(STEPS))
        assert {e["state"] for e in body["effects"].values()} == {"pending"}
    # six views of a job holding ~2 MB of payloads: a few KB of records each, never a payload
    assert spent < CHUNK, f"Redis sent {spent} bytes for six views ({stored} bytes stored)"
