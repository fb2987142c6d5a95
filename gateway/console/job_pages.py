"""A job's history, the steps that need a decision (and their Resolve form), the audit chain."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.console.access import Session
from gateway.console.chain import check_job_chain, honest_wording
from gateway.console.context import CONSOLE, Console, error_page, render, see_other, session_of
from gateway.console.data import JOB_CAP, iso, job_entries
from gateway.console.live import open_stream
from gateway.core import fastjson
from gateway.core.errors import FencegateError
from gateway.core.names import NAME
from gateway.fencing.resolution import resolve_step
from gateway.store.keys import JobKeys

__all__ = ["add_routes"]

ATTENTION_PAGE = 50


def _name(value: str, what: str) -> str:
    if not NAME.fullmatch(value):
        raise web.HTTPNotFound(text=f"no such {what}")
    return value


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


@dataclass(frozen=True, slots=True)
class Event:
    """One line of a job's history: an audit entry, or a moment of an effect record."""

    anchor: str
    at_ms: int
    kind: str  # registered | rejected | resolved | effect
    step: str
    generation: str
    current: str
    what: str
    who: str
    detail: str
    raw: str
    order: int

    @property
    def at(self) -> str:
        return iso(self.at_ms)


def _audit_event(n: int, entry: str, f: dict[str, str]) -> Event:
    at = int(f.get("at") or entry.partition("-")[0] or 0)
    raw = _pretty({"id": entry, **f})
    if f.get("event") == "registered":
        previous = f.get("previous", "")
        return Event(
            f"a-{entry}",
            at,
            "registered",
            "",
            f.get("generation", ""),
            "",
            f"generation {f.get('generation', '?')} registered"
            + (f" (fence was {previous})" if previous and previous != "0" else ""),
            f.get("by", ""),
            f"lease {f['lease_ms']} ms" if f.get("lease_ms") else "",
            raw,
            n,
        )
    reason = f.get("reason", f.get("event", ""))
    if reason.startswith("operator_resolved_"):
        outcome = reason.removeprefix("operator_resolved_").replace("_", " ")
        return Event(
            f"a-{entry}",
            at,
            "resolved",
            f.get("step", ""),
            "",
            "",
            f"resolved by an operator: {outcome}",
            f.get("by") or f.get("worker_id", ""),
            "",
            raw,
            n,
        )
    return Event(
        f"a-{entry}",
        at,
        "rejected",
        f.get("step", ""),
        f.get("presented", ""),
        f.get("current", ""),
        f"refused: {reason}",
        f.get("worker_id", ""),
        f.get("adapter", ""),
        raw,
        n,
    )


async def job_page(request: web.Request) -> web.Response:
    console = request.app[CONSOLE]
    session = session_of(request)
    job = _name(request.match_info["job"], "job")
    keys = JobKeys(session.tenant, job)  # the session's tenant only: another's job is 404
    store = console.store
    view = await store.job(keys)
    job_hash, rows = await job_entries(console.store_of().console_reads, keys)
    cut = len(rows) > JOB_CAP  # a longer chain: its first JOB_CAP entries are shown
    rows = rows[:JOB_CAP]
    if view is None and not rows:
        raise web.HTTPNotFound(text=f"no job {job!r} in this tenant")
    events = [_audit_event(n, entry, f) for n, (entry, f) in enumerate(rows)]
    effects = []
    for step, r in sorted((view.effects if view else {}).items()):
        key = console.tenancy.key(session.tenant, job, step, r.adapter)
        raw = {
            "job_id": job,
            "step": step,
            "state": r.state,
            "generation": r.generation,
            "intent_sha256": r.intent_sha256,
            "adapter": r.adapter,
            "operation": r.operation,
            "idempotency_key": key,
            "result": r.result,
            "error": r.error,
            "attempts": r.attempts,
            "worker_id": r.worker_id,
            "created_at": iso(r.created_at_ms),
            "updated_at": iso(r.updated_at_ms),
            "resolved_by": getattr(r, "resolved_by", None),
        }
        effects.append(
            {
                "step": step,
                "key": key,
                "record": r,
                "raw": _pretty(raw),
                "raw_result": _pretty(r.result),
                "raw_error": _pretty(r.error),
            }
        )
        events.append(
            Event(
                f"s-{step}",
                r.updated_at_ms or r.created_at_ms,
                "effect",
                step,
                str(r.generation),
                "",
                f"{r.adapter}.{r.operation}: {r.state}",
                r.worker_id or "",
                "",
                _pretty(raw),
                len(events),
            )
        )
    events.sort(key=lambda e: (e.at_ms, e.order))
    problems = check_job_chain(rows, job_hash.get("audit_head"), console.audit_keys, whole=not cut)
    now_ms = int(time.time() * 1000)
    lease = view.lease_expires_at_ms if view else None
    registered = [e for e in events if e.kind == "registered"]
    fence = view.fence if view else 0
    return render(
        request,
        "job.html",
        {
            "job": job,
            "view": view,
            "fence": fence,
            "lease_expired": bool(lease and lease <= now_ms),
            "lease_at": iso(lease),
            "registered_at": iso(int(job_hash.get("registered_at") or 0)),
            "registrations": registered,
            "completed": job_hash.get("completed") or job_hash.get("completed_at") or "",
            "events": events,
            "effects": effects,
            "chain_problems": problems,
            "chain_entries": f"the first {len(rows)}" if cut else len(rows),
            "chain_wording": honest_wording(bool(console.audit_keys)),
            "job_raw": _pretty(job_hash),
        },
    )


