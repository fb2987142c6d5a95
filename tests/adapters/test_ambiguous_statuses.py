"""Ambiguous statuses: a proxy's 502/503/504 can come after the receiver processed
the request, so they are `unknown` — never `released` and re-sent to a downstream that does
not deduplicate. Real loopback servers: a receiver that applies effects, and a reverse proxy
in front of it that answers 503 when the receiver resets the connection after reading the
request (what Envoy answers: "upstream connect error or disconnect/reset before headers")."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from adapters.registry import AdapterConfigError
from tests.adapters.test_stripe_jira import code, ticket
from tests.conftest import Gateway, Upstream
from tests.support.calls import problem
from tests.support.docs import docs_text
from tests.support.peers import JiraPeer, serving

README = docs_text()


@dataclass
class Receiver:
    """Applies every effect it reads (``applied``); ``dedupes`` answers a known key with the
    first result instead. ``reset_after_processing``: the first N requests are processed,
    then the connection is reset before any answer."""

    dedupes: bool = False
    reset_after_processing: int = 0
    applied: list[str] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        key = request.headers["Idempotency-Key"]
        self.seen.append(key)
        if not (self.dedupes and key in self.results):
            self.applied.append(key)
            self.results[key] = {"effect": len(self.applied)}
        if self.reset_after_processing:
            self.reset_after_processing -= 1
            assert request.transport is not None
            request.transport.abort()  # processed, then gone before the answer
            await asyncio.sleep(3600)
        return web.json_response(self.results[key])


@dataclass
class Proxy:
    """A reverse proxy on loopback: forwards the request; when the upstream resets after the
    request was sent, answers 503 (Envoy's behaviour), or ``status_on_reset``."""

    target: str
    status_on_reset: int = 503
    forwarded: int = 0
    url: str = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host",)}
        self.forwarded += 1
        async with aiohttp.ClientSession() as session:
            try:
                async with session.post(self.target, data=body, headers=headers) as resp:
                    return web.Response(body=await resp.read(), status=resp.status,
                                        content_type=resp.content_type)  # fmt: skip
            except aiohttp.ClientError:
                text = "upstream connect error or disconnect/reset before headers"
                return web.Response(text=text, status=self.status_on_reset)


async def serve(handler: Any) -> tuple[TestServer, str]:
    app = web.Application()
    app.router.add_post("/{tail:.*}", handler)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    return server, str(server.make_url("/hook"))


@pytest.fixture
async def chain() -> AsyncIterator[tuple[Receiver, Proxy]]:
    receiver = Receiver()
    rserver, rurl = await serve(receiver.handle)
    proxy = Proxy(rurl)
    pserver, purl = await serve(proxy.handle)
    proxy.url = purl
    yield receiver, proxy
    await pserver.close()
    await rserver.close()


async def hook_gateway(make_gateway: Any, proxy: Proxy, **config: Any) -> Gateway:
    gw: Gateway = await make_gateway(
        adapters={"hook": {"type": "webhook", "url": proxy.url, "timeout_seconds": 2, **config}}
    )
    assert (await gw.register("r", generation=1)).status == 201
    return gw


async def test_a_proxy_503_after_processing_is_not_applied_twice_at_a_plain_webhook(
    make_gateway: Any, chain: tuple[Receiver, Proxy]
) -> None:
    receiver, proxy = chain
    receiver.reset_after_processing = 1
    gw = await hook_gateway(make_gateway, proxy)
    body = await problem(await gw.effect("r", "pay", 1), 504, "outcome_unknown")
    assert body["state"] == "unknown"
    assert receiver.applied == ["r:pay"]  # the receiver did it; the proxy said 503
    # the worker retries, a new generation takes over and retries: never sent again
    await problem(await gw.effect("r", "pay", 1), 409, "outcome_unknown")
    assert (await gw.register("r", generation=2)).status == 201
    await problem(await gw.effect("r", "pay", 2), 409, "outcome_unknown")
    view = await (await gw.client.get("/v1/jobs/r/effects/pay")).json()
    assert view["state"] == "unknown" and "503" in view["error"]["reason"]
    assert receiver.applied == ["r:pay"] and proxy.forwarded == 1


async def test_a_proxy_503_at_a_plain_webhook_is_not_retried_by_the_relay(
    make_gateway: Any, chain: tuple[Receiver, Proxy]
) -> None:
    receiver, proxy = chain
    receiver.reset_after_processing = 1
    gw = await hook_gateway(make_gateway, proxy)
    resp = await gw.effect("r", "pay", 1, headers={"Prefer": "respond-async"})
    assert resp.status == 202
    for _ in range(100):
        view = await (await gw.client.get("/v1/jobs/r/effects/pay")).json()
        if view["state"] not in ("pending", "dispatching"):
            break
        await asyncio.sleep(0.05)
    assert view["state"] == "unknown"
    await asyncio.sleep(1.5)  # the relay retries released steps every second: this one is not
    assert receiver.applied == ["r:pay"] and proxy.forwarded == 1


async def test_a_proxy_503_is_resent_under_the_same_key_to_a_deduplicating_webhook(
    make_gateway: Any, chain: tuple[Receiver, Proxy]
) -> None:
    receiver, proxy = chain
    receiver.reset_after_processing = 1
    receiver.dedupes = True
    gw = await hook_gateway(make_gateway, proxy, dedupes_by_key=True)
    await problem(await gw.effect("r", "pay", 1), 504, "outcome_unknown")
    ok = await gw.effect("r", "pay", 1)  # resolved by re-sending under the same key
    assert ok.status == 200, await ok.text()
    assert (await ok.json())["result"]["body"] == {"effect": 1}
    assert receiver.seen == ["r:pay", "r:pay"] and receiver.applied == ["r:pay"]
    again = await gw.effect("r", "pay", 1)
    assert again.status == 200 and (await again.json())["replayed"] is True
    assert len(receiver.seen) == 2


async def test_not_delivered_statuses_is_a_deployment_decision(
    make_gateway: Any, chain: tuple[Receiver, Proxy]
) -> None:
    """A deployment that lists 503 says its 503s never follow processing: then a 503
    releases the step and a retry sends the effect again — here that is a duplicate, which is
    why it is not the default."""
    receiver, proxy = chain
    receiver.reset_after_processing = 1
    gw = await hook_gateway(make_gateway, proxy, not_delivered_statuses=[429, 503])
    body = await problem(await gw.effect("r", "pay", 1), 502, "adapter_unavailable")
    assert body["state"] == "released"
    assert (await gw.effect("r", "pay", 1)).status == 200
    assert receiver.applied == ["r:pay", "r:pay"]


@pytest.mark.parametrize("statuses", [[200], [302], [99], [600]])
async def test_not_delivered_statuses_only_takes_error_statuses(
    make_gateway: Any, statuses: list[int]
) -> None:
    with pytest.raises(AdapterConfigError, match=r"not_delivered_statuses: .*only 4xx and 5xx"):
        await make_gateway(
            adapters={
                "hook": {
                    "type": "webhook",
                    "url": "http://127.0.0.1:9/hook",
                    "not_delivered_statuses": statuses,
                }
            }
        )


# The README's webhook table, row by row, and what each row promises.
WEBHOOK_ROWS = {
    "| 2xx | delivered → `succeeded` |": [(200, 200, "succeeded"), (201, 200, "succeeded")],
    "| a status in `not_delivered_statuses` (default: 429) | not delivered → `released`, 502 |": [
        (429, 502, "released")
    ],
    "| other 4xx, 3xx | failed → `failed`, 424 |": [
        (400, 424, "failed"),
        (409, 424, "failed"),
        (302, 424, "failed"),
    ],
    "| 500, 502, 503, 504 and other 5xx (a proxy may answer them after forwarding) "
    "| unknown → `unknown`, 504 |": [
        (500, 504, "unknown"),
        (502, 504, "unknown"),
        (503, 504, "unknown"),
        (504, 504, "unknown"),
        (599, 504, "unknown"),
    ],
}


@pytest.mark.parametrize(
    ("row", "status", "answer", "state"),
    [(row, *case) for row, cases in WEBHOOK_ROWS.items() for case in cases],
    ids=[str(case[0]) for cases in WEBHOOK_ROWS.values() for case in cases],
)
async def test_webhook_statuses_are_classified_as_the_readme_says(
    gw: Gateway, upstream: Upstream, row: str, status: int, answer: int, state: str
) -> None:
    assert row in README
    await gw.register("r", generation=1)
    upstream.behaviour = "ok" if status == 200 else status
    resp = await gw.effect("r", "s", 1)
    assert resp.status == answer, await resp.text()
    view = await (await gw.client.get("/v1/jobs/r/effects/s")).json()
    assert view["state"] == state
    retry = await gw.effect("r", "s", 1)
    sent_again = {"released": True}.get(state, False)
    assert len(upstream.received) == (2 if sent_again else 1), retry.status
    assert Counter(r.headers["Idempotency-Key"] for r in upstream.received) == {
        "r:s": len(upstream.received)
    }


# -- jira: a 503 after Jira created the issue --------------------------------------


@pytest.fixture
async def jgw(make_gateway: Any, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    async with serving(JiraPeer()) as peer:
        monkeypatch.setenv("TEST_JIRA_USER", peer.user)
        monkeypatch.setenv("TEST_JIRA_TOKEN", peer.token)
        gw: Gateway = await make_gateway(
            adapters={
                "tickets": {
                    "type": "jira",
                    "base_url": peer.url,
                    "project": "OPS",
                    "user_env": "TEST_JIRA_USER",
                    "api_key_env": "TEST_JIRA_TOKEN",
                    "timeout_seconds": 1,
                }
            }
        )
        await gw.register("r", generation=1)
        yield gw, peer


async def test_a_jira_503_after_the_issue_was_created_files_one_ticket(jgw: Any) -> None:
    gw, jira = jgw
    jira.mode = "503_after_create"
    assert await code(await ticket(gw)) == (504, "outcome_unknown")
    jira.mode = "ok"
    resp = await ticket(gw)  # resolved by lookup: the labelled issue is found
    assert resp.status == 200 and (await resp.json())["result"]["key"] == "OPS-1"
    assert len(jira.issues) == 1
