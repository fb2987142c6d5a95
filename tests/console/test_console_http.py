"""The console over plain HTTP: access rules, headers, SSE resume and fan-out, vendored files."""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.conftest import Gateway
from tests.console.conftest import AUDITOR, SCHEDULER, WORKER, Console

STATIC = Path(__file__).parents[2] / "gateway" / "console" / "static"
VENDORED = {  # the hashes static/VENDORED.md records (npm htmx.org 2.0.11, htmx-ext-sse 2.2.4)
    "vendor/htmx.min.js": "d6fdc75f204e6bdefa99b69bf1e6d4ac69b8a364f77929f45c13476b4000f717",
    "vendor/sse.min.js": "98a46496de0c3605fbffdce9167ba427bdd9553184f83f149c261891a92c0136",
}


def test_vendored_files_are_the_published_ones() -> None:
    notes = (STATIC / "VENDORED.md").read_text()
    for name, digest in VENDORED.items():
        assert hashlib.sha256((STATIC / name).read_bytes()).hexdigest() == digest, name
        assert digest in notes and "0BSD" in notes


async def logged_in(
    console: Console, key: str = AUDITOR, *, proof: list[str] | None = None
) -> tuple[aiohttp.ClientSession, str]:
    """A client session holding the console cookie, and the page's CSRF token; the proof of
    login (the fragment of the login's redirect) is appended to ``proof`` when given."""
    session = aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))
    async with session.post(
        console.base + "/console/login",
        data={"key": key, "next": "/console/rejections"},
        headers={"Origin": console.base},
        allow_redirects=False,
    ) as resp:
        assert resp.status == 303, await resp.text()
        target, _, fragment = resp.headers["Location"].partition("#fg-proof=")
        assert target == "/console/rejections"
    if proof is not None:
        proof.append(fragment)
    async with session.get(console.base + target) as resp:
        assert resp.status == 200
        page = await resp.text()
    csrf = re.search(r'name="csrf" value="([^"]+)"', page)
    assert csrf is not None
    return session, csrf[1]


async def test_security_headers_on_pages_and_streams(console: Console) -> None:
    session, _ = await logged_in(console)
    async with session:
        for path in ("/console/login", "/console/rejections", "/console/nope"):
            async with session.get(console.base + path) as resp:
                csp = resp.headers["Content-Security-Policy"]
                assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
                assert "unsafe-inline" not in csp and "style-src 'self'" in csp
                assert resp.headers["X-Content-Type-Options"] == "nosniff"
                assert resp.headers["Referrer-Policy"] == "same-origin"
                html = await resp.text()
                assert "<script>" not in html and " style=" not in html and "<style" not in html
        async with session.get(
            console.base + "/console/rejections/stream", headers={"Accept": "text/event-stream"}
        ) as resp:
            assert resp.headers["Content-Type"] == "text/event-stream"
            assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
            assert resp.headers["X-Content-Type-Options"] == "nosniff"


async def test_cross_site_posts_are_refused(console: Console) -> None:
    session, csrf = await logged_in(console)
    async with session:
        url = console.base + "/console/logout"
        for headers in (
            {"Origin": "http://evil.example"},
            {"Origin": console.base, "Sec-Fetch-Site": "cross-site"},
            {},  # no Origin at all
        ):
            async with session.post(url, data={"csrf": csrf}, headers=headers) as resp:
                assert resp.status == 403, headers
        # same origin but a wrong CSRF token: refused too
        async with session.post(url, data={"csrf": "x"}, headers={"Origin": console.base}) as r:
            assert r.status == 403
        # cross-site subresources (not a navigation) are refused on GET
        async with session.get(
            console.base + "/console/rejections.csv",
            headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"},
        ) as resp:
            assert resp.status == 403
        # the API still refuses what it always refused (its browser guard is untouched)
        async with session.post(
            console.base + "/v1/jobs/j/cancel",
            headers={"Origin": console.base, "Authorization": f"Bearer {SCHEDULER}"},
        ) as resp:
            assert resp.status == 403
        async with session.post(
            url, data={"csrf": csrf}, headers={"Origin": console.base}, allow_redirects=False
        ) as resp:
            assert resp.status == 303 and resp.headers["Location"] == "/console/login"
        async with session.get(console.base + "/console/", allow_redirects=False) as resp:
            assert resp.status == 303  # logged out: the cookie is gone


