"""Views of a job's own state: checkpoints and the fenced completion (thin, like
:mod:`gateway.http.views`: parse → authorise → service/store → respond)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.core.errors import InvalidRequest, NotFound, PayloadTooLarge
from gateway.core.names import checked_name
from gateway.http import appkeys as K
from gateway.http.auth import job_as, job_keys
from gateway.http.codings import read_decoded
from gateway.http.generations import generation_of
from gateway.http.job_state_models import checkpoint_out, completion_out, summary
from gateway.http.models import (
    CheckpointBody,
    CheckpointListOut,
    CheckpointOut,
    CompleteBody,
    CompletionOut,
)
from gateway.http.parsing import (
    check_shape,
    parse_json,
    read_body,
    respond,
    worker_id_of,
)
from gateway.http.views import Route
from gateway.runtime.logging import bind
from gateway.store.jobstate import Checkpoint, canonical_json

__all__ = ["JOB_ROUTES"]


def _checkpoint_name(request: web.Request) -> str:
    name = checked_name(request.match_info["name"], "checkpoint name")
    bind(checkpoint=name)
    return name


async def _checkpoint_value(request: web.Request) -> Any:
    """The body: one JSON value of at most ``checkpoints.max_bytes``."""
    settings = request.app[K.SETTINGS]
    limit = min(settings.checkpoints.max_bytes, settings.server.max_body_bytes)
    too_large = PayloadTooLarge(f"a checkpoint may be at most {limit} bytes of JSON")
    raw = await read_decoded(request, limit, too_large)
    if not raw.strip():
        raise InvalidRequest("a checkpoint is a JSON value: the body is empty")
    value = parse_json(raw)
    server = settings.server
    check_shape(
        value,
        max_depth=server.max_json_depth,
        max_items=server.max_json_items,
        max_string=server.max_string_bytes,
    )
    return value


# -- views -------------------------------------------------------------------


async def put_checkpoint(request: web.Request) -> web.Response:
    keys, principal = job_as(request, "worker")
    name = _checkpoint_name(request)
    worker_id = worker_id_of(request)
    value = await _checkpoint_value(request)
    gen = await generation_of(request, keys, step=f"checkpoint:{name}", worker_id=worker_id)
    at = await request.app[K.COMPLETION].checkpoint(
        keys, name, canonical_json(value), generation=gen, worker_id=worker_id, by=principal.who
    )
    return respond(checkpoint_out(keys.job_id, Checkpoint(name, gen, value, worker_id, at)))


async def get_checkpoint(request: web.Request) -> web.Response:
    keys = job_keys(request, "worker", "scheduler", "auditor")
    name = _checkpoint_name(request)
    found = await request.app[K.JOBSTATE].load_checkpoint(keys, name)
    if found is None:
        raise NotFound(f"job {keys.job_id!r} has no checkpoint {name!r}")
    return respond(checkpoint_out(keys.job_id, found))


async def list_checkpoints(request: web.Request) -> web.Response:
    keys = job_keys(request, "worker", "scheduler", "auditor")
    view = await request.app[K.JOBSTATE].view(keys)
    out = CheckpointListOut(
        job_id=keys.job_id, checkpoints={n: summary(c) for n, c in view.checkpoints.items()}
    )
    return respond(out)


async def complete_job(request: web.Request) -> web.Response:
    keys, principal = job_as(request, "worker")
    worker_id = worker_id_of(request)
    body: CompleteBody = await read_body(request, CompleteBody, empty_ok=True)
    gen = await generation_of(request, keys, step="job:complete", worker_id=worker_id)
    done = await request.app[K.COMPLETION].complete(
        keys,
        generation=gen,
        outputs=body.outputs,
        result=body.result,
        worker_id=worker_id,
        by=principal.who,
    )
    bind(outcome="replayed" if done.replayed else "completed")
    headers = {"Idempotent-Replayed": "true"} if done.replayed else None
    return respond(completion_out(keys.job_id, done), headers=headers)


_FENCED = (400, 401, 403, 409, 503)

JOB_ROUTES: tuple[Route, ...] = (
    Route(
        "PUT",
        "/v1/jobs/{job}/checkpoints/{name}",
        put_checkpoint,
        "Write a checkpoint under the fence (the body is its JSON value)",
        roles=("worker",),
        body=CheckpointBody,
        responses={200: CheckpointOut},
        headers=("Fencing-Token", "Worker-Id"),
        problems=(*_FENCED, 413, 415, 429),
    ),
    Route(
        "GET",
        "/v1/jobs/{job}/checkpoints/{name}",
        get_checkpoint,
        "A checkpoint's value and the generation that wrote it",
        roles=("worker", "scheduler", "auditor"),
        responses={200: CheckpointOut},
        problems=(400, 401, 403, 404, 503),
    ),
    Route(
        "GET",
        "/v1/jobs/{job}/checkpoints",
        list_checkpoints,
        "The job's checkpoints: names, the generation that wrote each, when",
        roles=("worker", "scheduler", "auditor"),
        responses={200: CheckpointListOut},
        problems=(400, 401, 403, 503),
    ),
    Route(
        "POST",
        "/v1/jobs/{job}/complete",
        complete_job,
        "Complete the job under the fence, promoting this generation's recorded outputs",
        roles=("worker",),
        body=CompleteBody,
        responses={200: CompletionOut},
        headers=("Fencing-Token", "Worker-Id"),
        problems=(*_FENCED, 413, 415, 422),
    ),
)
