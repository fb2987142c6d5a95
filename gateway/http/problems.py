"""The one place errors become ``application/problem+json`` responses."""

from __future__ import annotations

from aiohttp import web

from gateway.core import fastjson
from gateway.core.errors import (
    FencegateError,
    InternalError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
)
from gateway.core.errors import (
    InvalidRequest as _InvalidRequest,
)

__all__ = ["from_http_exception", "problem_response"]

PROBLEM_JSON = "application/problem+json"


def problem_response(exc: FencegateError) -> web.Response:
    headers: dict[str, str] = {}
    retry_after = exc.fields.get("retry_after")
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    if exc.fields.get("replayed"):
        headers["Idempotent-Replayed"] = "true"
    return web.Response(
        body=fastjson.dumps(exc.problem()),
        status=exc.http_status,
        content_type=PROBLEM_JSON,
        headers=headers,
    )


def from_http_exception(exc: web.HTTPException) -> FencegateError:
    """aiohttp's own errors (no route, wrong method, body too large) as our problems."""
    if exc.status == 404:
        return NotFound("no such resource")
    if exc.status == 405:
        return MethodNotAllowed(f"method not allowed; allowed: {exc.headers.get('Allow', '')}")
    if exc.status == 413:
        return PayloadTooLarge("the request body is too large")
    if 400 <= exc.status < 500:
        return _InvalidRequest(exc.reason or "bad request", status=exc.status)
    return InternalError(exc.reason or "error", status=exc.status)
