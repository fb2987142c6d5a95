"""The views of attempt-scoped outputs: upload, pre-signed upload URL, read.

``PUT /v1/jobs/{job}/outputs/{name}`` is the one route whose body is not JSON: it is
marked ``streams_body`` so the browser guard accepts any declared media type (a browser
cannot send a cross-site PUT without a CORS preflight, which this gateway never
answers) and the body-deadline middleware does not read it into memory first; the view
streams it to the object store chunk by chunk (:mod:`gateway.fencing.outputs`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Literal

import structlog
from aiohttp import web
from pydantic import BaseModel, Field

from gateway.core.errors import (
    FencegateError,
    Forbidden,
    InvalidRequest,
    QuotaExceeded,
    RequestTimeout,
    UnsupportedMediaType,
)
from gateway.fencing.outputs import OutputService
from gateway.http import appkeys as K
from gateway.http.auth import job_as
from gateway.http.codings import codings_of
from gateway.http.generations import generation_of
from gateway.http.job_state_models import output_out
from gateway.http.models import OutputOut, iso_ms
from gateway.http.parsing import read_body, respond, worker_id_of
from gateway.http.views import Route
from gateway.objects import ObjectStoreError, valid_output_name
from gateway.runtime.logging import bind

__all__ = [
    "OUTPUTS",
    "OUTPUT_ROUTES",
    "REDIRECT_SAFE",
    "UploadUrlBody",
    "UploadUrlOut",
    "redirect_safe",
]

OUTPUTS = web.AppKey("outputs", OutputService)
log = structlog.get_logger("fencegate.outputs")

# a media type: type "/" subtype, then optional parameters; printable ASCII, bounded
_TOKEN = r"[A-Za-z0-9!#$&^_.+-]{1,64}"
_MEDIA_TYPE = re.compile(rf"{_TOKEN}/{_TOKEN}(;[\x20-\x7e]{{0,190}})?")
_GENERATION = re.compile(r"[1-9][0-9]{0,15}")
READ_URL_SECONDS = 300  # a redirect's signed GET URL is valid this long
# What `redirect_reads` may send to the object store's own origin. A signed GET URL cannot
# carry response-content-disposition/-type overrides (obstore signs no query parameters),
# so the store serves the object inline with its stored Content-Type and none of the
# gateway's safe headers: only types a browser never runs as a page (no HTML, SVG, XML,
# PDF, text) are redirected; every other output is streamed through the gateway as an
# attachment with nosniff and a sandboxing CSP.
REDIRECT_SAFE = frozenset(
    {
        "application/octet-stream",
        "application/zip",
        "application/gzip",
        "application/x-tar",
        "application/x-7z-compressed",
        "application/zstd",
        "application/vnd.apache.parquet",
        "image/png",
        "image/jpeg",
        "image/gif",
        "image/webp",
        "image/avif",
        "audio/mpeg",
        "audio/ogg",
        "video/mp4",
        "video/webm",
    }
)


def redirect_safe(content_type: str) -> bool:
    """Whether a recorded output of this media type may be read through a redirect."""
    return content_type.split(";", 1)[0].strip().lower() in REDIRECT_SAFE


class UploadUrlBody(BaseModel):
    content_type: str = Field(default="application/octet-stream", max_length=255)


class UploadUrlOut(BaseModel):
    job_id: str
    name: str
    generation: int
    key: str
    method: Literal["PUT"] = "PUT"
    url: str
    expires_at: str | None
    max_bytes: int = Field(
        description="outputs.max_bytes: a larger object is deleted at completion (413); "
        "reserved in the tenant's quotas.output_bytes until the upload is recorded"
    )


def _output_name(request: web.Request) -> str:
    name = request.match_info["name"]
    if not valid_output_name(name):
        raise InvalidRequest(
            "an output name is one path segment of 1 to 128 characters: a letter or digit, "
            "then letters, digits, '.', '_' or '-' (no '..', '/', '\\\\', NUL)"
        )
    bind(output=name)
    return name


def _media_type(value: str | None) -> str:
    if value is None or not value.strip():
        return "application/octet-stream"
    if not _MEDIA_TYPE.fullmatch(value.strip()):
        raise InvalidRequest("Content-Type is not a media type (type/subtype[; parameters])")
    return value.strip()


def _body_chunks(
    request: web.Request, idle: float, rate: int = 0, window: float = 10.0
) -> AsyncIterator[bytes]:
    """The request body as it arrives; each byte must come within ``idle`` seconds of the
    last, and with ``rate`` every ``window`` seconds spent waiting for the client must bring
    at least ``rate * window`` bytes (a trickle inside the idle limit would hold a connection
    and the output's claim for the whole upload timeout). Only time spent waiting for the
    client counts: a slow object store, which stops this reader, never cuts an upload."""
    loop = asyncio.get_running_loop()

    async def chunks() -> AsyncIterator[bytes]:
        spent = quiet = 0.0  # waiting, in this window / since the last byte
        got = 0
        while True:
            if rate and spent >= window:
                if got < rate * spent:
                    raise RequestTimeout(
                        f"the body arrived at {got / spent:.0f} bytes/s over {spent:.0f} s, "
                        f"below outputs.min_upload_bytes_per_second ({rate})"
                    )
                spent, got = 0.0, 0
            wait = idle - quiet if not rate else min(idle - quiet, window - spent)
            began = loop.time()
            try:
                async with asyncio.timeout(max(wait, 0.0)):
                    chunk = await request.content.readany()
            except TimeoutError:
                waited = loop.time() - began
                spent, quiet = spent + waited, quiet + waited
                if quiet >= idle:
                    raise RequestTimeout(f"no byte of the body arrived for {idle:g} s") from None
                continue  # the window ended: its rate is checked above
            except Exception as exc:  # aiohttp's payload errors, a reset: the client went away
                raise InvalidRequest(f"the body broke off: {type(exc).__name__}") from None
            spent, quiet = spent + loop.time() - began, 0.0
            if not chunk:
                return
            got += len(chunk)
            yield chunk

    return chunks()


async def put_output(request: web.Request) -> web.Response:
    keys, principal = job_as(request, "worker")
    name = _output_name(request)
    if codings_of(request.headers.getall("Content-Encoding", ())):
        # an output is stored as its bytes came: a compressed file is uploaded as what it
        # is (Content-Type: application/gzip), never inflated on its way to the store
        raise UnsupportedMediaType(
            "an output's body is stored as sent: upload it without a Content-Encoding "
            "(a compressed file as its own media type, e.g. application/gzip)"
        )
    worker_id = worker_id_of(request)
    content_type = _media_type(request.headers.get("Content-Type"))
    gen = await generation_of(request, keys, step=f"output:{name}", worker_id=worker_id)
    service = request.app[OUTPUTS]
    settings = request.app[K.SETTINGS]
    body = _body_chunks(
        request,
        settings.connections.body_timeout_seconds,
        settings.outputs.min_upload_bytes_per_second,
        settings.outputs.min_upload_window_seconds,
    )
    try:
        entry = await service.put(
            keys,
            gen,
            name,
            body,
            content_type=content_type,
            content_length=request.content_length,
            worker_id=worker_id or "",
            by=principal.who,
            quotas=request.app[K.QUOTAS],
        )
    except FencegateError as exc:
        # the rest of an unread body is aiohttp's to discard after the answer (bounded by
        # its lingering time, then the connection closes): the client reads the problem
        request.app[K.METRICS].outputs.labels(exc.code).inc()
        raise
    request.app[K.METRICS].outputs.labels("recorded").inc()
    return respond(output_out(keys.job_id, entry), 201)


put_output.streams_body = True  # type: ignore[attr-defined]


async def upload_url(request: web.Request) -> web.Response:
    keys, principal = job_as(request, "worker")
    name = _output_name(request)
    worker_id = worker_id_of(request)
    body: UploadUrlBody = await read_body(request, UploadUrlBody, empty_ok=True)
    content_type = _media_type(body.content_type)
    gen = await generation_of(request, keys, step=f"output:{name}", worker_id=worker_id)
    try:
        url, key, deadline = await request.app[OUTPUTS].upload_url(
            keys,
            gen,
            name,
            content_type=content_type,
            worker_id=worker_id or "",
            by=principal.who,
            quotas=request.app[K.QUOTAS],
        )
    except QuotaExceeded:
        request.app[K.METRICS].outputs.labels("quota_exceeded").inc()
        raise
    out = UploadUrlOut(
        job_id=keys.job_id,
        name=name,
        generation=gen,
        key=key,
        url=url,
        expires_at=iso_ms(deadline),
        max_bytes=request.app[OUTPUTS].settings.max_bytes,
    )
    return respond(out, 201)


async def get_output(request: web.Request) -> web.StreamResponse:
    keys, principal = job_as(request, "worker", "scheduler", "auditor")
    name = _output_name(request)
    service = request.app[OUTPUTS]
    raw_gen = request.query.get("generation")
    if raw_gen is not None:
        if principal.role not in ("auditor", "admin"):
            raise Forbidden("reading a staged output of a given generation needs role auditor")
        if not _GENERATION.fullmatch(raw_gen) or int(raw_gen) > 2**53 - 1:
            raise InvalidRequest("generation must be an integer from 1 to 2^53 - 1")
        entry, chunks = await service.open_staged(keys, int(raw_gen), name)
    else:
        if service.settings.redirect_reads and service.objects.can_sign:
            entry = await service.promoted_current(keys, name)
            if redirect_safe(entry.content_type):
                url = await service.read_url(entry, READ_URL_SECONDS)
                return web.Response(status=307, headers={"Location": url})
            # anything a browser could render as a page is streamed here, as an attachment
        entry, chunks = await service.open_promoted(keys, name)
    response = web.StreamResponse(
        headers={
            "Content-Type": entry.content_type,
            "Fencegate-Generation": str(entry.generation),
            "Fencegate-Output-State": "promoted" if raw_gen is None else entry.state,
            # the bytes are a worker's: never rendered or sniffed as the gateway's own page
            "X-Content-Type-Options": "nosniff",
            "Content-Security-Policy": "sandbox; default-src 'none'",
            "Content-Disposition": f'attachment; filename="{entry.name}"',
        }
    )
    if entry.state == "recorded":
        response.content_length = entry.size
        response.headers["ETag"] = f'"{entry.sha256}"'
    await response.prepare(request)
    try:
        async for chunk in chunks:
            await response.write(chunk)
    except ObjectStoreError as exc:  # the head is sent: cut the body short (no problem doc)
        log.error("output_read_broke_off", key=entry.key, error=str(exc))
        response.force_close()
        return response
    await response.write_eof()
    return response


_UPLOAD_PROBLEMS = (400, 401, 403, 408, 409, 413, 415, 429, 503)

OUTPUT_ROUTES: tuple[Route, ...] = (
    Route(
        "PUT",
        "/v1/jobs/{job}/outputs/{name}",
        put_output,
        "Upload an output to its attempt-scoped key: fenced before the first byte and "
        "recorded (size, sha256) under the fence after the last",
        roles=("worker",),
        responses={201: OutputOut},
        headers=("Fencing-Token", "Worker-Id"),
        problems=_UPLOAD_PROBLEMS,
    ),
    Route(
        "POST",
        "/v1/jobs/{job}/outputs/{name}/upload-url",
        upload_url,
        "A pre-signed PUT URL for the attempt-scoped key, after the same fenced stage (S3)",
        roles=("worker",),
        body=UploadUrlBody,
        responses={201: UploadUrlOut},
        headers=("Fencing-Token", "Worker-Id"),
        problems=(400, 401, 403, 409, 413, 415, 429, 501, 503),
    ),
    Route(
        "GET",
        "/v1/jobs/{job}/outputs/{name}",
        get_output,
        "The promoted output of a completed job (404 before completion); auditors: "
        "?generation= reads any generation's staged object",
        roles=("worker", "scheduler", "auditor"),
        responses={200: None, 307: None},
        query=("generation",),
        problems=(400, 401, 403, 404, 500, 503),
    ),
)