async def read_events(resp: aiohttp.ClientResponse, count: int) -> list[dict[str, str]]:
    events: list[dict[str, str]] = []
    current: dict[str, str] = {}
    async with asyncio.timeout(5):
        async for raw in resp.content:
            line = raw.decode().rstrip("\r\n")
            if not line:
                if "data" in current and current.get("event") == "rejection":
                    events.append(current)
                    if len(events) == count:
                        return events
                current = {}
                continue
            if line.startswith(":"):
                continue
            field, _, value = line.partition(": ")
            current[field] = current[field] + "\n" + value if field in current else value
    return events


async def stale_calls(console: Console, job: str, n: int) -> None:
    await console.register(job, 2)
    for i in range(n):
        resp = await console.effect(job, f"s{i}", 1, worker_id=f"w{i}")
        assert resp.status == 409


async def test_last_event_id_resumes_without_gaps_or_duplicates(console: Console) -> None:
    await stale_calls(console, "resume-1", 5)
    session, _ = await logged_in(console)
    async with session:
        async with session.get(console.base + "/console/rejections.json") as resp:
            ids = [row["id"] for row in await resp.json()][::-1]  # oldest first
        assert len(ids) == 5
        url = console.base + "/console/rejections/stream"
        async with session.get(url, headers={"Last-Event-ID": ids[1]}) as resp:
            got = await read_events(resp, 3)
        assert [e["id"] for e in got] == ids[2:]
        # a new entry while a resumed stream is open arrives once, after the backlog
        async with session.get(url, headers={"Last-Event-ID": ids[3]}) as resp:
            first = await read_events(resp, 1)
            assert [e["id"] for e in first] == ids[4:]
            more = await console.effect("resume-1", "late", 1, worker_id="late-worker")
            assert more.status == 409
            [late] = await read_events(resp, 1)
            assert "late-worker" in late["data"] and late["id"] > ids[4]


async def test_one_redis_read_per_interval_feeds_every_tab(console: Console) -> None:
    await stale_calls(console, "fan-1", 1)
    pump = console.state().pump
    session, _ = await logged_in(console)
    async with session:
        url = console.base + "/console/rejections/stream?after=0-0"
        streams = [await session.get(url) for _ in range(4)]
        try:
            for resp in streams:
                assert len(await read_events(resp, 1)) == 1
            before, started = pump.reads, time.monotonic()
            await asyncio.sleep(1.0)
            reads, elapsed = pump.reads - before, time.monotonic() - started
            poll = console.gw.settings.console.poll_seconds
            assert reads <= elapsed / poll + 1  # one tenant: one read per interval, 4 tabs
            new = await console.effect("fan-1", "again", 1, worker_id="fan-out")
            assert new.status == 409
            for resp in streams:  # every tab gets it
                [event] = await read_events(resp, 1)
                assert "fan-out" in event["data"]
        finally:
            for resp in streams:
                resp.close()


async def test_a_closed_tab_is_noticed_within_seconds(console: Console) -> None:
    streams = console.state().streams
    session, _ = await logged_in(console)
    async with session:
        resp = await session.get(console.base + "/console/rejections/stream")
        async with asyncio.timeout(3):
            while not streams.open:  # noqa: ASYNC110 - polls another component's state
                await asyncio.sleep(0.05)
        resp.close()
        started = time.monotonic()
        async with asyncio.timeout(5):
            while streams.open:  # noqa: ASYNC110 - polls another component's state
                await asyncio.sleep(0.05)
        # the ping (0.3 s in these tests) fails on the closed socket
        assert time.monotonic() - started < 3


async def test_a_worker_key_cannot_log_in(console: Console) -> None:
    async with aiohttp.ClientSession() as session:
        for key in (WORKER, SCHEDULER, "no-such-key"):
            async with session.post(
                console.base + "/console/login",
                data={"key": key},
                headers={"Origin": console.base},
                allow_redirects=False,
            ) as resp:
                assert resp.status == 401 and "Set-Cookie" not in resp.headers


