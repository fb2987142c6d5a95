"""``stripe``: payments through Stripe's REST API (or any Stripe-compatible server).

Operations ``create_payment_intent`` (POST /v1/payment_intents) and
``create_refund`` (POST /v1/refunds); the payload uses Stripe's own field
names and is form-encoded with bracketed nested keys (``metadata[order]=…``).
The idempotency key goes into the ``Idempotency-Key`` header — Stripe then
answers a repeated request with the original result, so the downstream
**deduplicates by key** — and into the object's metadata
(``metadata[fencegate_key]``, ``metadata[fencegate_generation]``), so
:meth:`StripeAdapter.lookup` can find it again: the Search API for payment
intents, the refund list of the payment intent for refunds.

Each operation takes only the fields it lists (``_OPERATIONS``) plus the ones the
config's ``allow_fields`` adds; anything else is refused before sending. With
several tenants (``tenant_keyed``) the metadata also carries ``fencegate_tenant``
and a refund is sent only for a PaymentIntent created under the caller's tenant.

=================================================  =======================
Stripe answered                                     outcome
=================================================  =======================
2xx                                                 Delivered (the object)
402 card_error, 400 invalid_request_error, 404      Failed
401/403 (bad key: fix config, then retry)           NotDelivered
409 (same key in flight), 429 (rate limited)        NotDelivered
5xx (502, 503, 504 included)                        Unknown (re-sent with the same key)
connection refused                                  NotDelivered
timeout / connection lost after sending             Unknown (re-sent with the same key)
=================================================  =======================

Only Stripe's own documented answers release a step: 401/403 (the key), 409
(Stripe's idempotency conflict: a request with this key is still in flight) and
429 (rate limited), none of which a proxy produces after forwarding. Any 5xx
may be a proxy's after forwarding, so it is ``Unknown``: Stripe deduplicates by
``Idempotency-Key``, so the next call looks the object up, then re-sends under
the same key.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import AnyHttpUrl, Field, field_validator

from adapters import http
from adapters.base import (
    AdapterConfig,
    AdapterContext,
    Capabilities,
    Delivered,
    EffectRequest,
    Failed,
    InvalidPayload,
    NotDelivered,
    Outcome,
    Unknown,
)

__all__ = ["StripeAdapter", "StripeConfig", "form_encode"]

_FIELD = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_OBJECT_ID = re.compile(r"[A-Za-z0-9_]{1,255}")
# operation -> (path, required fields, the fields a worker may send). Anything else —
# money routing (transfer_data, on_behalf_of, application_fee_amount, transfer_group),
# expand, raw card data, redirect URLs — is refused unless the adapter's allow_fields
# names it for that operation.
_OPERATIONS: dict[str, tuple[str, tuple[str, ...], frozenset[str]]] = {
    "create_payment_intent": (
        "/v1/payment_intents",
        ("amount", "currency"),
        frozenset(
            {
                "amount",
                "currency",
                "customer",
                "description",
                "metadata",
                "receipt_email",
                "statement_descriptor",
                "statement_descriptor_suffix",
                "payment_method",
                "payment_method_types",
                "confirm",
                "capture_method",
                "off_session",
                "setup_future_usage",
                "shipping",
            }
        ),
    ),
    "create_refund": (
        "/v1/refunds",
        ("payment_intent",),
        frozenset({"payment_intent", "amount", "reason", "metadata"}),
    ),
}
# Fields no config may allow: they would name the object to act on without the
# ownership check (a refund by charge id instead of by payment_intent).
_NEVER = {"create_refund": frozenset({"charge"})}
_KEEP = (
    "id",
    "object",
    "status",
    "amount",
    "currency",
    "customer",
    "payment_intent",
    "metadata",
    "created",
)


class StripeConfig(AdapterConfig):
    type: Literal["stripe"] = "stripe"
    base_url: AnyHttpUrl = AnyHttpUrl("https://api.stripe.com")
    api_key_env: str
    api_version: str = "2024-06-20"
    timeout_seconds: float = Field(default=10.0, gt=0, le=300)
    max_response_bytes: int = Field(default=262_144, ge=1024, le=16 * 1024 * 1024)
    # Extra payload fields a worker may send, per operation, beyond the built-in list:
    # allow_fields = { create_payment_intent = ["on_behalf_of", "transfer_data"] }
    allow_fields: dict[str, tuple[str, ...]] = Field(default_factory=dict)

    @field_validator("allow_fields")
    @classmethod
    def _allow_fields(cls, v: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        for op, fields in v.items():
            if op not in _OPERATIONS:
                raise ValueError(f"{op!r} is not a stripe operation ({', '.join(_OPERATIONS)})")
            for f in fields:
                if not _FIELD.fullmatch(f):
                    raise ValueError(f"{f!r} is not a Stripe field name")
                if f in _NEVER.get(op, ()):
                    raise ValueError(f"{op}.{f} cannot be allowed: it bypasses the ownership check")
        return v


def form_encode(data: Mapping[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """Stripe's form encoding: ``a[b][0]=x``; booleans as ``true``/``false``; None omitted."""
    pairs: list[tuple[str, str]] = []
    for key, value in data.items():
        name = f"{prefix}[{key}]" if prefix else str(key)
        if value is None:
            continue
        if isinstance(value, Mapping):
            pairs += form_encode(value, name)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, Mapping):
                    pairs += form_encode(item, f"{name}[{i}]")
                else:
                    pairs.append((f"{name}[{i}]", _scalar(item)))
        else:
            pairs.append((name, _scalar(value)))
    return pairs


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class StripeAdapter:
    Config: ClassVar[type[StripeConfig]] = StripeConfig

    def __init__(self, name: str, config: StripeConfig, ctx: AdapterContext) -> None:
        self.name = name
        self._config = config
        self._http = ctx.http
        self._base = str(config.base_url).rstrip("/")
        self._key = ctx.secret(config.api_key_env, f"adapters.{name}.api_key_env")
        self.capabilities = Capabilities(dedupes_by_key=True, lookup=True)
        self._allowed = {
            op: allowed | frozenset(config.allow_fields.get(op, ()))
            for op, (_, _, allowed) in _OPERATIONS.items()
        }

    def validate(self, operation: str, payload: Mapping[str, Any]) -> None:
        if operation not in _OPERATIONS:
            raise InvalidPayload(f"stripe operations: {', '.join(_OPERATIONS)}")
        for name in _OPERATIONS[operation][1]:
            if name not in payload:
                raise InvalidPayload(f"{operation} needs {name!r}")
        for name in payload:
            if not _FIELD.fullmatch(name):
                raise InvalidPayload(f"{name!r} is not a Stripe field name")
        refused = sorted(set(payload) - self._allowed[operation])
        if refused:
            raise InvalidPayload(
                f"{operation} does not take {', '.join(map(repr, refused))} from a worker "
                f"(allowed: {', '.join(sorted(self._allowed[operation]))}; an operator can "
                f"add fields with adapters.{self.name}.allow_fields)"
            )
        if operation == "create_refund" and not (
            isinstance(payload["payment_intent"], str)
            and _OBJECT_ID.fullmatch(payload["payment_intent"])
        ):
            raise InvalidPayload("payment_intent must be a Stripe id like pi_123")
        if "amount" in payload and (
            isinstance(payload["amount"], bool) or not isinstance(payload["amount"], int)
        ):
            raise InvalidPayload("amount must be an integer in the currency's smallest unit")
        metadata = payload.get("metadata", {})
        if not isinstance(metadata, Mapping) or any(k.startswith("fencegate_") for k in metadata):
            raise InvalidPayload("metadata must be an object; fencegate_* keys are reserved")

    def _headers(self, request: EffectRequest | None = None) -> dict[str, str]:
        h = {"Authorization": f"Bearer {self._key}", "Stripe-Version": self._config.api_version}
        if request is not None:
            h["Idempotency-Key"] = request.idempotency_key
            h["Content-Type"] = "application/x-www-form-urlencoded"
        return h

    async def _call(
        self,
        method: str,
        path: str,
        request: EffectRequest,
        *,
        data: str | None = None,
        params: Mapping[str, str] | None = None,
    ) -> http.Response | NotDelivered | Unknown:
        return await http.request(
            self._http,
            method,
            self._base + path,
            budget=min(self._config.timeout_seconds, request.remaining()),
            max_bytes=self._config.max_response_bytes,
            headers=self._headers(request if method == "POST" else None),
            data=data,
            params=params,
        )

    async def dispatch(self, request: EffectRequest) -> Outcome:
        path = _OPERATIONS[request.operation][0]
        payload = dict(request.payload)
        marks = {
            "fencegate_key": request.idempotency_key,
            "fencegate_generation": str(request.generation),
        }
        if self._config.tenant_keyed:
            marks["fencegate_tenant"] = request.tenant
            if request.operation == "create_refund":
                refused = await self._check_owner(request, str(payload["payment_intent"]))
                if refused is not None:
                    return refused
        payload["metadata"] = {**dict(payload.get("metadata") or {}), **marks}
        resp = await self._call(
            "POST", path, request, data=urllib.parse.urlencode(form_encode(payload))
        )
        if not isinstance(resp, http.Response):
            return resp
        return _classify(resp)

    async def _check_owner(self, request: EffectRequest, intent: str) -> Outcome | None:
        """With several tenants on one Stripe account, an operation on an existing
        PaymentIntent is sent only if the intent was created through fencegate by the
        same tenant (``metadata[fencegate_tenant]``). None: go ahead. Nothing is sent
        otherwise: a refusal is ``Failed``, an unanswered check ``NotDelivered``."""
        resp = await self._call("GET", f"/v1/payment_intents/{intent}", request)
        if not isinstance(resp, http.Response):
            return NotDelivered(f"ownership check of {intent} got no answer; nothing was sent")
        if resp.status == 200 and isinstance(resp.body, dict):
            owner = (resp.body.get("metadata") or {}).get("fencegate_tenant")
            if owner == request.tenant:
                return None
            return Failed(
                {
                    "code": "foreign_object",
                    "message": f"payment_intent {intent} was not created by this tenant "
                    "through fencegate; nothing was sent",
                }
            )
        if resp.status in (404, 400):
            return _classify(resp)
        return NotDelivered(f"ownership check of {intent}: stripe answered {resp.status}")

    async def lookup(self, request: EffectRequest) -> Delivered | NotDelivered | None:
        """Find the object created under this key. Not finding it proves nothing
        (Stripe's search index lags), so a miss is ``None``: the gateway then
        re-sends under the same Idempotency-Key, which Stripe deduplicates."""
        key = request.idempotency_key
        if request.operation == "create_payment_intent":
            query = f"metadata['fencegate_key']:'{key}'"
            resp = await self._call(
                "GET", "/v1/payment_intents/search", request, params={"query": query}
            )
        else:
            intent = str(request.payload["payment_intent"])
            resp = await self._call(
                "GET", "/v1/refunds", request, params={"payment_intent": intent, "limit": "100"}
            )
        if (
            not isinstance(resp, http.Response)
            or resp.status != 200
            or not isinstance(resp.body, dict)
        ):
            return None
        for obj in resp.body.get("data", []):
            if isinstance(obj, dict) and (obj.get("metadata") or {}).get("fencegate_key") == key:
                return Delivered(_trim(obj))
        return None

    async def aclose(self) -> None:
        return None


def _trim(obj: Mapping[str, Any]) -> dict[str, Any]:
    return {k: obj[k] for k in _KEEP if k in obj}


def _classify(resp: http.Response) -> Outcome:
    body = resp.body if isinstance(resp.body, dict) else {}
    if 200 <= resp.status < 300:
        return Delivered(_trim(body))
    raw_error = body.get("error")
    error: dict[str, Any] = (
        raw_error if isinstance(raw_error, dict) else {"message": str(resp.body)[:500]}
    )
    info = {"status": resp.status, "error": error}
    if resp.status in (401, 403, 409, 429):
        return NotDelivered(f"stripe answered {resp.status}: {error.get('message', '')}")
    if resp.status >= 500:
        return Unknown(f"stripe answered {resp.status}")
    return Failed(info)
