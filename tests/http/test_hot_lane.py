"""The hot lane (``gateway.http.hotlane``): a worker's effect call and heartbeat served
without aiohttp's router answer what the routed path answers, and everything else is routed.

The same call is sent through the lane (its plain path) and through the router (the same
names percent-escaped, or a query string: paths the lane leaves to the application), and the
answers are compared whole: status, body and headers but the two that differ per response
(``Date``, ``X-Request-Id``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from yarl import URL

from gateway.http.hotlane import HotLane, hot_lane_of
from tests.conftest import Gateway, Upstream

BODY = {"adapter": "hook", "operation": "send", "payload": {"to": "a@example.com"}}
PER_RESPONSE = {"date", "x-request-id"}


def lane(gw: Gateway) -> HotLane:
    found = hot_lane_of(gw.app)
    assert found is not None
    return found


async def answer(gw: Gateway, path: str, token: int, body: Any = BODY, **headers: str) -> Any:
    """(status, headers but the per-response ones, body bytes) of one POST."""
    h = {**gw.headers, "Fencing-Token": str(token), **headers}
    resp = await gw.client.post(URL(path, encoded=True), json=body, headers=h)  # as written
    kept = sorted((k, v) for k, v in resp.headers.items() if k.lower() not in PER_RESPONSE)
    return resp.status, kept, await resp.read()


async def test_effect_answers_through_the_lane_are_the_routed_answers(
    gw: Gateway, upstream: Upstream
) -> None:
    await gw.register("j-1", generation=2, lease_ms=60_000)
    served = lane(gw).taken
    first = await answer(gw, "/v1/jobs/j-1/effects/s.1", 2)
    assert first[0] == 200 and lane(gw).taken == served + 1
    assert len(upstream.received) == 1

    replay_lane = await answer(gw, "/v1/jobs/j-1/effects/s.1", 2)
    replay_routed = await answer(gw, "/v1/jobs/j-1/effects/s%2E1", 2)  # "." escaped: routed
    replay_query = await answer(gw, "/v1/jobs/j-1/effects/s.1?via=router", 2)
    assert lane(gw).taken == served + 2  # the escaped and the queried paths were routed
    assert replay_lane[0] == 200 and dict(replay_lane[1])["Idempotent-Replayed"] == "true"
    assert replay_routed == replay_lane and replay_query == replay_lane
    assert len(upstream.received) == 1  # one effect for the four calls

    stale_lane = await answer(gw, "/v1/jobs/j-1/effects/s.1", 1)
    stale_routed = await answer(gw, "/v1/jobs/j%2D1/effects/s.1", 1)
    assert stale_lane[0] == 409 and stale_routed == stale_lane
    assert len(await gw.audit(job="j-1")) == 2  # each audited


async def test_heartbeat_through_the_lane_is_the_routed_heartbeat(gw: Gateway) -> None:
    await gw.register("hb", generation=1, lease_ms=60_000)
    served = lane(gw).taken
    through_lane = await answer(gw, "/v1/jobs/hb/fence", 1, body=None)
    routed = await answer(gw, "/v1/jobs/h%62/fence", 1, body=None)
    assert through_lane[0] == routed[0] == 200
    assert lane(gw).taken == served + 1
    # the lease's expiry moves with the clock; the rest of the answer is the same
    lane_body, routed_body = (json.loads(a[2]) for a in (through_lane, routed))
    assert lane_body.pop("lease_expires_at") and routed_body.pop("lease_expires_at")
    assert lane_body == routed_body and through_lane[1] == routed[1]


@pytest.mark.parametrize(
    ("method", "path", "headers"),
    [
        ("GET", "/v1/jobs/j/effects/s", {}),  # another method: the record's read
        ("POST", "/v1/jobs/j/effects/s/resolve", {}),  # a longer path
        ("POST", "/v1/jobs/j/effects/", {}),  # an empty name
        ("POST", "/v1/jobs/j/effects/s", {"Expect": "100-continue"}),  # the router's expect
        ("POST", "/v1/jobs/" + "j" * 129 + "/effects/s", {}),  # not a name: the router's 400
        ("POST", "/v1/jobs/.j/effects/s", {}),
    ],
)
async def test_the_lane_leaves_every_other_request_to_the_router(
    gw: Gateway, method: str, path: str, headers: dict[str, str]
) -> None:
    served = lane(gw).taken
    h = {**gw.headers, "Fencing-Token": "1", **headers}
    resp = await gw.client.request(method, path, json=BODY, headers=h)
    await resp.read()
    assert resp.status != 500
    assert lane(gw).taken == served


async def test_a_laned_call_is_counted_under_its_route(gw: Gateway) -> None:
    await gw.register("m", generation=1, lease_ms=60_000)
    served = lane(gw).taken
    for _ in range(3):
        assert (await gw.effect("m", "s", 1)).status == 200
    assert lane(gw).taken == served + 3
    text = await (await gw.client.get("/metrics")).text()
    label = 'route="/v1/jobs/{job}/effects/{step}"'
    counts = [line for line in text.splitlines() if label in line and "_count" in line]
    assert counts and float(counts[0].rsplit(" ", 1)[1]) >= 3