async def attention(request: web.Request) -> web.Response:
    console = request.app[CONSOLE]
    session = session_of(request)
    after = request.query.get("after") or None
    try:
        items = await console.store.attention(session.tenant, limit=ATTENTION_PAGE, after=after)
    except ValueError:
        raise web.HTTPBadRequest(text="after: not a cursor of this page") from None
    for item in items:
        item["age"] = _age(int(item.get("age_ms") or 0))
        item["last_error_text"] = (
            "" if item.get("last_error") is None else _pretty(item["last_error"])
        )
    return render(
        request,
        "attention.html",
        {
            "items": items,
            "next_after": items[-1]["cursor"] if len(items) == ATTENTION_PAGE else None,
            "resolved": request.query.get("resolved", ""),
        },
    )


def _age(ms: int) -> str:
    s = ms // 1000
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    return f"{s // 3600} h {s % 3600 // 60} min"


NOT_PROVEN = (
    "this browser holds no proof of this login (it is kept by the console's script when you "
    "log in): type your API key in the form, or log in again"
)


def _proven(console: Console, session: Session, form: Any) -> bool:
    """A state-changing form carries the proof of login, or the session's key typed again
    (a cookie replayed from elsewhere, with the CSRF token read from a page, has neither)."""
    return console.sessions.proven(
        session, str(form.get("proof") or ""), str(form.get("key") or "")
    )


async def resolve(request: web.Request) -> web.Response:
    """The Resolve form: the same service call as ``POST …/resolve``, as the session's key."""
    console = request.app[CONSOLE]
    session = session_of(request)
    if console.read_only:
        return error_page(request, 403, "this console is read-only ([console] read_only)")
    job = _name(request.match_info["job"], "job")
    step = _name(request.match_info["step"], "step")
    form = await request.post()
    if not console.sessions.csrf_ok(session, str(form.get("csrf") or "")):
        return error_page(request, 403, "the form's CSRF token does not match; reload the page")
    if not _proven(console, session, form):
        return error_page(request, 403, NOT_PROVEN)
    outcome = str(form.get("outcome") or "")
    if outcome not in ("delivered", "not_delivered"):
        return error_page(request, 400, "choose delivered or not delivered")
    if form.get("confirm") != "yes":
        return error_page(request, 400, "tick the confirmation: a resolution cannot be undone")
    text = str(form.get("result") or "").strip()
    result: Any = None
    if text:
        if len(text.encode()) > console.settings.server.max_body_bytes:
            return error_page(request, 413, "the result is too large")
        try:
            result = fastjson.loads_exact(text.encode())
        except (ValueError, RecursionError) as exc:
            return error_page(request, 400, f"the result is not valid JSON: {exc}")
    keys = JobKeys(session.tenant, job)
    try:
        await resolve_step(
            console.store,
            keys,
            step,
            delivered=outcome == "delivered",
            result=result,
            role=session.role,
            by=session.who,
        )
    except FencegateError as exc:
        return error_page(request, exc.http_status, exc.detail)
    return see_other(f"/console/attention?resolved={job}/{step}")


async def chain_page(request: web.Request) -> web.Response:
    console = request.app[CONSOLE]
    session = session_of(request)
    data = await console.store.overview(session.tenant, now_ms=int(time.time() * 1000))
    run = console.runs.runs.get(session.tenant) if console.runs else None
    return render(
        request,
        "chain.html",
        {
            "last": data.get("last_chain_check"),
            "running": run is not None and not run.done,
            "run": run,
            "wording": honest_wording(bool(console.audit_keys)),
            "next_at_ms": console.runs.next_at_ms(session.tenant) if console.runs else 0,
            "interval_ms": console.runs.interval_ms if console.runs else 0,
            "now_ms": int(time.time() * 1000),
        },
    )


async def chain_verify(request: web.Request) -> web.Response:
    console = request.app[CONSOLE]
    session = session_of(request)
    form = await request.post()
    if not console.sessions.csrf_ok(session, str(form.get("csrf") or "")):
        return error_page(request, 403, "the form's CSRF token does not match; reload the page")
    if not _proven(console, session, form):
        return error_page(request, 403, NOT_PROVEN)
    assert console.runs is not None
    console.runs.start(session.tenant)
    return see_other("/console/chain")


async def chain_stream(request: web.Request) -> web.StreamResponse:
    """Progress of this process's check of the session's tenant (SSE), then its result."""
    console = request.app[CONSOLE]
    session = session_of(request)
    run = console.runs.runs.get(session.tenant) if console.runs else None
    async with open_stream(
        request, console.streams, session=session.nonce, tenant=session.tenant
    ) as (sse, closed):
        if run is None:
            return sse
        while not closed.done():
            changed = run.changed
            await sse.send(f"{run.jobs} jobs, {run.entries} entries checked", event="progress")
            if run.done:
                await sse.send("done", event="done")
                break
            waiter: asyncio.Future[Any] = asyncio.ensure_future(changed.wait())
            await asyncio.wait([waiter, closed], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
    return sse


def add_routes(app: web.Application) -> None:
    app.router.add_get("/jobs/{job}", job_page, name="job")
    app.router.add_get("/attention", attention, name="attention")
    app.router.add_post("/jobs/{job}/steps/{step}/resolve", resolve, name="resolve")
    app.router.add_get("/chain", chain_page, name="chain")
    app.router.add_post("/chain/verify", chain_verify, name="chain_verify")
    app.router.add_get("/chain/stream", chain_stream, name="chain_stream")
