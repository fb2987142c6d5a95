"""What one console request may make the gateway read: exports, chain checks, anchor files.
Measured on the Redis side, with no timing: ``INFO stats`` ``total_net_output_bytes`` is every
byte Redis sent to any client, so what a request costs is the difference around it."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.console import state
from gateway.store.anchors import anchor_path
from tests.conftest import Gateway

FEED = "fg:audit:default"


def _sent(redis_sync: Any) -> int:
    return int(redis_sync.info("stats")["total_net_output_bytes"])


def _fill_feed(redis_sync: Any, n: int) -> None:
    """``n`` rejections in the default tenant's feed, as the gateway writes them."""
    for start in range(0, n, 5000):
        pipe = redis_sync.pipeline(transaction=False)
        for i in range(start, min(n, start + 5000)):
            pipe.xadd(FEED, {
                "at": "1", "tenant": "default", "job_id": f"j{i % 97}", "job_audit_id": "1-0",
                "step": f"s{i}", "reason": "stale_generation", "presented": "1", "current": "2",
                "worker_id": "zombie", "adapter": "hook",
            })  # fmt: skip
        pipe.execute()


async def test_an_export_that_matches_nothing_reads_its_scan_budget_and_says_where_to_go_on(
    gw: Gateway, redis_sync: Any
) -> None:
    _fill_feed(redis_sync, 120_000)
    before = _sent(redis_sync)
    redis_sync.xrange(FEED)
    whole = _sent(redis_sync) - before  # what reading the whole feed costs

    before = _sent(redis_sync)
    resp = await gw.client.get("/console/rejections.json", params={"reason": "superseded"})
    body = await resp.json()  # all of it: the export is over
    spent = _sent(redis_sync) - before

    assert resp.status == 200 and body == []
    budget = gw.settings.console.export_scan_entries
    assert budget == 50_000  # the default
    assert spent < whole * 0.6, f"one export read {spent} bytes, the whole feed is {whole}"
    # cut short by its budget: it says where the next export goes on
    cursor = resp.headers["Fencegate-Export-Next"]
    rows = redis_sync.xrevrange(FEED, "+", "-", count=budget)
    assert cursor == rows[-1][0]
    nxt = await gw.client.get("/console/rejections.csv", params={"reason": "superseded",
                                                                  "cursor": cursor})  # fmt: skip
    assert nxt.status == 200 and (await nxt.text()).count("\n") == 1  # the header row
    assert nxt.headers["Fencegate-Export-Next"] != cursor
    last = await gw.client.get(
        "/console/rejections.csv", params={"cursor": nxt.headers["Fencegate-Export-Next"]}
    )
    # no filter: the rest of the feed (20,000 rows) is more than one export's 10,000 rows
    assert (await last.text()).count("\n") == 10_001
    assert "Fencegate-Export-Next" in last.headers


async def test_an_export_that_reaches_the_end_has_no_next_cursor(
    gw: Gateway, redis_sync: Any
) -> None:
    _fill_feed(redis_sync, 30)
    resp = await gw.client.get("/console/rejections.json", params={"worker": "zombie"})
    assert resp.status == 200 and len(await resp.json()) == 30
    assert "Fencegate-Export-Next" not in resp.headers
    bad = await gw.client.get("/console/rejections.json", params={"cursor": "nope"})
    assert bad.status == 400


async def test_exports_running_at_once_are_capped_per_login(gw: Gateway, redis_sync: Any) -> None:
    """One export per login at a time (``console.exports_per_session``): a second one while
    the first waits on Redis gets 429 ``too_many_held`` at once, without reading Redis."""
    _fill_feed(redis_sync, 10)
    held = state(gw.app).exports
    assert held is not None
    # every command waits 1 s (less than the gateway's Redis timeout; the pause ends by itself)
    redis_sync.execute_command("CLIENT", "PAUSE", 1000, "ALL")
    first = asyncio.ensure_future(gw.client.get("/console/rejections.csv"))
    async with asyncio.timeout(5):
        while not held.held:  # noqa: ASYNC110 - polls another component's state
            await asyncio.sleep(0.01)
    second = await gw.client.get("/console/rejections.json")
    assert second.status == 429 and second.headers["Retry-After"]
    assert "exports_per_session" in await second.text()
    resp = await first
    assert resp.status == 200 and (await resp.text()).count("\n") == 11
    assert not held.held  # given back
    again = await gw.client.get("/console/rejections.json")
    assert again.status == 200


