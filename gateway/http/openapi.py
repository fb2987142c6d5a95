"""The OpenAPI 3.1 document, generated from the route table and the pydantic models."""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gateway import __version__
from gateway.core.names import NAME_PATTERN
from gateway.http.job_state_views import JOB_ROUTES
from gateway.http.models import Problem
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
    405: "Method not allowed",
    409: "Refused by the fence (or the job completed), in progress or outcome unknown",
    413: "Body too large (or, for a checkpoint, a new name past checkpoints.max_per_job)",
    500: "Internal error",
    501: "Not supported by the configured object store",
    415: "A body or Content-Type that is not application/json, or a Content-Encoding "
    "other than gzip, deflate, identity",
    422: "Intent mismatch, unknown adapter, or an output not recorded by this generation",
    424: "Downstream permanently refused",
    429: "Over a tenant's quota or its cap of long-lived requests (Retry-After)",
    502: "Downstream unavailable, not delivered",
    503: "Store unavailable (or not ready); proxied: the tenant's spooled bodies at their cap",
    507: "The spool volume is full: nothing was sent",
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


_PROXY_HEADERS = {
    "Fencing-Token": "The generation (unsigned mode) or a signed token naming the job",
    "Fencegate-Job": "The job this request is a step of",
    "Fencegate-Step": "The step this request is (unsafe methods: required, unless the "
    "upstream's step_from names it)",
    "Worker-Id": "Recorded in the audit log and logs",
}
_PROXY_PROBLEMS = (400, 401, 403, 404, 405, 408, 409, 413, 415, 422, 429, 502, 503, 504, 507)


def _proxy_paths() -> dict[str, dict[str, Any]]:
    """``/proxy/{upstream}/{path}`` (docs/proxy.md): one fenced step per POST, PUT, PATCH or
    DELETE; GET and HEAD passed through. The upstreams' names are not listed (a tenant
    learns no other tenant's)."""
    ops: dict[str, Any] = {}
    for method in ("post", "put", "patch", "delete", "get", "head"):
        fenced = method not in ("get", "head")
        params: list[dict[str, Any]] = [
            {
                "name": "upstream",
                "in": "path",
                "required": True,
                "schema": {"type": "string", "pattern": NAME_PATTERN},
                "description": "An [upstreams.<name>] serving the key's tenant (else 404)",
            },
            {
                "name": "path",
                "in": "path",
                "required": True,
                "schema": {"type": "string"},
                "description": "The rest of the path under the upstream's base_url (one or more "
                "segments, the query kept); only its configured routes pass",
            },
        ]
        if fenced:
            params += [
                {
                    "name": h,
                    "in": "header",
                    "required": h != "Worker-Id",
                    "description": d,
                    "schema": {"type": "string"},
                }
                for h, d in _PROXY_HEADERS.items()
            ]
        op: dict[str, Any] = {
            "summary": (
                "A proxied request, fenced as one step: forwarded once, then replayed"
                if fenced
                else "A proxied read, passed through (never recorded; with the upstream's "
                'reads = "fenced", only for a generation that may act: Fencegate-Job and '
                "Fencing-Token)"
            ),
            "operationId": f"proxy_{method}",
            "parameters": params,
            "security": [{"bearer": []}],
            "description": "Roles: worker. The upstream's answer as it gave it (a replay: "
            "as recorded), with Fencegate-Outcome: forwarded | replayed; fencegate's own "
            "refusals in the upstream's error_dialect, with Fencegate-Outcome: refused and "
            "Stripe-Should-Retry / X-Should-Retry.",
            "responses": {
                "default": {
                    "description": "The upstream's status, allow-listed headers and body",
                    "headers": {
                        "Fencegate-Outcome": {"schema": {"enum": ["forwarded", "replayed"]}},
                        "Idempotent-Replayed": {"schema": {"const": "true"}},
                        "Fencegate-Generation": {"schema": {"type": "integer"}},
                    },
                    "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}},
                },
                **{
                    str(status): {
                        "description": _STATUS_TEXT[status],
                        "content": {
                            "application/problem+json": {
                                "schema": {"$ref": _REF.format(model="Problem")}
                            }
                        },
                    }
                    for status in _PROXY_PROBLEMS
                },
            },
        }
        if fenced:
            op["requestBody"] = {
                "required": False,
                "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}},
            }
        ops[method] = op
    return {"/proxy/{upstream}/{path}": ops}


@functools.cache
def openapi_document(*, proxy: bool = False) -> bytes:
    """The document as served: it depends on the routes and models only (and on whether an
    upstream is configured), so it is built once per process (its JSON schemas cost
    ~100 ms), not per application."""
    return json.dumps(build_openapi(proxy=proxy)).encode()


def build_openapi(*, proxy: bool = False) -> dict[str, Any]:
    """The document; ``proxy``: with ``/proxy/{upstream}/{path}`` (an ``[upstreams.*]`` is
    configured)."""
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
    if proxy:
        paths.update(_proxy_paths())
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
