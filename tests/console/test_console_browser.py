"""The console in a real headless Chromium."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from playwright.async_api import expect

from tests.console.conftest import (
    ADMIN,
    AUDITOR,
    ERROR_MARKUP,
    MARKUP,
    OTHER_SCHEDULER,
    WORKER,
    Console,
)

pytestmark = pytest.mark.browser

DOCS_IMG = Path(__file__).parents[2] / "docs" / "img"


VIEWS = ("overview", "rejections", "job", "attention", "chain")


def keep(shot: Path) -> None:
    """Every run leaves the screenshot in test-artifacts/console/ (gitignored); with
    FENCEGATE_DOCS_SCREENSHOTS=1 it also refreshes the committed copy the docs show."""
    assert shot.stat().st_size > 10_000  # a rendered page, not an empty image
    if os.environ.get("FENCEGATE_DOCS_SCREENSHOTS") == "1":
        shutil.copyfile(shot, DOCS_IMG / shot.name)


def test_the_docs_show_every_view() -> None:
    docs = (DOCS_IMG.parent / "console.md").read_text()
    readme = (DOCS_IMG.parents[1] / "README.md").read_text()
    assert "](docs/img/rejections.png)" in readme
    for view in VIEWS:
        assert (DOCS_IMG / f"{view}.png").stat().st_size > 10_000, view
        assert f"](img/{view}.png)" in docs, view


async def test_a_stale_call_appears_live_with_both_generations(console: Console, tabs: Any) -> None:
    await console.register("payroll-7", 1)
    await console.register("payroll-7", 2)
    await console.register("invoice-12", 4)
    earlier = await console.effect("invoice-12", "charge", 3, worker_id="zombie-host-1")
    assert earlier.status == 409
    tab = await tabs(console.base)
    await tab.login(AUDITOR, "/console/rejections")
    await expect(tab.page.locator("#rows tr")).to_have_count(1)
    await tab.page.wait_for_url("**/console/rejections")
    await expect(tab.page.locator("#live-state")).to_have_text("live")
    await tab.page.evaluate("window.__notReloaded = true")
    resp = await console.effect("payroll-7", "notify", 1, worker_id="zombie-host-3")
    assert resp.status == 409
    row = tab.page.locator("#rows tr").first
    await expect(row.locator(".gen.old")).to_have_text("1")
    await expect(row.locator(".gen.cur")).to_have_text("2")
    await expect(row.locator("td.worker")).to_have_text("zombie-host-3")
    await expect(row.locator("td.reason")).to_have_text("stale_generation")
    await expect(tab.page.locator("#rows tr")).to_have_count(2)
    await expect(tab.page.locator("p.empty")).to_be_hidden()
    assert await tab.page.evaluate("window.__notReloaded") is True  # arrived over SSE
    assert tab.csp_violations() == [] and tab.errors == []
    keep(await tab.shot("rejections"))


async def test_markup_from_outside_renders_as_text(console: Console, tabs: Any) -> None:
    await console.register("inv-1", 1)
    await console.register("inv-1", 2)
    # downstreams answer with HTML: a failure's body and a success's body are stored
    failed = await console.effect("inv-1", "bill", 2, adapter="html", worker_id=MARKUP)
    assert failed.status == 424, await failed.text()
    ok = await console.effect("inv-1", "ack", 2, adapter="htmlok", worker_id=MARKUP)
    assert ok.status == 200, await ok.text()
    stale = await console.effect("inv-1", "mail", 1, worker_id=MARKUP)
    assert stale.status == 409
    tab = await tabs(console.base)
    await tab.login(AUDITOR, "/console/rejections")
    await expect(tab.page.locator("#rows tr td.worker").first).to_have_text(MARKUP)
    await tab.page.goto(console.base + "/console/jobs/inv-1")
    await expect(tab.page.locator("#step-bill pre.error-body")).to_contain_text(ERROR_MARKUP)
    await expect(tab.page.locator("#step-ack pre.result")).to_contain_text(ERROR_MARKUP)
    await expect(tab.page.locator("#step-bill dd.worker")).to_have_text(MARKUP)
    await expect(tab.page.locator("#history td.worker").last).to_have_text(MARKUP)
    for path in ("/console/rejections", "/console/jobs/inv-1"):
        await tab.page.goto(console.base + path)
        assert await tab.page.locator("main svg, main img, main script").count() == 0
        assert await tab.page.locator("td.worker *, dd.worker *, pre *").count() == 0
    await asyncio.sleep(0.2)  # an onerror/onload would have fired by now
    assert tab.dialogs == []
    assert tab.csp_violations() == [] and tab.errors == []


async def test_the_job_page_tells_the_story_in_order(console: Console, tabs: Any) -> None:
    await console.register("report-9", 1)
    await console.register("report-9", 2)
    won = await console.effect("report-9", "send", 2, worker_id="new-worker")
    assert won.status == 200
    zombie = await console.effect("report-9", "send", 1, worker_id="old-worker")
    assert zombie.status == 409
    tab = await tabs(console.base)
    await tab.login(AUDITOR, "/console/jobs/report-9")
    rows = tab.page.locator("#history tbody tr")
    await expect(rows).to_have_count(4)
    whats = await rows.locator("td.what").all_text_contents()
    assert whats[0].startswith("generation 1 registered")
    assert whats[1].startswith("generation 2 registered")
    assert whats[2] == "hook.send: succeeded"
    assert whats[3] == "refused: stale_generation"
    assert await rows.nth(3).locator(".gen.old").text_content() == "1"
    assert await rows.nth(3).locator(".gen.cur").text_content() == "2"
    await expect(tab.page.locator("#fence")).to_have_text("2")
    await expect(tab.page.locator("#chain-badge")).to_have_text("chain consistent")
    # every entry has an anchor: a permalink opens the page on it
    anchor = await rows.nth(3).get_attribute("id")
    await tab.page.goto(f"{console.base}/console/jobs/report-9#{anchor}")
    await expect(tab.page.locator(f"[id='{anchor}']")).to_be_visible()
    raw = rows.nth(3).locator("details.raw")
    await raw.locator("summary").click()
    await expect(raw.locator("pre")).to_contain_text('"reason": "stale_generation"')
    assert tab.csp_violations() == [] and tab.errors == []
    keep(await tab.shot("job"))


async def test_an_unknown_step_is_resolved_through_the_form(console: Console, tabs: Any) -> None:
    await console.register("ship-4", 1)
    unknown = await console.effect("ship-4", "label", 1, adapter="flaky")
    assert unknown.status == 504
    tab = await tabs(console.base)
    await tab.login(AUDITOR, "/console/attention")
    row = tab.page.locator("#n-ship-4-label")
    await expect(row).to_be_visible()
    keep(await tab.shot("attention"))
    await row.locator("input[value=delivered]").check()
    await row.locator("textarea[name=result]").fill('{"tracking": "checked by phone"}')
    await row.locator("button[type=submit]").click()  # the confirmation box is required
    assert "/attention" in tab.page.url and "resolved=" not in tab.page.url
    await row.locator("input[name=confirm]").check()
    await row.locator("button[type=submit]").click()
    await expect(tab.page.locator("#flash")).to_contain_text("ship-4/label")
    await expect(tab.page.locator("#n-ship-4-label")).to_have_count(0)
    await tab.page.goto(console.base + "/console/jobs/ship-4")
    resolved = tab.page.locator("#history tr.resolved")
    await expect(resolved.locator("td.what")).to_have_text("resolved by an operator: delivered")
    await expect(resolved.locator("td.worker")).to_have_text("alice-auditor")
    await expect(tab.page.locator("#step-label .badge")).to_have_text("succeeded")
    assert tab.csp_violations() == [] and tab.errors == []


async def test_a_tampered_chain_shows_on_the_chain_page(
    console: Console, tabs: Any, redis_sync: Any
) -> None:
    await console.register("ledger-2", 5)
    for step in ("a", "b", "c"):
        assert (await console.effect("ledger-2", step, 1)).status == 409
    stream = "fg:{default/ledger-2}:audit"
    middle = redis_sync.xrange(stream)[2][0]
    redis_sync.xdel(stream, middle)  # as tests/store/test_audit_chain.py does
    tab = await tabs(console.base)
    await tab.login(ADMIN, "/console/chain")
    await expect(tab.page.locator("#wording")).to_contain_text("consistent")
    await tab.page.click("#verify")
    await expect(tab.page.locator("#chain-result")).to_have_text(re.compile(r"^\d+ problems?$"))
    problems = tab.page.locator("#problems li")
    await expect(problems.first).to_contain_text("previous entry missing or altered")
    await expect(problems.first.locator("a")).to_have_attribute("href", "/console/jobs/ledger-2")
    await tab.page.goto(console.base + "/console/jobs/ledger-2")
    await expect(tab.page.locator("#chain-badge")).to_have_text("chain broken")
    await tab.page.goto(console.base + "/console/chain")
    keep(await tab.shot("chain"))
    assert tab.csp_violations() == [] and tab.errors == []


async def test_the_overview_counts_from_redis(console: Console, tabs: Any) -> None:
    await console.register("ov-1", 3)
    for token in (1, 2):
        assert (await console.effect("ov-1", f"s{token}", token)).status == 409
    tab = await tabs(console.base)
    await tab.login(AUDITOR)
    await tab.page.wait_for_url("**/console/")
    await expect(tab.page.locator("#card-rejections .big")).to_have_text("2")
    await expect(tab.page.locator("#card-rejections li")).to_have_text("stale_generation: 2")
    assert tab.csp_violations() == [] and tab.errors == []
    keep(await tab.shot("overview"))


async def test_who_may_see_what(console: Console, tabs: Any) -> None:
    await console.register("theirs", 1, key=OTHER_SCHEDULER)  # another tenant's job
    tab = await tabs(console.base)
    await tab.page.goto(console.base + "/console/jobs/theirs")
    await expect(tab.page.locator("#key")).to_be_visible()  # no cookie: the login form
    await tab.page.fill("#key", WORKER)
    await tab.page.click("form.login button[type=submit]")
    await expect(tab.page.locator("#login-error")).to_have_text(
        "Not a key of role auditor or admin."
    )
    await tab.page.fill("#key", AUDITOR)
    await tab.page.click("form.login button[type=submit]")
    await tab.page.wait_for_url("**/console/jobs/theirs")
    await expect(tab.page.locator("h1")).to_have_text("404")
    [cookie] = await tab.page.context.cookies()
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/console"
    # a forged cookie (payload changed, MAC kept) and an expired one: back to the login form
    payload, mac = cookie["value"].split(".")
    forged = {
        **cookie,
        "value": payload[:-2] + ("AA" if payload[-2:] != "AA" else "BB") + "." + mac,
    }
    sessions = console.sessions()
    sessions.ttl = -5
    _, expired_value = sessions.login(AUDITOR) or (None, "")
    for value in (forged["value"], expired_value):
        await tab.page.context.clear_cookies()
        await tab.page.context.add_cookies([{**cookie, "value": value}])
        await tab.page.goto(console.base + "/console/rejections")
        await expect(tab.page.locator("#key")).to_be_visible()
    assert tab.csp_violations() == []


async def test_a_page_on_another_port_gets_the_cookie_but_cannot_resolve(
    console: Console, tabs: Any
) -> None:
    """Browsers send a host's cookies to every port: a service on another port of this host
    receives the console cookie and replays it (reading a page for its CSRF token). It
    cannot resolve a step; the operator's own tab, which holds the proof of login, can."""
    await console.register("ship-9", 1)
    assert (await console.effect("ship-9", "label", 1, adapter="flaky")).status == 504
    seen: list[str] = []

    async def other_service(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Cookie", ""))
        return web.Response(text="<p>another service</p>", content_type="text/html")

    other = web.Application()
    other.router.add_get("/{tail:.*}", other_service)
    server = TestServer(other, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        tab = await tabs(console.base)
        await tab.login(AUDITOR, "/console/attention")
        await expect(tab.page.locator("#n-ship-9-label")).to_be_visible()
        await tab.page.goto(f"http://127.0.0.1:{server.port}/console/")
        await expect(tab.page.locator("p")).to_have_text("another service")
        [cookie] = [c for c in seen[0].split("; ") if c.startswith("fg_console=")]
        replay = {"Cookie": cookie, "Origin": console.base}
        async with aiohttp.ClientSession() as thief:
            async with thief.get(console.base + "/console/attention", headers=replay) as resp:
                csrf = re.search(r'name="csrf" value="([^"]+)"', await resp.text())
            assert csrf is not None  # the cookie alone reads pages (docs/console.md)
            form = {"outcome": "delivered", "confirm": "yes", "csrf": csrf[1], "proof": ""}
            url = console.base + "/console/jobs/ship-9/steps/label/resolve"
            async with thief.post(url, data=form, headers=replay) as resp:
                assert resp.status == 403
        record = await console.gw.client.get(
            "/v1/jobs/ship-9/effects/label", headers={"Authorization": f"Bearer {AUDITOR}"}
        )
        assert (await record.json())["state"] == "unknown"
        await tab.page.goto(console.base + "/console/attention")
        row = tab.page.locator("#n-ship-9-label")
        await expect(row.locator("label.reauth")).to_be_hidden()  # the tab holds the proof
        await row.locator("input[value=not_delivered]").check()
        await row.locator("input[name=confirm]").check()
        await row.locator("button[type=submit]").click()
        await expect(tab.page.locator("#flash")).to_contain_text("ship-9/label")
        assert tab.csp_violations() == [] and tab.errors == []
    finally:
        await server.close()


async def test_after_logout_the_old_cookie_shows_the_login_form(
    console: Console, tabs: Any
) -> None:
    tab = await tabs(console.base)
    await tab.login(ADMIN, "/console/chain")
    await expect(tab.page.locator("#wording")).to_be_visible()
    [cookie] = await tab.page.context.cookies()
    await tab.page.click("header form.inline button[type=submit]")  # log out
    await tab.page.wait_for_url("**/console/login")
    assert await tab.page.evaluate("localStorage.getItem('fencegate.console.proof')") is None
    await tab.page.context.add_cookies([cookie])  # the cookie, kept from before the logout
    await tab.page.goto(console.base + "/console/chain")
    await expect(tab.page.locator("#key")).to_be_visible()
    assert tab.csp_violations() == []
