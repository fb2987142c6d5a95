"""Reading a request: its step name, Worker-Id, strict JSON bodies with their shape limits;
and writing a model as the response. Who calls is :mod:`gateway.http.auth`'s; the presented
generation :mod:`gateway.http.generations`'."""

from __future__ import annotations

import re
from typing import Any

import orjson
from aiohttp import web
from pydantic import BaseModel, ValidationError

from adapters.base import describe
from gateway.core import fastjson
from gateway.core.errors import InvalidRequest, PayloadTooLarge
from gateway.core.names import checked_name
from gateway.core.records import EffectRecord
from gateway.fencing.tenancy import Tenancy
from gateway.http import appkeys as K
from gateway.http.codings import read_decoded
from gateway.http.models import (
    EffectRecordOut,
    iso_ms,
)
from gateway.runtime.logging import bind
from gateway.store.keys import JobKeys

# every pattern here is used with fullmatch: "$" would accept a trailing "\n"
_WORKER_ID = re.compile(r"[\x21-\x7e]{1,128}")
CURSOR_RE = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")
LIMIT_RE = re.compile(r"[0-9]{1,4}")
U64 = 2**64 - 1
JSON = "application/json"


# -- helpers -----------------------------------------------------------------


def respond(
    model: BaseModel, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=model.model_dump_json().encode(), status=status, content_type=JSON, headers=headers
    )


def respond_fields(
    model: type[BaseModel],
    fields: dict[str, Any],
    status: int = 200,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """``respond(model(**fields))``, byte for byte, without building the model (the hot
    routes' answers). ``fields`` are the model's, in its field order, each already of its
    type: orjson writes them as pydantic would (``tests/http/test_respond_fields.py``); what
    orjson cannot write (an integer beyond 64 bits, deeper nesting than it follows) the model
    writes."""
    try:
        body = orjson.dumps(fields)
    except orjson.JSONEncodeError:
        body = model(**fields).model_dump_json().encode()
    return web.Response(body=body, status=status, content_type=JSON, headers=headers)


def step_of(request: web.Request) -> str:
    step = checked_name(request.match_info["step"], "step")
    bind(step=step)
    return step


def worker_id_of(request: web.Request) -> str | None:
    wid = request.headers.get("Worker-Id")
    if wid is None:
        return None
    if not _WORKER_ID.fullmatch(wid):
        raise InvalidRequest("Worker-Id must be 1 to 128 printable ASCII characters")
    bind(worker_id=wid)
    return wid


def parse_json(raw: bytes) -> Any:
    """orjson (strict RFC 8259, several times faster) where it cannot change a number, else
    the stdlib (:func:`gateway.core.fastjson.loads_exact`).

    Integers of any size are carried exactly; other numbers are IEEE 754 doubles. What
    cannot be carried — ``1e999``, ``1e-400``, ``NaN``, ``Infinity``, lone surrogate
    escapes — is refused with 400 naming the field, never changed (it used to be: an
    integer beyond 64 bits became a float, ``1e999`` a 500).
    """
    try:
        return fastjson.loads_exact(raw)
    except fastjson.Unrepresentable as exc:
        raise InvalidRequest(str(exc)) from exc
    except RecursionError as exc:
        raise InvalidRequest("the body nests too deeply") from exc
    except ValueError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from exc


def check_shape(data: Any, *, max_depth: int, max_items: int, max_string: int) -> None:
    """Refuse JSON deeper, larger or with longer strings than configured (iteratively)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    items = 0
    while stack:
        node, depth = stack.pop()
        items += 1
        if items > max_items:
            raise InvalidRequest(f"the body has more than {max_items} JSON values")
        if isinstance(node, str):
            if len(node) > max_string:  # characters <= bytes; a cheap first bound
                raise InvalidRequest(f"a string is longer than {max_string} characters")
            continue
        if isinstance(node, dict | list):
            if depth > max_depth:
                raise InvalidRequest(f"the body nests deeper than {max_depth} levels")
            children = node.items() if isinstance(node, dict) else enumerate(node)
            for key, value in children:
                if isinstance(key, str) and len(key) > max_string:
                    raise InvalidRequest(f"a key is longer than {max_string} characters")
                stack.append((value, depth + 1))


def shape_fits_by_size(raw: bytes, max_depth: int, max_items: int, max_string: int) -> bool:
    """True: no JSON document of this text can fail :func:`check_shape` with these limits, so
    its walk is skipped. Every value begins at a byte of its own (values <= bytes), a string's
    characters take a byte each at least (its length <= bytes), and a container nests in as
    many as there are ``[`` and ``{`` bytes (those in strings only raise the count)."""
    return (
        len(raw) <= max_items
        and len(raw) <= max_string
        and raw.count(b"[") + raw.count(b"{") <= max_depth
    )


async def read_body(request: web.Request, model: type[BaseModel], *, empty_ok: bool = False) -> Any:
    limit = request.app[K.SETTINGS].server.max_body_bytes
    raw = await read_decoded(
        request, limit, PayloadTooLarge(f"the body may be at most {limit} bytes")
    )
    if not raw.strip():
        if empty_ok:
            return model()
        raise InvalidRequest("a JSON body is required")
    data = parse_json(raw)
    server = request.app[K.SETTINGS].server
    limits = server.max_json_depth, server.max_json_items, server.max_string_bytes
    if not shape_fits_by_size(raw, *limits):
        check_shape(data, max_depth=limits[0], max_items=limits[1], max_string=limits[2])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidRequest(describe(exc, root="body")) from exc


def record_out(tenancy: Tenancy, keys: JobKeys, step: str, r: EffectRecord) -> EffectRecordOut:
    """The API view of a record; its ``idempotency_key`` is the one the adapter sent."""
    return EffectRecordOut(
        job_id=keys.job_id,
        step=step,
        state=r.state,
        generation=r.generation,
        intent_sha256=r.intent_sha256,
        adapter=r.adapter,
        operation=r.operation,
        idempotency_key=tenancy.key(keys.tenant, keys.job_id, step, r.adapter),
        result=r.result,
        error=r.error,
        attempts=r.attempts,
        worker_id=r.worker_id,
        created_at=iso_ms(r.created_at_ms),
        updated_at=iso_ms(r.updated_at_ms),
        resolved_by=r.resolved_by,
    )


# -- views -------------------------------------------------------------------
