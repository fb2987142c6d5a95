"""The console's browser tests: Debian's chromium driven by Playwright's async API, on the
test's own event loop, against the in-process gateway (``make_gateway``).

Playwright's own browser download does not work here (and is never used): the system
``chromium`` is launched by path. ``make test`` installs it when it is missing; without it
these tests fail (never skip), so CI cannot pass by not running them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.conftest import Gateway, key_digest

ARTIFACTS = Path(__file__).parents[2] / "test-artifacts" / "console"
AUDITOR, ADMIN, WORKER, SCHEDULER = "auditor-key-1", "admin-key-1", "worker-key-1", "sched-key-1"
OTHER_AUDITOR, OTHER_SCHEDULER = "other-auditor-key", "other-sched-key"
MARKUP = "<svg/onload=alert(1)>"
ERROR_MARKUP = "<img src=x onerror=alert(2)><script>alert(3)</script><b>bold</b>"


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail(
            "the console's browser tests need Debian's chromium: `make test` installs it "
            "(as root), or `apt-get install chromium`"
            + (" (CI=true: never skipped)" if os.environ.get("CI") == "true" else "")
        )
    return path


@pytest_asyncio.fixture(scope="session")
async def browser() -> AsyncIterator[Any]:
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        b = await pw.chromium.launch(
            executable_path=chromium(),
            headless=True,
            args=["--disable-dev-shm-usage", "--disable-gpu"],
        )
        yield b
        await b.close()


@dataclass
class Tab:
    """A browser page that records what a hostile value would set off."""

    page: Any
    base: str
    errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)

    def csp_violations(self) -> list[str]:
        return [e for e in self.errors if "Content Security Policy" in e or "Refused" in e]

    async def login(self, key: str, then: str = "/console/") -> None:
        await self.page.goto(self.base + then)
        await self.page.fill("#key", key)
        await self.page.click("form.login button[type=submit]")

    async def shot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        await self.page.screenshot(path=str(path), full_page=True)
        return path


@pytest_asyncio.fixture
async def tabs(browser: Any) -> AsyncIterator[Any]:
    contexts: list[Any] = []

    async def open_tab(base: str, *, width: int = 1280, height: int = 720) -> Tab:
        ctx = await browser.new_context(viewport={"width": width, "height": height})
        contexts.append(ctx)
        page = await ctx.new_page()
        page.set_default_timeout(5000)
        tab = Tab(page, base)
        page.on("console", lambda m: tab.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: tab.errors.append(str(e)))

        async def dismiss(d: Any) -> None:
            tab.dialogs.append(d.message)
            await d.dismiss()

        page.on("dialog", dismiss)
        return tab

    yield open_tab
    for ctx in contexts:
        await ctx.close()


def keys_section() -> dict[str, Any]:
    return {
        "keys": [
            {"role": "auditor", "sha256": key_digest(AUDITOR), "name": "alice-auditor"},
            {"role": "admin", "sha256": key_digest(ADMIN), "name": "root-admin"},
            {"role": "worker", "sha256": key_digest(WORKER), "name": "w1"},
            {"role": "scheduler", "sha256": key_digest(SCHEDULER)},
            {"role": "auditor", "sha256": key_digest(OTHER_AUDITOR), "tenant": "other"},
            {"role": "scheduler", "sha256": key_digest(OTHER_SCHEDULER), "tenant": "other"},
        ]
    }


@dataclass
class Console:
    gw: Gateway
    base: str
    html_adapter_hits: list[str]

    def state(self) -> Any:
        from gateway.console import state

        return state(self.gw.app)

    def sessions(self) -> Any:
        return self.state().sessions

    def as_(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    async def register(self, job: str, generation: int, key: str = SCHEDULER) -> None:
        resp = await self.gw.client.post(
            f"/v1/jobs/{job}/generations", json={"generation": generation}, headers=self.as_(key)
        )
        assert resp.status in (200, 201), await resp.text()

    async def effect(self, job: str, step: str, token: int, **kw: Any) -> Any:
        headers = {**self.as_(WORKER), **kw.pop("headers", {})}
        return await self.gw.effect(job, step, token, headers=headers, **kw)


@pytest_asyncio.fixture
async def console(make_gateway: Any) -> AsyncIterator[Console]:
    """A gateway with keys (auditor, admin, worker, scheduler; another tenant), fast live
    pages, and adapters whose downstream answers with HTML: ``html`` 422 with markup (the
    step fails, the body is stored), ``htmlok`` 200 with markup (the result), ``flaky`` 500
    (the outcome is unknown)."""
    hits: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        hits.append(request.path)
        status = {"/fail": 422, "/ok": 200}.get(request.path, 500)
        return web.Response(status=status, text=ERROR_MARKUP, content_type="text/html")

    downstream = web.Application()
    downstream.router.add_post("/{tail:.*}", answer)
    server = TestServer(downstream, host="127.0.0.1", port=0)
    await server.start_server()

    def hook(path: str) -> dict[str, Any]:
        return {"type": "webhook", "url": str(server.make_url(path)), "timeout_seconds": 2}

    gw: Gateway = await make_gateway(
        auth=keys_section(),
        console={"poll_seconds": 0.1, "sse_ping_seconds": 0.3},
        adapters={"html": hook("/fail"), "htmlok": hook("/ok"), "flaky": hook("/unknown")},
    )
    base = str(gw.client.make_url("")).rstrip("/")
    yield Console(gw, base, hits)
    await server.close()
