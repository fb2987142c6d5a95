"""`Prefer` on an effect call is parsed as RFC 7240 tokens: only the `respond-async`
preference sends a call to the relay (202); look-alikes are performed now (200)."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from tests.conftest import Gateway, Upstream
from tests.support.docs import docs_text

BODY = {"adapter": "hook", "operation": "send", "payload": {"to": "a@example.com"}}


async def call(gw: Gateway, prefer: list[str]) -> int:
    headers = CIMultiDict([("Fencing-Token", "1"), *(("Prefer", v) for v in prefer)])
    resp = await gw.client.post("/v1/jobs/p/effects/s", json=BODY, headers=headers)
    body = await resp.json()
    if resp.status == 202:
        assert resp.headers["Preference-Applied"] == "respond-async"
        assert body["state"] in ("pending", "dispatching")
    else:
        assert resp.status == 200, body
        assert "Preference-Applied" not in resp.headers
    return resp.status


@pytest.mark.parametrize(
    "prefer",
    [
        ["no-respond-async"],
        ["respond-async-x"],
        ["return=minimal; respond-async-x"],
        ['handling=lenient; note="respond-async"'],
    ],
)
async def test_look_alikes_of_respond_async_are_performed_now(
    gw: Gateway, upstream: Upstream, prefer: list[str]
) -> None:
    assert (await gw.register("p", generation=1)).status == 201
    assert await call(gw, prefer) == 200
    assert len(upstream.received) == 1


@pytest.mark.parametrize(
    "prefer",
    [
        ["respond-async"],
        ["RESPOND-ASYNC"],
        ["respond-async, wait=10"],
        ["wait=10", "respond-async"],  # a second Prefer header line
        ["return=minimal", "Respond-Async; x=1"],
    ],
)
async def test_the_respond_async_preference_goes_to_the_relay(
    gw: Gateway, prefer: list[str]
) -> None:
    assert (await gw.register("p", generation=1)).status == 201
    assert await call(gw, prefer) == 202


def test_the_readme_names_the_cases_tested_here() -> None:

    readme = docs_text()
    section = readme.split("### Prefer: respond-async", 1)[1].split("\n## ", 1)[0]
    flat = " ".join(section.split())
    for case in ("respond-async, wait=10", "RESPOND-ASYNC", "no-respond-async",
                 "respond-async-x", "return=minimal; respond-async-x"):  # fmt: skip
        assert f"`{case}`" in flat, case
    assert "Only the `respond-async` preference sends a call to the relay (202)" in flat
    assert "those calls are performed at once (200)" in flat
