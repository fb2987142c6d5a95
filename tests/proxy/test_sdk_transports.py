"""The SDK's transports (gateway.client.httpx_transport, .requests_adapter): unmodified call
sites to an upstream's own URL, sent through the in-process gateway's proxy to a real
receiver as steps of the current ``with job.step()``."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import requests

from gateway.client import FencedJob, InvalidRequest, StaleGeneration, SyncFencedJob
from gateway.client.httpx_transport import AsyncFencegateTransport, FencegateTransport
from gateway.client.proxying import FencedStep, current_step
from gateway.client.requests_adapter import FencegateAdapter
from tests.conftest import Gateway
from tests.support.proxying import KEYS, SECRETS, Receiver, auth, register, upstreams

# test_proxy's receiver, its secrets in the environment and its gateway (upstream "pay")

PARTNER = "https://pay.partner.example/api"  # the upstream's own base URL, as the code has it
CHARGES = PARTNER + "/v1/charges"
BODY = {"to": "customer@example.com", "amount": 5}


def gateway_url(g: Gateway) -> str:
    return str(g.client.make_url("/")).rstrip("/")


class Clients:
    """Each kind of client, mounted on the partner's URL; ``post`` runs the call site inside
    ``with job.step(step)`` (a sync client in a thread, which keeps the step)."""

    def __init__(self, g: Gateway, receiver: Receiver, kind: str) -> None:
        self.kind, self.g, self.receiver = kind, g, receiver
        self.sync = kind != "httpx-async"
        self.jobs: list[Any] = []
        route = {"base_url": PARTNER, "api_key": KEYS["acme"]}
        if kind == "httpx-async":
            self.async_http = httpx.AsyncClient(
                mounts={"https://pay.partner.example": AsyncFencegateTransport(
                    gateway_url(g), "pay", **route)},
                timeout=10,
            )  # fmt: skip
        elif kind == "httpx-sync":
            self.sync_http = httpx.Client(
                mounts={"https://pay.partner.example": FencegateTransport(
                    gateway_url(g), "pay", **route)},
                timeout=10,
            )  # fmt: skip
        else:
            self.session = requests.Session()
            self.session.mount(
                "https://pay.partner.example/", FencegateAdapter(gateway_url(g), "pay", **route)
            )

    def job(self, gen: int) -> Any:
        """A worker's hold on job "r" (heartbeats off: the test drives the timeline)."""
        cls = SyncFencedJob if self.sync else FencedJob
        made = cls(gateway_url(self.g), "r", gen, api_key=KEYS["acme"], heartbeat_interval=None)
        self.jobs.append(made)
        return made

    async def aclose(self) -> None:
        if self.kind == "httpx-async":
            await self.async_http.aclose()
        elif self.kind == "httpx-sync":
            self.sync_http.close()
        else:
            self.session.close()
        for job in self.jobs:
            if self.sync:
                job.close()
            else:
                await job.aclose()

    async def post(self, job: Any, step: str, url: str = CHARGES) -> tuple[int, Any, Any]:
        """The call site, unchanged, inside ``with job.step(step)``."""
        if self.kind == "httpx-async":
            with job.step(step):
                r = await self.async_http.post(url, json=BODY)
            return r.status_code, r.json(), r.headers

        def call() -> tuple[int, Any, Any]:
            with job.step(step):
                if self.kind == "httpx-sync":
                    r = self.sync_http.post(url, json=BODY)
                    return r.status_code, r.json(), r.headers
                s = self.session.post(url, json=BODY, timeout=10)
                return s.status_code, s.json(), s.headers

        return await asyncio.to_thread(call)

    async def post_with_headers(self, headers: dict[str, str]) -> tuple[int, Any, Any]:
        """The call site with the step's headers written out, outside any ``job.step()``."""
        if self.kind == "httpx-async":
            r = await self.async_http.post(CHARGES, json=BODY, headers=headers)
            return r.status_code, r.json(), r.headers
        if self.kind == "httpx-sync":
            r = await asyncio.to_thread(self.sync_http.post, CHARGES, json=BODY, headers=headers)
            return r.status_code, r.json(), r.headers
        s = await asyncio.to_thread(self.session.post, CHARGES, json=BODY, headers=headers)
        return s.status_code, s.json(), s.headers


@pytest.fixture(params=["httpx-async", "httpx-sync", "requests"])
async def clients(
    gw: Gateway, receiver: Receiver, request: pytest.FixtureRequest
) -> AsyncIterator[Clients]:
    c = Clients(gw, receiver, request.param)
    yield c
    await c.aclose()


