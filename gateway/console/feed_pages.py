"""The overview and the rejections feed: page, live stream, CSV/JSON export."""

from __future__ import annotations

import csv
import io
import json
import time
from typing import Any

import aiohttp_jinja2
from aiohttp import web

from gateway.console.context import CONSOLE, render, session_of
from gateway.console.data import (
    SCAN_CAP,
    BadFilter,
    Filters,
    Row,
    entry_id,
    feed_after,
    feed_page,
    feed_top,
)
from gateway.console.live import id_key, next_or_closed, open_stream
from gateway.core.reasons import REASONS
from gateway.store.console_reads import ConsoleReads

__all__ = ["add_routes"]

PAGE = 50
EXPORT_MAX = 10_000  # rows of one export
NEXT_HEADER = "Fencegate-Export-Next"  # the cursor an export cut short goes on from
BACKFILL = 500  # entries read per stream connection before it ends (the browser resumes)
_FORMULA = ("=", "+", "-", "@", "\t", "\r")
_FIELDS = (
    "id",
    "at",
    "job_id",
    "job_entry",
    "step",
    "reason",
    "presented",
    "current",
    "worker_id",
    "adapter",
)


def _reads(request: web.Request) -> ConsoleReads:
    return request.app[CONSOLE].store_of().console_reads


async def overview(request: web.Request) -> web.Response:
    session = session_of(request)
    store = request.app[CONSOLE].store
    now_ms = int(time.time() * 1000)
    data: dict[str, Any] = await store.overview(session.tenant, now_ms=now_ms)
    health = await store.readiness()  # why this gateway refuses, when it does (as /readyz)
    return render(request, "overview.html", {"overview": data, "now_ms": now_ms, "health": health})


async def rejections(request: web.Request) -> web.Response:
    session = session_of(request)
    filters = Filters.parse(request.query)
    cursor = entry_id(request.query.get("cursor"))
    call = _reads(request)
    top = await feed_top(call, session.tenant)
    rows, next_cursor = await feed_page(call, session.tenant, filters, cursor=cursor, limit=PAGE)
    # live while looking at the newest page of a window that is still open
    live = request.query.get("live", "1") != "0" and cursor is None and filters.until_ms is None
    return render(
        request,
        "rejections.html",
        {
            "rows": rows,
            "filters": filters,
            "reasons": REASONS,
            "next_cursor": next_cursor,
            "cursor": cursor,
            "live": live,
            "top": top,
            "scan_cap": SCAN_CAP,
        },
    )


def _cell(value: Any) -> str:
    """A CSV cell a spreadsheet will not run as a formula (values come from outside)."""
    text = "" if value is None else str(value)
    return "'" + text if text.startswith(_FORMULA) else text


async def export(request: web.Request) -> web.Response:
    """The filtered set, newest first, as CSV or JSON: at most :data:`EXPORT_MAX` rows from at
    most ``console.export_scan_entries`` feed entries, older than ``cursor`` when given. An
    export cut short by either bound says where the next one starts: the header
    :data:`NEXT_HEADER` (absent when the export reached the end of the window)."""
    console = request.app[CONSOLE]
    session = session_of(request)
    kind = request.match_info["kind"]
    filters = Filters.parse(request.query)
    cursor = entry_id(request.query.get("cursor"))
    assert console.exports is not None
    with console.exports.holding(session.nonce, session.tenant):
        rows, next_cursor = await feed_page(
            _reads(request),
            session.tenant,
            filters,
            cursor=cursor,
            limit=EXPORT_MAX,
            scan=console.settings.console.export_scan_entries,
        )
    buf = io.StringIO()
    if kind == "csv":
        writer = csv.writer(buf)
        writer.writerow(_FIELDS)
        for row in rows:
            item = row.as_dict()
            writer.writerow([_cell(item[f]) for f in _FIELDS])
    else:
        json.dump([row.as_dict() for row in rows], buf, separators=(",", ":"))
        buf.write("\n")
    headers = {
        "Content-Disposition": f'attachment; filename="rejections-{session.tenant}.{kind}"',
    }
    if next_cursor is not None:
        headers[NEXT_HEADER] = next_cursor
    return web.Response(
        text=buf.getvalue(),
        content_type="text/csv" if kind == "csv" else "application/json",
        charset="utf-8",
        headers=headers,
    )


async def stream(request: web.Request) -> web.StreamResponse:
    """New rows as they arrive (SSE, ``id`` = the feed entry id; ``Last-Event-ID`` resumes)."""
    console = request.app[CONSOLE]
    session = session_of(request)
    filters = Filters.parse(request.query)
    try:
        after = entry_id(request.headers.get("Last-Event-ID") or request.query.get("after"))
    except BadFilter:
        raise web.HTTPBadRequest(text="after: not a stream entry id") from None
    call = _reads(request)
    queue = await console.pump.subscribe(session.tenant)
    try:
        async with open_stream(
            request, console.streams, session=session.nonce, tenant=session.tenant
        ) as (sse, closed):
            last = after or await feed_top(call, session.tenant)

            async def send(entry: str, fields: dict[str, str]) -> None:
                row = Row.of(entry, fields)
                if filters.matches(row):
                    html = aiohttp_jinja2.render_string("_row.html", request, {"row": row})
                    await sse.send(html, id=entry, event="rejection")
                else:  # the id alone: a reconnect resumes after it (no event fires)
                    await sse.send("", id=entry)

            backlog, more = await feed_after(call, session.tenant, last, BACKFILL)
            for entry, fields in backlog:
                await send(entry, fields)
                last = entry
            if more:  # end here; the browser reconnects with Last-Event-ID and goes on
                return sse
            while True:
                entry, fields = await next_or_closed(queue, closed)
                if not entry:
                    break
                if id_key(entry) <= id_key(last):
                    continue
                await send(entry, fields)
                last = entry
            return sse
    finally:
        console.pump.unsubscribe(session.tenant, queue)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/", overview, name="overview")
    app.router.add_get("/rejections", rejections, name="rejections")
    app.router.add_get("/rejections/stream", stream, name="rejections_stream")
    app.router.add_get(r"/rejections.{kind:csv|json}", export, name="export")
