"""The OpenAPI 3.1 document, generated from the route table and the pydantic models."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gateway import __version__
from gateway.http.jobviews import JOB_ROUTES
from gateway.http.models import NAME_PATTERN, Problem
from gateway.http.outputs import OUTPUT_ROUTES
from gateway.http.views import ROUTES

__all__ = ["build_openapi"]

_REF = "#/components/schemas/{model}"
_STATUS_TEXT = {
    200: "OK",
    201: "Created",
    202: "Accepted: recorded under the fence, the relay performs it",
    400: "Invalid request, bad token",
    401: "Missing or unknown key",
    403: "Wrong role; or refused as a browser request (Origin, Sec-Fetch-Site, Host)",
    307: "Redirect to a signed URL of the object store",
    404: "Not found",
    408: "The body did not arrive in time",
    409: "Refused by the fence (or the job completed), in progress or outcome unknown",
    413: "Body too large (or, for a checkpoint, a new name past checkpoints.max_per_job)",
    500: "Internal error",
    501: "Not supported by the configured object store",
    415: "A body or Content-Type that is not application/json",
    422: "Intent mismatch, unknown adapter, or an output not recorded by this generation",
    424: "Downstream permanently refused",
    429: "Over a tenant's quota or its cap of long-lived requests (Retry-After)",
    502: "Downstream unavailable, not delivered",
    503: "Store unavailable (or not ready)",
    504: "Timed out after sending: outcome unknown",
}
_HEADERS = {
    "Fencing-Token": ("The generation (unsigned mode) or a signed token", True),
    "Worker-Id": ("Recorded in the audit log and logs", False),
    "Idempotency-Key": (
        "A registration re-sent with the same key (within redis.request_memory_seconds) "
        "answers the first one's generation instead of allocating another",
        False,
    ),
    "Prefer": (
        "RFC 7240 preferences; the respond-async token (case-insensitive, any position in "
        "the list, any Prefer line): record the step and return 202; the relay performs it",
        False,
    ),
}
_QUERY = {
    "job": {"type": "string", "pattern": NAME_PATTERN},
    "limit": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100},
    "cursor": {"type": "string"},
    "generation": {"type": "integer", "minimum": 1, "maximum": 2**53 - 1},
}


def build_openapi() -> dict[str, Any]:
    models: set[type[BaseModel]] = {Problem}
    for route in (*ROUTES, *JOB_ROUTES, *OUTPUT_ROUTES):
        if route.body:
            models.add(route.body)
        models.update(m for m in route.responses.values() if m)
    _, defs = models_json_schema(
        [(m, "serialization") for m in sorted(models, key=lambda m: m.__name__)],
        ref_template=_REF,
    )
    paths: dict[str, dict[str, Any]] = {}
    for route in (*ROUTES, *JOB_ROUTES, *OUTPUT_ROUTES):
        op: dict[str, Any] = {"summary": route.summary, "operationId": route.handler.__name__}
        params: list[dict[str, Any]] = [
            {
                "name": n,
                "in": "path",
                "required": True,
                "schema": {"type": "string", "pattern": NAME_PATTERN},
            }
            for n in re.findall(r"{(\w+)}", route.path)
        ]
        params += [
            {
                "name": h,
                "in": "header",
                "required": _HEADERS[h][1],
                "description": _HEADERS[h][0],
                "schema": {"type": "string"},
            }
            for h in route.headers
        ]
        params += [
            {"name": q, "in": "query", "required": False, "schema": _QUERY[q]} for q in route.query
        ]
        if params:
            op["parameters"] = params
        if route.roles:
            op["security"] = [{"bearer": []}]
            op["description"] = "Roles: " + ", ".join(route.roles) + " (admin has every role)."
        if getattr(route.handler, "streams_body", False):  # an output's bytes, streamed
            op["requestBody"] = {
                "required": True,
                "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}},
            }
        if route.body:
            op["requestBody"] = {
                "required": route.body.__name__ not in ("RegisterBody", "CompleteBody"),
                "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model=route.body.__name__)}}
                },
            }
        responses: dict[str, Any] = {}
        for status, model in route.responses.items():
            content = (
                {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}
                if model
                else {"text/plain": {"schema": {"type": "string"}}}
            )
            responses[str(status)] = {
                "description": _STATUS_TEXT.get(status, "OK"),
                "content": content,
            }
        for status in route.problems:
            responses[str(status)] = {
                "description": _STATUS_TEXT[status],
                "content": {
                    "application/problem+json": {"schema": {"$ref": _REF.format(model="Problem")}}
                },
            }
        op["responses"] = responses
        paths.setdefault(route.path, {})[route.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "fencegate",
            "version": __version__,
            "description": "A fencing-token gateway for external side effects.",
        },
        "paths": paths,
        "components": {
            "schemas": defs["$defs"],
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
