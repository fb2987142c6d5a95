"""The console in a real `fencegate serve` process: SIGTERM with a tab open, `--workers 2`."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from playwright.async_api import expect

from tests.support.processes import Serve, write_config

GRACE = 10.0


@pytest.mark.browser
async def test_sigterm_with_a_console_tab_open_stops_at_once(
    tmp_path: Path, serves: list[Serve], tabs: Any
) -> None:
    cfg = write_config(tmp_path, f"[server]\nshutdown_grace_seconds = {GRACE}\n")
    s = Serve(tmp_path, cfg)
    serves.append(s)
    await asyncio.to_thread(s.wait_ready)
    tab = await tabs(f"http://127.0.0.1:{s.port}")
    async with tab.page.expect_response(lambda r: "/console/rejections/stream" in r.url) as sse:
        await tab.page.goto(tab.base + "/console/rejections")
    assert (await sse.value).status == 200
    await expect(tab.page.locator("#live-state")).to_have_text("live")
    started = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(s.proc.wait, GRACE + 10)
    took = time.monotonic() - started
    assert code == 0, s.output()
    # the open stream is ended first thing: nothing in flight, so no wait for the grace
    assert took < GRACE / 2, f"{took:.1f} s with a console tab open"
    assert "Traceback" not in s.output()


async def test_a_login_holds_across_workers(tmp_path: Path, serves: list[Serve]) -> None:
    key = "auditor-key-for-workers"
    digest = hashlib.sha256(key.encode()).hexdigest()
    extra = f'[[auth.keys]]\nrole = "auditor"\nsha256 = "{digest}"\nname = "carol"\n'
    s = Serve(tmp_path, write_config(tmp_path, extra), "--workers", "2")
    serves.append(s)
    await asyncio.to_thread(s.wait_ready)
    base = f"http://127.0.0.1:{s.port}"
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        async with session.post(
            base + "/console/login", data={"key": key}, headers={"Origin": base}
        ) as resp:
            assert resp.status == 200 and "carol" in await resp.text()
        statuses = set()
        for _ in range(30):  # new connections: the kernel spreads them over both workers
            async with session.get(
                base + "/console/rejections",
                allow_redirects=False,
                headers={"Connection": "close"},
            ) as resp:
                statuses.add(resp.status)
        assert statuses == {200}
    assert await asyncio.to_thread(s.stop, signal.SIGTERM) == 0
