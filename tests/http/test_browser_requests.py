"""A browser cannot drive the gateway, in open mode and with keys.

Plain HTTP requests with exactly the headers a browser sends for an HTML form
post from a public page, a ``fetch`` from a loopback page on another port, and
a DNS-rebinding page (``Host: evil.example:8080``). Each must change nothing:
Redis is compared key by key before and after, the job view is read back
through a legitimate request, and the webhook receiver sees nothing.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from gateway.client import FencedJob, Scheduler
from gateway.runtime.settings import ConfigError, load_settings
from tests.conftest import Gateway, Upstream, key_digest
from tests.support.calls import snapshot

KEY = "browser-suite-admin-key-0123456789abcdef"
MAX = 2**53 - 1
EFFECT = json.dumps({"adapter": "hook", "operation": "send", "payload": {"to": "x"}}).encode()

# what an attacker's page would do: cancel the job, push it to the last generation, mark
# an unknown step delivered, perform an effect (no Fencing-Token: a form cannot set one)
ATTACKS: list[tuple[str, str, bytes]] = [
    ("POST", "/v1/jobs/r/cancel", b"x=1"),
    ("POST", "/v1/jobs/r/cancel", b""),
    ("POST", "/v1/jobs/r/generations", json.dumps({"generation": MAX}).encode()),
    ("POST", "/v1/jobs/r/generations", b""),
    ("POST", "/v1/jobs/r/effects/u/resolve", b'{"outcome": "delivered"}'),
    ("POST", "/v1/jobs/r/effects/new", EFFECT),
    ("POST", "/v1/jobs/r/fence", b""),
]

FORM_TYPES = ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x"]


@pytest.fixture(params=["open", "keys"])
async def target(request: Any, make_gateway: Any, upstream: Upstream) -> Gateway:
    """A job ``r`` at generation 1 with a succeeded step and an ``unknown`` step ``u``."""
    if request.param == "open":
        gw: Gateway = await make_gateway()
    else:
        gw = await make_gateway(
            headers={"Authorization": f"Bearer {KEY}"},
            auth={"keys": [{"role": "admin", "sha256": key_digest(KEY)}]},
            # keyed gateways accept any Host unless told their names (see the test below)
            server={"allowed_hosts": ["127.0.0.1"]},
        )
    assert (await gw.register("r", generation=1, lease_ms=60_000)).status == 201
    assert (await gw.effect("r", "done", 1)).status == 200
    upstream.behaviour = 500  # the receiver failed after taking it: outcome unknown
    assert (await gw.effect("r", "u", 1)).status == 504
    upstream.behaviour = "ok"
    upstream.received.clear()
    return gw


async def job_view(gw: Gateway) -> Any:
    resp = await gw.client.get("/v1/jobs/r", headers=gw.headers)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def assert_refused_and_nothing_changed(
    gw: Gateway,
    upstream: Upstream,
    redis_sync: Any,
    headers: dict[str, str],
    *,
    status: int,
    code: str,
    attacks: list[tuple[str, str, bytes]] = ATTACKS,
) -> None:
    before, view = snapshot(redis_sync), await job_view(gw)
    for method, path, body in attacks:
        resp = await gw.client.request(
            method,
            path,
            data=body,
            headers={**gw.headers, **headers},
            skip_auto_headers=["Content-Type"],
        )
        doc = await resp.json(content_type=None)
        assert (resp.status, doc["code"]) == (status, code), (path, headers, doc)
        assert not [h for h in resp.headers if h.lower().startswith("access-control-")]
    assert snapshot(redis_sync) == before
    after = await job_view(gw)
    assert after == view and after["fence"] == 1 and not after["cancelled"]
    assert after["effects"]["u"]["state"] == "unknown" and "new" not in after["effects"]
    assert upstream.received == []


@pytest.mark.parametrize("content_type", FORM_TYPES)
async def test_cross_site_html_form_post_changes_nothing(
    target: Gateway, upstream: Upstream, redis_sync: Any, content_type: str
) -> None:
    """(1) an HTML form on a public page posted at the gateway."""
    form = {
        "Content-Type": content_type,
        "Origin": "https://evil.example",
        "Sec-Fetch-Site": "cross-site",
        "Sec-Fetch-Mode": "navigate",
        "Sec-Fetch-Dest": "document",
        "Referer": "https://evil.example/",
    }
    await assert_refused_and_nothing_changed(
        target, upstream, redis_sync, form, status=403, code="forbidden"
    )


@pytest.mark.parametrize("content_type", ["text/plain;charset=UTF-8", "application/json"])
async def test_fetch_from_a_loopback_page_on_another_port_changes_nothing(
    target: Gateway, upstream: Upstream, redis_sync: Any, content_type: str
) -> None:
    """(2) ``fetch`` from http://127.0.0.1:9999 (text/plain needs no preflight)."""
    fetch = {
        "Content-Type": content_type,
        "Origin": "http://127.0.0.1:9999",
        "Sec-Fetch-Site": "same-site",
        "Sec-Fetch-Mode": "cors",
        "Sec-Fetch-Dest": "empty",
    }
    await assert_refused_and_nothing_changed(
        target, upstream, redis_sync, fetch, status=403, code="forbidden"
    )


