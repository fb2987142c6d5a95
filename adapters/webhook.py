"""``webhook``: HTTP POST of the payload to one configured URL.

Downstream sees ``Idempotency-Key: <job>:<step>``, ``Fencing-Token: <generation>``,
``X-Fencegate-Operation``; redirects are never followed; the response is
size-limited before it is stored. Extra headers come from the config only:
``headers`` (in clear) and ``headers_env`` (header → name of the environment
variable holding its value, for secrets such as ``Authorization``); names must
be RFC 9110 tokens and values printable ASCII (no control characters).

==============================================  ===============
what happened                                   outcome
==============================================  ===============
2xx                                             Delivered
connection refused, connect timeout             NotDelivered
a status in ``not_delivered_statuses`` (429)    NotDelivered
other 4xx, 3xx (redirects are not followed)     Failed
500, 502, 503, 504, other 5xx                   Unknown
read timeout, connection lost after sending     Unknown
==============================================  ===============

A 502, 503 or 504 may come from a proxy (a load balancer, an ingress, an API
gateway) in front of the receiver *after it forwarded the request*: Envoy
answers 503 when the upstream resets after reading the request, nginx 502 and
504 when it closes or times out. The receiver may have processed it, so these
are ``Unknown``: a receiver that deduplicates by key (``dedupes_by_key``) gets
the step again under the same key, any other stays ``unknown`` for an operator.
Only a status listed in ``not_delivered_statuses`` releases the step (and a
retry sends the effect again); the default lists 429 alone, which rate limiters
answer *instead of* forwarding. A deployment whose receiver is reached without
a proxy, or whose proxy never answers 503 after forwarding, may add 503.
"""

from __future__ import annotations

import json
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
from adapters.headers import check_header
from gateway.core.names import NAME, NAME_RULE

__all__ = ["WebhookAdapter", "WebhookConfig"]


class WebhookConfig(AdapterConfig):
    type: Literal["webhook"] = "webhook"
    url: AnyHttpUrl
    timeout_seconds: float = Field(default=5.0, gt=0, le=300)
    # Set when the receiver honours Idempotency-Key: an unknown outcome may then be re-sent.
    dedupes_by_key: bool = False
    max_response_bytes: int = Field(default=65_536, ge=0, le=16 * 1024 * 1024)
    headers: dict[str, str] = Field(default_factory=dict)
    # header name -> environment variable holding its value (secrets stay out of the file)
    headers_env: dict[str, str] = Field(default_factory=dict)
    # Statuses that prove the receiver did NOT process the request: the step is released
    # and a retry sends it again. List only what nothing between the gateway and the
    # receiver can answer after forwarding the request (a proxy's 502/503/504 can).
    not_delivered_statuses: frozenset[int] = frozenset({429})

    @field_validator("not_delivered_statuses")
    @classmethod
    def _error_statuses(cls, value: frozenset[int]) -> frozenset[int]:
        wrong = sorted(s for s in value if not 400 <= s <= 599)
        if wrong:
            raise ValueError(f"only 4xx and 5xx statuses can mean 'not delivered', not {wrong}")
        return value

    @field_validator("headers")
    @classmethod
    def _headers(cls, value: dict[str, str]) -> dict[str, str]:
        for name, val in value.items():
            check_header(name, val, "headers")
        return value

    @field_validator("headers_env")
    @classmethod
    def _headers_env(cls, value: dict[str, str]) -> dict[str, str]:
        for name, env in value.items():
            check_header(name, "", "headers_env")
            if not env:
                raise ValueError(f"headers_env: {name} names no environment variable")
        return value


class WebhookAdapter:
    Config: ClassVar[type[WebhookConfig]] = WebhookConfig

    def __init__(self, name: str, config: WebhookConfig, ctx: AdapterContext) -> None:
        self.name = name
        self._config = config
        self._url = str(config.url)
        self._http = ctx.http
        self.capabilities = Capabilities(dedupes_by_key=config.dedupes_by_key, lookup=False)
        self._headers = dict(config.headers)
        for header, env in config.headers_env.items():
            value = ctx.secret(env, f"adapters.{name}.headers_env.{header}")
            check_header(header, value, f"headers_env.{header} (from {env})")
            self._headers[header] = value

    def validate(self, operation: str, payload: Mapping[str, Any]) -> None:
        if not NAME.fullmatch(operation):
            raise InvalidPayload(f"operation {NAME_RULE}")

    async def dispatch(self, request: EffectRequest) -> Outcome:
        headers = {
            **self._headers,
            "Content-Type": "application/json",
            "Idempotency-Key": request.idempotency_key,
            "Fencing-Token": str(request.generation),
            "X-Fencegate-Operation": request.operation,
        }
        resp = await http.request(
            self._http,
            "POST",
            self._url,
            budget=min(self._config.timeout_seconds, request.remaining()),
            max_bytes=self._config.max_response_bytes,
            headers=headers,
            data=json.dumps(request.payload, separators=(",", ":")),
        )
        if not isinstance(resp, http.Response):
            return resp
        if 200 <= resp.status < 300:
            return Delivered(resp.summary())
        if resp.status in self._config.not_delivered_statuses:
            return NotDelivered(f"receiver answered {resp.status} (not_delivered_statuses)")
        if resp.status >= 500:
            return Unknown(
                f"receiver answered {resp.status}, which a proxy may answer after forwarding"
            )
        return Failed(resp.summary())

    async def lookup(self, request: EffectRequest) -> Delivered | NotDelivered | None:
        return None

    async def aclose(self) -> None:
        return None
