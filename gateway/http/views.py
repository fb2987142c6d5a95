"""Thin aiohttp views: parse → authorise → service/store → respond.

:data:`ROUTES` is the single route table: :mod:`gateway.http.app` mounts it and
:mod:`gateway.http.openapi` describes it.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web
from pydantic import BaseModel

from gateway.core.errors import Forbidden, InvalidRequest, NotFound
from gateway.core.names import checked_name
from gateway.fencing.resolution import resolve_step
from gateway.http import appkeys as K
from gateway.http.attention import get_attention
from gateway.http.auth import caller_as, job_as, job_keys
from gateway.http.generations import generation_of
from gateway.http.job_state_models import job_state_out
from gateway.http.models import (
    AttentionPageOut,
    AuditEntryOut,
    AuditPageOut,
    CancelOut,
    EffectAcceptedOut,
    EffectBody,
    EffectOut,
    EffectRecordOut,
    GenerationOut,
    HealthOut,
    HeartbeatOut,
    JobOut,
    ReadyOut,
    RegisterBody,
    ResolveBody,
    iso_ms,
)
from gateway.http.parsing import (
    CURSOR_RE,
    JSON,
    LIMIT_RE,
    U64,
    read_body,
    record_out,
    respond,
    respond_fields,
    step_of,
    worker_id_of,
)
from gateway.http.prefer import parse_prefer
from gateway.runtime.logging import bind
from gateway.runtime.metrics import CONTENT_TYPE

__all__ = ["HOT_HANDLERS", "ROUTES", "Route"]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    summary: str
    roles: tuple[str, ...] = ()
    body: type[BaseModel] | None = None
    responses: dict[int, type[BaseModel] | None] = field(default_factory=dict)
    headers: tuple[str, ...] = ()
    query: tuple[str, ...] = ()
    problems: tuple[int, ...] = ()


async def register_generation(request: web.Request) -> web.Response:
    keys, principal = job_as(request)
    principal.require_registration()
    body: RegisterBody = await read_body(request, RegisterBody, empty_ok=True)
    reg = await request.app[K.STORE].register(
        keys,
        body.generation,
        body.lease_ms,
        by=principal.who,
        request_id=_idempotent_request(request),
    )
    bind(generation=reg.generation)
    request.app[K.METRICS].registrations.labels("created" if reg.created else "current").inc()
    signer = request.app[K.SIGNER]
    token = signer.sign(keys.tenant, keys.job_id, reg.generation) if signer else str(reg.generation)
    out = GenerationOut(
        job_id=keys.job_id,
        generation=reg.generation,
        token=token,
        lease_expires_at=iso_ms(reg.lease_expires_at_ms),
    )
    return respond(out, 201 if reg.created else 200)


_IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,255}")


def _idempotent_request(request: web.Request) -> str | None:
    """The request id of a registration sent with ``Idempotency-Key`` (a scheduler's retry of
    an allocation gets the generation the first one allocated, not another); None without."""
    key = request.headers.get("Idempotency-Key")
    if key is None:
        return None
    if not _IDEMPOTENCY_KEY.fullmatch(key):
        raise InvalidRequest("Idempotency-Key must be 1 to 255 visible ASCII characters")
    return "idem-" + hashlib.sha256(key.encode()).hexdigest()[:32]


async def heartbeat(request: web.Request) -> web.Response:
    keys, principal = job_as(request, "worker")
    worker_id = worker_id_of(request)
    gen = await generation_of(request, keys, worker_id=worker_id)
    _, lease = await request.app[K.STORE].heartbeat(keys, gen, worker_id or "", by=principal.who)
    out = {
        "job_id": keys.job_id,
        "generation": gen,
        "current": True,
        "lease_expires_at": iso_ms(lease),
    }
    return respond_fields(HeartbeatOut, out)


async def perform_effect(request: web.Request) -> web.Response:
    keys, principal = job_as(request, "worker")
    step = step_of(request)
    worker_id = worker_id_of(request)
    body: EffectBody = await read_body(request, EffectBody)
    bind(adapter=body.adapter)
    gen = await generation_of(request, keys, step=step, worker_id=worker_id, adapter=body.adapter)
    respond_async = "respond-async" in parse_prefer(request.headers.getall("Prefer", ()))
    res = await request.app[K.SERVICE].perform(
        keys,
        step,
        generation=gen,
        adapter_name=body.adapter,
        operation=body.operation,
        payload=body.payload,
        worker_id=worker_id,
        respond_async=respond_async,
        by=principal.who,
    )
    bind(outcome="replayed" if res.replayed else res.state)
    if res.state in ("pending", "dispatching"):  # accepted for the relay
        location = f"/v1/jobs/{keys.job_id}/effects/{step}"
        accepted = EffectAcceptedOut(
            job_id=res.job_id,
            step=res.step,
            generation=res.generation,
            state=res.state,
            idempotency_key=res.idempotency_key,
            adapter=res.adapter,
            location=location,
        )
        headers = {"Location": location, "Preference-Applied": "respond-async"}
        return respond(accepted, 202, headers=headers)
    out = {
        "job_id": res.job_id,
        "step": res.step,
        "generation": res.generation,
        "state": "succeeded",
        "replayed": res.replayed,
        "idempotency_key": res.idempotency_key,
        "adapter": res.adapter,
        "result": res.result,
    }
    replayed = {"Idempotent-Replayed": "true"} if res.replayed else None
    return respond_fields(EffectOut, out, headers=replayed)


async def get_effect(request: web.Request) -> web.Response:
    keys = job_keys(request, "worker", "auditor")
    step = step_of(request)
    record = await request.app[K.STORE].effect(keys, step)
    if record is None:
        raise NotFound(f"no effect recorded for {keys.job_id}:{step}")
    return respond(record_out(request.app[K.TENANCY], keys, step, record))


async def resolve_effect(request: web.Request) -> web.Response:
    keys, principal = job_as(request, "auditor")
    step = step_of(request)
    body: ResolveBody = await read_body(request, ResolveBody)
    record = await resolve_step(
        request.app[K.STORE],
        keys,
        step,
        delivered=body.outcome == "delivered",
        result=body.result,
        role=principal.role,
        by=principal.who,
    )
    return respond(record_out(request.app[K.TENANCY], keys, step, record))


async def get_job(request: web.Request) -> web.Response:
    keys = job_keys(request, "scheduler", "auditor")
    view = await request.app[K.STORE].job(keys)
    if view is None:
        raise NotFound(f"no job {keys.job_id!r} is known")
    state = await request.app[K.JOBSTATE].view(keys)  # completion, checkpoints, outputs
    tenancy = request.app[K.TENANCY]
    out = JobOut(
        job_id=keys.job_id,
        fence=view.fence,
        lease_ms=view.lease_ms,
        lease_expires_at=iso_ms(view.lease_expires_at_ms),
        cancelled=view.cancelled,
        effects={s: record_out(tenancy, keys, s, r) for s, r in view.effects.items()},
        **job_state_out(keys.job_id, state),
    )
    return respond(out)


async def cancel_job(request: web.Request) -> web.Response:
    keys = job_keys(request, "scheduler")
    fence, already = await request.app[K.STORE].cancel(keys)
    return respond(
        CancelOut(job_id=keys.job_id, cancelled=True, fence=fence, already_cancelled=already)
    )


async def audit_rejections(request: web.Request) -> web.Response:
    principal = caller_as(request, "auditor")
    q = request.query
    job_id = checked_name(q["job"], "job") if "job" in q else None
    raw_limit = q.get("limit", "100")
    if not LIMIT_RE.fullmatch(raw_limit) or not 1 <= int(raw_limit) <= 1000:
        raise InvalidRequest("limit must be an integer from 1 to 1000")
    limit = int(raw_limit)
    cursor = q.get("cursor")
    if cursor is not None:
        m = CURSOR_RE.fullmatch(cursor)
        # a stream id: two unsigned 64-bit numbers, above 0-0 (the page ends before it)
        if m is None or int(m[1]) > U64 or int(m[2]) > U64 or int(m[1]) + int(m[2]) == 0:
            raise InvalidRequest("cursor must be a value returned as next_cursor")
    entries, next_cursor = await request.app[K.STORE].audit(
        principal.tenant, job_id=job_id, limit=limit, cursor=cursor
    )
    items = [
        AuditEntryOut(
            id=e.id,
            at=iso_ms(e.at_ms),
            job_id=e.job_id,
            step=e.step,
            reason=e.reason,
            presented=e.presented,
            current=e.current,
            worker_id=e.worker_id,
            adapter=e.adapter,
            by=e.by,
        )
        for e in entries
    ]
    return respond(AuditPageOut(items=items, next_cursor=next_cursor))


async def healthz(request: web.Request) -> web.Response:
    return respond(HealthOut(status="ok"))


async def readyz(request: web.Request) -> web.Response:
    r = await request.app[K.STORE].readiness()
    checks, cause, detail = r.checks, r.cause, r.detail
    if floors := request.app[K.FLOORS]:  # free space kept on the volumes the gateway writes
        checks["disk"] = all(floor.room_for(0) for floor in floors)
        if not checks["disk"] and cause is None:
            cause = "disk_full"
            detail = "free space on the embedded Redis's volume is below redis.min_free_mb"
    ok = all(checks.values())
    out = ReadyOut(
        status="ready" if ok else "unavailable",
        checks=checks,
        cause=cause,
        marker=r.marker,
        detail=detail,
        quarantine=r.quarantine,
    )
    return respond(out, 200 if ok else 503)


def _loopback(peer: str | None) -> bool:
    if not peer:
        return True  # unix socket
    try:
        return ipaddress.ip_address(peer).is_loopback
    except ValueError:
        return False


async def metrics(request: web.Request) -> web.Response:
    if not request.app[K.SETTINGS].server.metrics_public and not _loopback(request.remote):
        raise Forbidden("metrics are served to loopback peers only (server.metrics_public)")
    return web.Response(
        body=request.app[K.METRICS].render(), headers={"Content-Type": CONTENT_TYPE}
    )


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=request.app[K.OPENAPI], content_type=JSON)


_FENCED = (400, 401, 403, 409, 503)

ROUTES: tuple[Route, ...] = (
    Route(
        "POST",
        "/v1/jobs/{job}/generations",
        register_generation,
        "Register a generation at takeover (omit `generation` to allocate the next one); "
        "a worker key with `claims = true` may too",
        roles=("scheduler", "worker with claims = true"),
        body=RegisterBody,
        headers=("Idempotency-Key",),
        responses={201: GenerationOut, 200: GenerationOut},
        problems=(400, 401, 403, 409, 413, 415, 503),
    ),
    Route(
        "POST",
        "/v1/jobs/{job}/fence",
        heartbeat,
        "Heartbeat: is my token still current? Renews the lease",
        roles=("worker",),
        responses={200: HeartbeatOut},
        headers=("Fencing-Token", "Worker-Id"),
        problems=(*_FENCED, 415),
    ),
    Route(
        "POST",
        "/v1/jobs/{job}/effects/{step}",
        perform_effect,
        "Perform a side effect under the fence (Prefer: respond-async: 202, the relay performs it)",
        roles=("worker",),
        body=EffectBody,
        responses={200: EffectOut, 202: EffectAcceptedOut},
        headers=("Fencing-Token", "Worker-Id", "Prefer"),
        problems=(400, 401, 403, 409, 413, 415, 422, 424, 502, 503, 504),
    ),
    Route(
        "GET",
        "/v1/jobs/{job}/effects/{step}",
        get_effect,
        "One effect's record",
        roles=("worker", "auditor"),
        responses={200: EffectRecordOut},
        problems=(400, 401, 403, 404, 503),
    ),
    Route(
        "POST",
        "/v1/jobs/{job}/effects/{step}/resolve",
        resolve_effect,
        "Operator resolution of a step whose outcome is unknown (audited)",
        roles=("auditor",),
        body=ResolveBody,
        responses={200: EffectRecordOut},
        problems=(400, 401, 403, 404, 409, 413, 415, 503),
    ),
    Route(
        "GET",
        "/v1/jobs/{job}",
        get_job,
        "Fence, lease, cancelled flag, effects, checkpoints, outputs and completion of a job",
        roles=("scheduler", "auditor"),
        responses={200: JobOut},
        problems=(400, 401, 403, 404, 503),
    ),
    Route(
        "POST",
        "/v1/jobs/{job}/cancel",
        cancel_job,
        "Cancel a job: every later call and registration is refused (not a completed job)",
        roles=("scheduler",),
        responses={200: CancelOut},
        problems=(400, 401, 403, 409, 415, 503),
    ),
    Route(
        "GET",
        "/v1/audit/rejections",
        audit_rejections,
        "Rejected calls, newest first",
        roles=("auditor",),
        responses={200: AuditPageOut},
        query=("job", "limit", "cursor"),
        problems=(400, 401, 403, 503),
    ),
    Route(
        "GET",
        "/v1/attention",
        get_attention,
        "Steps that need an operator's decision: outcome unknown, or dispatching past the deadline",
        roles=("auditor",),
        responses={200: AttentionPageOut},
        query=("limit", "cursor"),
        problems=(400, 401, 403, 503),
    ),
    Route("GET", "/healthz", healthz, "The process is up", responses={200: HealthOut}),
    Route(
        "GET",
        "/readyz",
        readyz,
        "Redis reachable, scripts loaded, durability marker present",
        responses={200: ReadyOut, 503: ReadyOut},
    ),
    Route(
        "GET",
        "/metrics",
        metrics,
        "Prometheus metrics (loopback peers only)",
        responses={200: None},
    ),
    Route("GET", "/openapi.json", openapi, "This OpenAPI 3.1 document", responses={200: None}),
)

# what workers call on every step: matched first
HOT_HANDLERS = frozenset({perform_effect, heartbeat})