@pytest.mark.parametrize(
    "browser",
    [
        {"Content-Type": "application/json"},  # the brief's case: no Origin at all
        # what a browser really sends for a same-origin fetch on the rebound name
        {
            "Content-Type": "application/json",
            "Origin": "http://evil.example:8080",
            "Sec-Fetch-Site": "same-origin",
        },
    ],
)
async def test_dns_rebinding_changes_nothing_and_reads_nothing(
    target: Gateway, upstream: Upstream, redis_sync: Any, browser: dict[str, str]
) -> None:
    """(3) evil.example resolved to 127.0.0.1: the page is same-origin with the gateway."""
    rebound = {"Host": "evil.example:8080", **browser}
    await assert_refused_and_nothing_changed(
        target, upstream, redis_sync, rebound, status=403, code="forbidden"
    )
    for path in ("/v1/jobs/r", "/v1/jobs/r/effects/done", "/v1/audit/rejections", "/metrics"):
        resp = await target.client.get(path, headers={**target.headers, "Host": "evil.example"})
        assert resp.status == 403, path
        assert "succeeded" not in await resp.text()


async def test_text_plain_and_form_bodies_are_415_even_without_origin(
    target: Gateway, upstream: Upstream, redis_sync: Any
) -> None:
    """A browser that sends no Origin and no Sec-Fetch-* (old ones) still cannot send JSON
    without a preflight, so every non-JSON body is refused on its own."""
    for content_type in FORM_TYPES:
        await assert_refused_and_nothing_changed(
            target,
            upstream,
            redis_sync,
            {"Content-Type": content_type},
            status=415,
            code="unsupported_media_type",
        )


async def test_cors_preflight_gets_no_allow(target: Gateway) -> None:
    preflight = {
        "Origin": "http://127.0.0.1:9999",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, fencing-token",
    }
    for path in ("/v1/jobs/r/cancel", "/v1/jobs/r/effects/new", "/healthz"):
        resp = await target.client.options(path, headers=preflight)
        assert resp.status >= 400, path
        assert not [h for h in resp.headers if h.lower().startswith("access-control-")]
    ok = await target.client.get("/v1/jobs/r", headers=target.headers)
    assert ok.status == 200
    assert not [h for h in ok.headers if h.lower().startswith("access-control-")]


async def test_json_bodies_and_bodyless_posts_still_work(target: Gateway) -> None:
    h = target.headers
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        resp = await target.client.post(
            "/v1/jobs/j/generations",
            data=b'{"generation": 1}',
            headers={**h, "Content-Type": content_type},
        )
        assert resp.status in (200, 201), content_type
    for bad in ("application/json; charset=latin-1", "application/jsonx", "text/json", ""):
        resp = await target.client.post(
            "/v1/jobs/j/generations",
            data=b'{"generation": 2}',
            headers={**h, "Content-Type": bad},
        )
        assert resp.status == 415, bad
    # no body, no Content-Type (what the SDK sends for a heartbeat or a cancel)
    resp = await target.client.post(
        "/v1/jobs/j/fence", headers={**h, "Fencing-Token": "1"}, skip_auto_headers=["Content-Type"]
    )
    assert resp.status == 200
    # aiohttp's client declares application/octet-stream on a POST without a body: served;
    # with a body it is refused like any other non-JSON type
    resp = await target.client.post("/v1/jobs/j/fence", headers={**h, "Fencing-Token": "1"})
    assert resp.status == 200 and resp.request_info.headers["Content-Type"] == (
        "application/octet-stream"
    )
    resp = await target.client.post(
        "/v1/jobs/j/generations",
        data=b'{"generation": 3}',
        headers={**h, "Content-Type": "application/octet-stream"},
    )
    assert resp.status == 415
    # a body without any Content-Type
    resp = await target.client.post(
        "/v1/jobs/j/generations",
        data=b'{"generation": 3}',
        headers=h,
        skip_auto_headers=["Content-Type"],
    )
    assert resp.status == 415
    assert (await job_view_of(target, "j"))["fence"] == 1


