"""What the console, the API and the SDK show is what the gateway sent and wrote: the
downstream key a receiver got and the audit reasons (the console's
reason filter offers exactly the vocabulary of gateway.core.reasons)."""

from __future__ import annotations

import html
import re

from gateway.client import Scheduler
from gateway.core.reasons import REASONS
from tests.conftest import Upstream
from tests.console.conftest import AUDITOR, SCHEDULER, WORKER, Console
from tests.console.test_console_http import logged_in


async def test_the_key_shown_is_the_key_the_downstream_received(
    console: Console, upstream: Upstream
) -> None:
    """Two tenants (``default``, ``other``): the webhook's Idempotency-Key is tenant-qualified,
    and the API's effect and job views, the SDK and the console's job page show that string."""
    await console.register("order-7", 1)
    resp = await console.effect("order-7", "charge", 1, adapter="hook")
    assert resp.status == 200, await resp.text()
    [received] = upstream.received
    sent = received.headers["Idempotency-Key"]
    assert sent == "default/order-7:charge"
    assert (await resp.json())["idempotency_key"] == sent

    client = console.gw.client
    effect = await client.get("/v1/jobs/order-7/effects/charge", headers=console.as_(WORKER))
    assert (await effect.json())["idempotency_key"] == sent
    job = await client.get("/v1/jobs/order-7", headers=console.as_(SCHEDULER))
    assert (await job.json())["effects"]["charge"]["idempotency_key"] == sent
    async with Scheduler(console.base, api_key=SCHEDULER) as sdk:
        assert (await sdk.job("order-7"))["effects"]["charge"]["idempotency_key"] == sent

    session, _ = await logged_in(console, AUDITOR)
    async with session, session.get(console.base + "/console/jobs/order-7") as page:
        assert page.status == 200
        text = html.unescape(await page.text())
    assert f'<dd class="mono">{sent}</dd>' in text  # the key line
    assert f'"idempotency_key": "{sent}"' in text  # the raw JSON of the record
    bare = [m.start() for m in re.finditer(r"(?<![/\w-])order-7:charge", text)]
    assert bare == [], "the page shows the key without its tenant somewhere"


async def test_the_reason_filter_offers_exactly_the_vocabulary(console: Console) -> None:
    session, _ = await logged_in(console, AUDITOR)
    async with session:
        async with session.get(console.base + "/console/rejections") as page:
            text = await page.text()
        select = re.search(r'<select name="reason">(.*?)</select>', text, re.S)
        assert select is not None
        offered = [v for v in re.findall(r'<option value="([^"]*)"', select[1]) if v]
        assert offered == list(REASONS)
        # a real reason filters the feed: the stale calls' entries, nothing else
        await console.register("rf-1", 2)
        stale = await console.effect("rf-1", "s", 1)
        assert stale.status == 409
        async with session.get(
            console.base + "/console/rejections.json", params={"reason": "stale_generation"}
        ) as resp:
            rows = await resp.json()
        assert [r["reason"] for r in rows] == ["stale_generation"]
        async with session.get(
            console.base + "/console/rejections", params={"reason": "future_generation"}
        ) as resp:
            assert resp.status == 400  # not a reason anything writes