async def test_read_only_hides_and_refuses_resolve(make_gateway: Any) -> None:
    gw: Gateway = await make_gateway(console={"read_only": True})  # open mode: loopback
    base = str(gw.client.make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as session:
        async with session.get(base + "/console/attention") as resp:
            page = await resp.text()
            assert resp.status == 200 and "Read-only console" in page
            assert "<form" not in page.split("<main>")[1].split("</main>")[0]
            csrf = re.search(r'name="csrf" value="([^"]*)"', page)
        async with session.post(
            base + "/console/jobs/j/steps/s/resolve",
            data={"csrf": csrf[1] if csrf else "", "outcome": "delivered", "confirm": "yes"},
            headers={"Origin": base},
        ) as resp:
            assert resp.status == 403


async def test_open_mode_says_so(make_gateway: Any) -> None:
    gw: Gateway = await make_gateway()
    base = str(gw.client.make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as session:
        async with session.get(base + "/console/rejections") as resp:
            page = await resp.text()
        assert resp.status == 200 and 'id="open-banner"' in page
        # a foreign Host is refused, as on the API (DNS rebinding)
        async with session.get(
            base + "/console/rejections", headers={"Host": "evil.example"}
        ) as resp:
            assert resp.status == 403


async def test_disabled_console_is_not_served(make_gateway: Any) -> None:
    gw: Gateway = await make_gateway(console={"enabled": False})
    resp = await gw.client.get("/console/")
    assert resp.status == 404


async def test_a_keyed_chain_is_worded_as_such(make_gateway: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("FG_CONSOLE_TEST_AUDIT_KEY", "k" * 32)
    gw: Gateway = await make_gateway(audit={"key_env": "FG_CONSOLE_TEST_AUDIT_KEY"})
    assert (await gw.register("keyed", generation=2)).status == 201
    assert (await gw.effect("keyed", "s", 1)).status == 409
    base = str(gw.client.make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as session:
        async with session.get(base + "/console/chain") as resp:
            page = await resp.text()
        assert "Keyed chain" in page and "anchored outside Redis" in page
        async with session.get(base + "/console/jobs/keyed") as resp:
            page = await resp.text()
        assert 'id="chain-badge">HMAC chain verified<' in page


async def test_resolve_needs_csrf_confirmation_and_this_origin(console: Console) -> None:
    await console.register("csrf-1", 1)
    assert (await console.effect("csrf-1", "s", 1, adapter="flaky")).status == 504
    proof: list[str] = []
    session, csrf = await logged_in(console, proof=proof)
    url = console.base + "/console/jobs/csrf-1/steps/s/resolve"
    form = {"outcome": "delivered", "confirm": "yes", "csrf": csrf, "proof": proof[0]}
    async with session:
        for data, headers, status in (
            ({**form, "csrf": "forged"}, {"Origin": console.base}, 403),
            ({**form, "proof": ""}, {"Origin": console.base}, 403),
            ({**form, "proof": "forged"}, {"Origin": console.base}, 403),
            ({**form, "confirm": ""}, {"Origin": console.base}, 400),
            (form, {"Origin": "http://evil.example"}, 403),
            ({**form, "result": "{not json"}, {"Origin": console.base}, 400),
        ):
            async with session.post(url, data=data, headers=headers) as resp:
                assert resp.status == status, (data, headers)
        record = await console.gw.client.get(
            "/v1/jobs/csrf-1/effects/s", headers=console.as_(AUDITOR)
        )
        assert (await record.json())["state"] == "unknown"  # nothing above changed it
        async with session.post(url, data=form, headers={"Origin": console.base}) as resp:
            assert resp.status == 200 and resp.url.path == "/console/attention"
        record = await console.gw.client.get(
            "/v1/jobs/csrf-1/effects/s", headers=console.as_(AUDITOR)
        )
        body = await record.json()
        assert body["state"] == "succeeded" and body["resolved_by"] == "alice-auditor"


async def test_the_overview_says_why_a_quarantined_redis_refuses(
    console: Console, redis_sync: Any
) -> None:
    """An operator opening the console of a gateway whose Redis was quarantined (lost writes)
    reads the cause, when, by which data dir, and what to do; a healthy one shows nothing."""
    session, _ = await logged_in(console)
    async with session:
        async with session.get(console.base + "/console/") as resp:
            assert resp.status == 200
            assert 'id="card-health"' not in await resp.text()
        from gateway.store import durability
        from gateway.store.keys import MARKER

        redis_sync.delete(MARKER)
        redis_sync.set(
            "fg:quarantine",
            '{"cause": "slot_went_back", "at_ms": 1796000000000, "slot": 7, "counter": 3, '
            '"seen": 9, "by": "abc123", "pid": 42}',
        )
        async with session.get(console.base + "/console/") as resp:
            page = await resp.text()
        assert resp.status == 200 and 'id="card-health"' in page
        assert "marker_missing (quarantined)" in page
        assert "slot_went_back, slot 7, counter 3 below 9 seen" in page
        assert "fencegate init --confirm-data-loss" in page
        assert durability.MARKER_STATES["quarantined"].split(":")[0] in page