async def job_view_of(gw: Gateway, job: str) -> Any:
    return await (await gw.client.get(f"/v1/jobs/{job}", headers=gw.headers)).json()


async def test_sdk_and_allowed_hosts_in_open_mode(gw: Gateway) -> None:
    """The SDK sends JSON with its content type; loopback names pass in open mode."""
    base = str(gw.client.make_url("")).rstrip("/")
    port = gw.client.port
    async with Scheduler(base) as sched:
        reg = await sched.register("sdk", generation=3)
        async with FencedJob(base, "sdk", reg.token, heartbeat_interval=None) as job:
            assert (await job.heartbeat())["current"]
            done = await job.effect("s", adapter="hook", operation="send", payload={"n": 1})
            assert done.state == "succeeded"
        assert (await sched.cancel("sdk"))["cancelled"]
    for host in (f"localhost:{port}", f"[::1]:{port}", "127.0.0.1", "127.0.0.2:1", "LOCALHOST"):
        resp = await gw.client.get("/v1/jobs/sdk", headers={"Host": host})
        assert resp.status == 200, host
    for host in (
        "evil.example",
        "localhost.evil.example:80",
        "127.0.0.1.nip.io",
        "0.0.0.0",
        "10.0.0.1",
        "a b",
        "",
    ):
        resp = await gw.client.get("/v1/jobs/sdk", headers={"Host": host})
        assert resp.status == 403, host


async def test_configured_hosts_and_origins(make_gateway: Any) -> None:
    gw: Gateway = await make_gateway(
        server={
            "allowed_hosts": ["gw.internal:8443", "API.example", "127.0.0.1"],
            "allowed_origins": ["https://ops.example"],
        }
    )
    for host, status in [
        ("gw.internal:8443", 404),
        ("gw.internal", 403),
        ("gw.internal:80", 403),
        ("api.example:1", 404),
        ("localhost", 403),
    ]:
        resp = await gw.client.get("/v1/jobs/none", headers={"Host": host})
        assert resp.status == status, host
    # an allowed Origin is served whatever Sec-Fetch-Site says; still no CORS headers
    ok = await gw.client.post(
        "/v1/jobs/o/generations",
        json={"generation": 1},
        headers={"Origin": "https://ops.example", "Sec-Fetch-Site": "cross-site"},
    )
    assert ok.status == 201
    assert not [h for h in ok.headers if h.lower().startswith("access-control-")]
    for origin in ("https://ops.example.evil", "http://ops.example", "null"):
        resp = await gw.client.post(
            "/v1/jobs/o/generations", json={"generation": 2}, headers={"Origin": origin}
        )
        assert resp.status == 403, origin


async def test_keyed_gateway_without_allowed_hosts_accepts_any_host_but_needs_the_key(
    make_gateway: Any, redis_sync: Any
) -> None:
    """Documented: with keys and no server.allowed_hosts, Host is not checked; a rebinding
    page has no key, so it gets 401 and changes nothing."""
    gw: Gateway = await make_gateway(auth={"keys": [{"role": "admin", "sha256": key_digest(KEY)}]})
    before = snapshot(redis_sync)
    resp = await gw.client.post(
        "/v1/jobs/r/generations", json={"generation": MAX}, headers={"Host": "evil.example:8080"}
    )
    assert resp.status == 401
    assert snapshot(redis_sync) == before
    resp = await gw.client.post(
        "/v1/jobs/r/generations",
        json={"generation": 1},
        headers={"Host": "gateway.example.com", "Authorization": f"Bearer {KEY}"},
    )
    assert resp.status == 201


@pytest.mark.parametrize(
    "server",
    [
        {"allowed_origins": ["*"]},
        {"allowed_origins": ["https://ops.example/"]},
        {"allowed_origins": ["null"]},
        {"allowed_hosts": ["bad host"]},
        {"allowed_hosts": ["http://x"]},
    ],
)
def test_bad_allow_lists_are_config_errors(server: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"server\.allowed_"):
        load_settings(None, server=server)


async def test_raw_browser_request_without_host_header_is_served(gw: Gateway) -> None:
    """Browsers always send Host; an HTTP/1.0 client without one is no browser."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.client.port)
    writer.write(b"GET /healthz HTTP/1.0\r\n\r\n")
    await writer.drain()
    head = await reader.read(200)
    writer.close()
    assert head.startswith(b"HTTP/1.0 200") or head.startswith(b"HTTP/1.1 200"), head