async def _checked(gw: Gateway, tenant: str = "default") -> dict[str, Any]:
    runs = state(gw.app).runs
    run = runs.start(tenant)
    async with asyncio.timeout(20):
        while not run.done:  # noqa: ASYNC110 - polls another component's state
            await asyncio.sleep(0.05)
    assert run.summary is not None and "error" not in run.summary, run.summary
    summary: dict[str, Any] = run.summary
    return summary


async def test_a_tenants_chain_check_shows_its_own_anchor_problems_without_the_path(
    gw: Gateway,
) -> None:
    """A tenant's check shows its own anchors' problems only, as ``anchor line <n>``, never
    the server's file."""
    await gw.register("mine", generation=1)
    path = anchor_path(gw.settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write('{"tenant": "globex", "job_id": "payroll", "entry": "nope"}\n')  # another's
        f.write('{"tenant": "default", "job_id": "mine", "entry": 7}\n')  # this tenant's
        f.write('{"torn anchor line\n')  # names no tenant
    summary = await _checked(gw)
    details = [p["detail"] for p in summary["problems"]]
    text = "\n".join(details + summary.get("notes", []))
    assert str(path) not in text and str(path.parent) not in text
    assert "globex" not in text and "payroll" not in text
    assert any(d.startswith("anchor line 2: not an anchor") for d in details), details
    assert any("1 anchor line(s) unreadable or naming no tenant" in d for d in details), details
    page = await gw.client.get("/console/chain")
    body = await page.text()
    assert page.status == 200 and str(path) not in body and "globex" not in body


async def test_one_chain_check_reads_at_most_its_bound_and_clicks_reuse_the_last(
    make_gateway: Any, redis_sync: Any
) -> None:
    """A stale worker grows its job's chain (every refused call is an entry): one check reads
    at most ``console.chain_check_max_entries`` and says it stopped; a second click within
    ``console.chain_check_interval_seconds`` starts nothing (the same run is shown)."""
    gw: Gateway = await make_gateway(console={"chain_check_max_entries": 50})
    await gw.register("zombie", generation=2)
    for i in range(60):
        assert (await gw.effect("zombie", f"s{i}", 1)).status == 409
    await gw.register("other", generation=1)
    runs = state(gw.app).runs
    summary = await _checked(gw)
    assert summary["capped"] is True and summary["entries"] == 50
    assert any("stopped after 50 entries" in n for n in summary["notes"])
    assert not any("newest entries missing" in p["detail"] for p in summary["problems"])
    first = runs.runs["default"]
    assert runs.start("default") is first  # within the interval: no new check
    page = await gw.client.get("/console/chain")
    assert "chain-next" in await page.text()


async def test_a_job_page_of_a_chain_longer_than_it_shows_is_not_called_broken(
    gw: Gateway,
) -> None:
    """A zombie's rejections grew one job's chain past the 5,000 entries a job page reads:
    the page checks the entries it shows and says they are the first ones (the head is
    the newest entry's, which it did not read: no "newest entries missing")."""
    from gateway.http import appkeys as K
    from gateway.store.keys import JobKeys

    await gw.register("zombie", generation=2)
    store, keys = gw.app[K.STORE], JobKeys("default", "zombie")
    for start in range(0, 5001, 500):
        await asyncio.gather(*(
            store.admit(keys, f"s{i}", generation=1, intent_sha256="0" * 64, adapter="hook",
                        operation="send", worker_id="zombie", resolvable=False)
            for i in range(start, min(5001, start + 500))
        ), return_exceptions=True)  # fmt: skip  # each a stale_generation rejection, audited
    page = await gw.client.get("/console/jobs/zombie")
    body = await page.text()
    assert page.status == 200
    assert "chain broken" not in body and "(the first 5000 entries)" in body
