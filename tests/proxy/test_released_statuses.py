"""``released_statuses``: a 4xx the upstream documents as "not performed" releases the step
(a later call sends it again, under the same key) instead of failing it; the call that got it
gets the upstream's answer as it came."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.runtime.settings import ConfigError
from tests.conftest import Gateway
from tests.support.proxying import KEYS, Receiver, auth, fenced, register, upstreams


async def state(g: Gateway, job: str, step: str) -> str:
    resp = await g.client.get(
        f"/v1/jobs/{job}/effects/{step}", headers={"Authorization": f"Bearer {KEYS['audit']}"}
    )
    body: dict[str, Any] = await resp.json()
    return str(body["state"])


async def test_a_released_status_is_answered_as_sent_and_the_step_sent_again(
    make_gateway: Any, receiver: Receiver, secrets: None
) -> None:
    g: Gateway = await make_gateway(
        auth=auth(), upstreams=upstreams(receiver.url, released_statuses=[409, 429])
    )
    gen = await register(g, "r")
    receiver.statuses = [429, 409]
    h = fenced("r", "charge", gen)
    for status in (429, 409):
        resp = await g.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)
        assert resp.status == status, await resp.text()
        assert resp.headers["Fencegate-Outcome"] == "forwarded"
        assert resp.headers["Request-Id"] == f"req_{len(receiver.seen)}"  # the upstream's
        assert (await resp.json())["n"] == len(receiver.seen)
        assert await state(g, "r", "charge") == "released"
    done = await g.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)
    assert done.status == 200
    assert done.headers["Fencegate-Outcome"] == "forwarded"  # sent again, not a replay
    assert await state(g, "r", "charge") == "succeeded"
    assert [s.headers["Idempotency-Key"] for s in receiver.seen] == ["acme/r:charge"] * 3


async def test_another_4xx_still_fails_the_step(
    make_gateway: Any, receiver: Receiver, secrets: None
) -> None:
    g: Gateway = await make_gateway(
        auth=auth(), upstreams=upstreams(receiver.url, released_statuses=[429])
    )
    gen = await register(g, "r")
    receiver.statuses = [409]
    h = fenced("r", "charge", gen)
    assert (await g.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)).status == 409
    again = await g.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)
    assert again.headers["Fencegate-Outcome"] == "replayed"
    assert await state(g, "r", "charge") == "failed"
    assert len(receiver.seen) == 1


async def test_a_released_answer_over_the_cap_is_not_streamed_and_says_adapter_unavailable(
    make_gateway: Any, receiver: Receiver, secrets: None
) -> None:
    g: Gateway = await make_gateway(
        auth=auth(),
        upstreams=upstreams(receiver.url, released_statuses=[429], max_response_bytes=8),
    )
    gen = await register(g, "r")
    receiver.statuses = [429]
    resp = await g.client.post("/proxy/pay/v1/charges", data=b"x", headers=fenced("r", "c", gen))
    assert resp.status == 502
    assert (await resp.json())["code"] == "adapter_unavailable"
    assert resp.headers["X-Should-Retry"] == "true"  # released: a retry sends it again
    assert await state(g, "r", "c") == "released"


@pytest.mark.parametrize("status", [200, 302, 500, 503, 99])
async def test_only_4xx_statuses_may_be_released(
    make_gateway: Any, receiver: Receiver, secrets: None, status: int
) -> None:
    with pytest.raises(ConfigError, match=r"upstreams\.pay\.released_statuses"):
        await make_gateway(
            auth=auth(), upstreams=upstreams(receiver.url, released_statuses=[status])
        )