async def test_pause_takeover_resume_through_the_sdk_transports_is_one_effect(
    clients: Clients,
) -> None:
    """The seed's timeline, the call site unchanged (the partner's own URL), an upstream that
    does not dedupe: A holds generation 1 and stalls mid-call; B takes over as 2; A resumes."""
    gw, receiver = clients.g, clients.receiver
    a = clients.job(await register(gw, "r"))
    receiver.hold()  # A's request reaches the upstream, whose answer stalls
    a_first = asyncio.create_task(clients.post(a, "notify"))
    await asyncio.wait_for(receiver.arrived.wait(), 5)
    b = clients.job(await register(gw, "r"))  # the lease ran out: B is generation 2
    status, body, headers = await clients.post(b, "notify")
    assert (status, body["code"]) == (409, "effect_in_progress")  # A's dispatch holds the step
    assert headers["X-Should-Retry"] == "true"
    receiver.gate.set()
    status, a_answer, headers = await a_first  # admitted before the takeover: it happened
    assert (status, headers["Fencegate-Outcome"]) == (200, "forwarded")
    status, b_answer, headers = await clients.post(b, "notify")
    assert (status, headers["Fencegate-Outcome"]) == (200, "replayed")  # B gets it back
    assert b_answer == a_answer
    status, body, _ = await clients.post(a, "notify")
    assert (status, body["code"]) == (409, "stale_generation")
    status, body, _ = await clients.post(a, "notify-2")
    assert (status, body["code"]) == (409, "stale_generation")  # and no new step either
    [seen] = receiver.seen  # one effect
    assert seen.path_qs == "/api/v1/charges"
    assert seen.headers["Idempotency-Key"] == "acme/r:notify"
    assert seen.headers["Authorization"] == f"Bearer {SECRETS['PAY_ACME']}"
    for kept_out in ("Fencing-Token", "Fencegate-Job", "Fencegate-Step"):
        assert kept_out not in seen.headers


async def test_a_call_outside_a_step_or_the_route_is_refused_before_anything_is_sent(
    clients: Clients,
) -> None:
    job = clients.job(await register(clients.g, "r"))

    async def unstepped() -> None:
        if clients.kind == "httpx-async":
            await clients.async_http.post(CHARGES, json=BODY)
        elif clients.kind == "httpx-sync":
            await asyncio.to_thread(clients.sync_http.post, CHARGES, json=BODY)
        else:
            await asyncio.to_thread(clients.session.post, CHARGES, json=BODY)

    with pytest.raises(InvalidRequest, match="needs a step"):
        await unstepped()
    assert clients.receiver.seen == []
    named = FencedStep(job, "notify").headers()  # the headers a client writes itself
    assert current_step() is None
    status, _, _ = await clients.post_with_headers(named)  # no step current: sent as written
    assert status == 200 and len(clients.receiver.seen) == 1
    clients.receiver.seen.clear()
    with pytest.raises(InvalidRequest, match="is not under"):  # a sibling path, not the base
        await clients.post(job, "notify", url="https://pay.partner.example/api-v2/charges")
    assert clients.receiver.seen == []
    status, _, _ = await clients.post(job, "other")  # the same client, inside a step: sent
    assert status == 200 and len(clients.receiver.seen) == 1


async def test_a_superseded_job_raises_its_error_without_sending(clients: Clients) -> None:
    job = clients.job(await register(clients.g, "r"))
    await register(clients.g, "r")
    effect = functools.partial(job.effect, "h", adapter="hook", operation="send", payload={})
    with pytest.raises(StaleGeneration):  # the job learns it is superseded
        await (asyncio.to_thread(effect) if clients.sync else effect())
    assert isinstance(job.superseded, StaleGeneration)
    with pytest.raises(StaleGeneration):
        await clients.post(job, "notify")
    assert clients.receiver.seen == []


async def test_a_transport_told_step_from_lets_the_gateway_name_the_step(
    make_gateway: Any, receiver: Receiver, secrets: None
) -> None:
    """The upstream's ``step_from`` is the gateway's config, which a client cannot see:
    without ``step_from=True`` a call outside ``with job.step()`` raises before sending;
    with it, the call goes with the route's job and no step, and the gateway derives the
    step from the body (or refuses it: 400, nothing sent). A current step still wins."""
    g: Gateway = await make_gateway(
        auth=auth(), upstreams=upstreams(receiver.url, step_from="json:/order_id")
    )
    gen = await register(g, "r")
    job = FencedJob(gateway_url(g), "r", gen, api_key=KEYS["acme"], heartbeat_interval=None)
    route = {"base_url": PARTNER, "api_key": KEYS["acme"], "job": job}
    plain = AsyncFencegateTransport(gateway_url(g), "pay", **route)
    derived = AsyncFencegateTransport(gateway_url(g), "pay", step_from=True, **route)
    try:
        async with (
            httpx.AsyncClient(transport=plain) as without,
            httpx.AsyncClient(transport=derived) as http,
        ):
            with pytest.raises(InvalidRequest, match="step_from=True"):
                await without.post(CHARGES, json={"order_id": "order-7"})
            assert receiver.seen == []
            first = await http.post(CHARGES, json={"order_id": "order-7", "amount": 5})
            assert first.status_code == 200, first.text
            assert receiver.seen[-1].headers["Idempotency-Key"] == "acme/r:order-7"
            again = await http.post(CHARGES, json={"amount": 5, "order_id": "order-7"})
            assert again.headers["Fencegate-Outcome"] == "replayed"
            missing = await http.post(CHARGES, json={"amount": 5})
            assert missing.status_code == 400
            assert missing.json()["code"] == "invalid_request"
            with job.step("explicit"):  # the current step is sent, whatever the body says
                named = await http.post(CHARGES, json={"order_id": "order-7", "amount": 6})
            assert named.status_code == 200, named.text
            assert receiver.seen[-1].headers["Idempotency-Key"] == "acme/r:explicit"
            assert len(receiver.seen) == 2
    finally:
        await job.aclose()
    with pytest.raises(ValueError, match="job="):
        FencegateTransport(gateway_url(g), "pay", step_from=True)
