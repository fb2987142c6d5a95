"""fencegate's own answers to a proxied request, in the words its client understands.

A refusal (:func:`refusal`) is the gateway's problem document in the upstream's
``error_dialect``: ``problem`` (RFC 9457 ``application/problem+json``, the default),
``stripe`` (``{"error": {"type", "code", "message", …}}``) or ``openai``
(``{"error": {"message", "type", "param", "code"}}``, what OpenAI-style SDKs parse); in both
the fencegate problem is under ``error.fencegate``. Every refusal carries
``Fencegate-Outcome: refused`` and tells SDKs whether a retry can help, in both spellings
SDKs obey first (``Stripe-Should-Retry``, ``X-Should-Retry``):

- **terminal** (``false``): the answer will not change — a stale, unregistered, expired,
  cancelled or completed generation, an intent mismatch, a bad token or request, an unknown
  outcome the upstream cannot deduplicate, a response that cannot be replayed;
- **transient** (``true`` and ``Retry-After``): another request is dispatching the step,
  Redis or the upstream is unavailable (nothing was sent), a quota window, and an unknown
  outcome of an upstream that ``dedupes_by_key`` (the retry re-sends under the same key).

In the Stripe dialect an intent mismatch is ``400`` with type ``idempotency_error`` (what
Stripe answers for a key reused with other parameters; stripe-python raises
``IdempotencyError``); every other refusal keeps the gateway's status. In the OpenAI dialect
every refusal keeps the gateway's status (which the SDKs map to their error classes: 409
``ConflictError``, 422 ``UnprocessableEntityError`` …); its ``type`` is ``server_error`` for
a 5xx, ``rate_limit_error`` for a 429, else ``invalid_request_error``, its ``code`` the
gateway's problem code and its ``param`` null.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.core import fastjson
from gateway.core.errors import FencegateError, TryLater

__all__ = ["OUTCOME", "refusal", "transient"]

OUTCOME = "Fencegate-Outcome"
_STRIPE_TYPE = {
    "intent_mismatch": "idempotency_error",
    "store_unavailable": "api_error",
    "adapter_unavailable": "api_error",
    "outcome_unknown": "api_error",
    "replay_unavailable": "api_error",
    "internal_error": "api_error",
}


def transient(exc: FencegateError, *, dedupes_by_key: bool) -> bool:
    """Whether the same request, sent again, may get another answer."""
    if exc.code == "outcome_unknown":
        return dedupes_by_key
    return isinstance(exc, TryLater) or exc.code == "too_many_connections"


def refusal(exc: FencegateError, *, dialect: str, dedupes_by_key: bool) -> web.Response:
    """The refusal of a proxied request (the module docstring)."""
    problem = exc.problem()
    retry = transient(exc, dedupes_by_key=dedupes_by_key)
    headers = {
        OUTCOME: "refused",
        "Stripe-Should-Retry": "true" if retry else "false",
        "X-Should-Retry": "true" if retry else "false",
    }
    if retry:
        headers["Retry-After"] = str(exc.fields.get("retry_after") or 1)
    if exc.fields.get("replayed"):
        headers["Idempotent-Replayed"] = "true"
    status = exc.http_status
    if dialect == "stripe":
        kind = _STRIPE_TYPE.get(exc.code, "invalid_request_error")
        if exc.code == "intent_mismatch":
            status = 400
        body = {
            "error": {"type": kind, "code": exc.code, "message": exc.detail, "fencegate": problem}
        }
        return web.Response(
            body=fastjson.dumps(body),
            status=status,
            content_type="application/json",
            headers=headers,
        )
    if dialect == "openai":
        kind = (
            "server_error"
            if status >= 500
            else "rate_limit_error"
            if status == 429
            else "invalid_request_error"
        )
        error: dict[str, Any] = {
            "message": exc.detail,
            "type": kind,
            "param": None,
            "code": exc.code,
            "fencegate": problem,
        }
        return web.Response(
            body=fastjson.dumps({"error": error}),
            status=status,
            content_type="application/json",
            headers=headers,
        )
    return web.Response(
        body=fastjson.dumps(problem),
        status=status,
        content_type="application/problem+json",
        headers=headers,
    )
