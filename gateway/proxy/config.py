"""``[upstreams.<name>]``: where a proxied request may go, for whom, with which credential.

Every section is validated before the gateway starts (:func:`load_upstreams`); a
mistake stops the start with the key that is wrong. What is checked:

- ``base_url`` is ``http`` or ``https``, with a host, no user info, query or fragment; a
  literal address that is private, loopback, link-local (the metadata service) or otherwise
  not global is refused unless ``allow_private`` — so is a numeric host in any form but the
  dotted one (``2130706433``, ``0x7f.1``: what a resolver would read as 127.0.0.1);
- ``routes`` is the allow-list, default deny: ``"METHOD /path"``, where a ``*`` segment
  matches exactly one path segment. POST, PUT, PATCH and DELETE routes are fenced, pinned,
  recorded steps; GET and HEAD routes are reads (authenticated, with the tenant's
  credential, never recorded), passed through or fence-checked as ``reads`` says;
- ``tenants`` (``"*"`` or names) must be tenants of the deployment;
- the credential: ``credential_env`` (one environment variable, for an upstream one tenant
  uses) or ``credentials_env`` (tenant → variable, every listed tenant named); each variable
  must be set. The values are held in memory and never logged.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from adapters.base import describe
from adapters.headers import check_header
from gateway.core.names import NAME, NAME_RULE, tenant_list
from gateway.proxy.routing import RoutePattern, address_refused, parse_route
from gateway.proxy.steps import check_step_from
from gateway.runtime.settings import ConfigError

__all__ = ["Upstream", "UpstreamConfig", "load_upstreams"]

SecretReader = Callable[[str, str], str]

_DOTTED = re.compile(r"[0-9]{1,3}(\.[0-9]{1,3}){3}")
_NUMERIC_HOST = re.compile(r"(0x[0-9a-f]+|[0-9]+)(\.(0x[0-9a-f]+|[0-9]+))*", re.IGNORECASE)

# Request headers always forwarded when the client sends them (besides Content-Type).
DEFAULT_FORWARD = ("Accept", "Accept-Language", "User-Agent")
# Response headers recorded and replayed (besides Content-Type).
DEFAULT_RESPONSE = ("Request-Id", "Location", "Retry-After")
# Never forwarded, whatever the config says: they are fencegate's, the connection's, or
# would let the client pick a host, a credential or a key.
NEVER_FORWARD = frozenset(
    h.lower()
    for h in (
        "Authorization",
        "Proxy-Authorization",
        "Cookie",
        "Host",
        "Forwarded",
        "Via",
        "X-Forwarded-For",
        "X-Forwarded-Host",
        "X-Forwarded-Proto",
        "X-Real-Ip",
        "Connection",
        "Keep-Alive",
        "Transfer-Encoding",
        "TE",
        "Trailer",
        "Upgrade",
        "Content-Length",
        "Content-Encoding",
        "Expect",
        "Idempotency-Key",
        "Fencing-Token",
        "Fencegate-Job",
        "Fencegate-Step",
        "Worker-Id",
    )
)


class UpstreamConfig(BaseModel):
    """One ``[upstreams.<name>]`` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str
    tenants: tuple[str, ...] = ("*",)
    routes: tuple[str, ...]
    credential_env: str = ""
    credentials_env: dict[str, str] = Field(default_factory=dict)
    inject_header: str = "Authorization"
    dedupes_by_key: bool = False
    idempotency_header: str = "Idempotency-Key"
    allow_private: bool = False
    error_dialect: Literal["problem", "stripe", "openai"] = "problem"
    timeout_seconds: float = Field(default=10.0, gt=0, le=300)
    max_response_bytes: int = Field(default=262_144, ge=0, le=16 * 1024 * 1024)
    in_flight_wait_seconds: float = Field(default=1.0, ge=0, le=30)
    forward_headers: tuple[str, ...] = ()
    response_headers: tuple[str, ...] = ()
    reads: Literal["pass", "fenced"] = "pass"
    """GET and HEAD routes: ``"pass"`` (authenticated, not fenced: a read needs no job) or
    ``"fenced"`` (a read needs ``Fencegate-Job`` and ``Fencing-Token`` and is refused, never
    sent, for a generation that may not act: stale, expired, cancelled, completed)."""
    step_from: str = ""
    """Where the step of a request without ``Fencegate-Step`` comes from: ``""`` (nowhere:
    400), ``"idempotency_key"`` (the client's own key, for callers that choose deterministic
    keys) or ``"json:/pointer"`` (a string of the JSON body); a step name either way."""

    tenant_header_values: dict[str, dict[str, tuple[str, ...]]] = Field(default_factory=dict)
    """Tenant → forwarded header → the values that tenant may send (``{ acme =
    { "Stripe-Account" = ["acct_1"] } }``): a header named for any tenant is forwarded only
    with a value allowed for the caller's tenant, else 403 and nothing is sent; its value is
    part of the intent."""
    intent_headers: tuple[str, ...] = ()
    """Forwarded request headers whose values are part of the step's intent (names, any
    case): the same step sent again with another value is ``intent_mismatch``."""

    released_statuses: tuple[int, ...] = ()
    """4xx statuses the upstream documents as "not performed" (a rate limit, a lock
    timeout: ``[409, 429]``): the step is released, sent again by a later call, instead of
    failed; this call gets the upstream's answer."""

    @field_validator("released_statuses")
    @classmethod
    def _released_statuses(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        for status in v:
            if not 400 <= status <= 499:
                raise ValueError(
                    f"{status} is not a 4xx: a 2xx succeeded, a 3xx is an answer, a 5xx is "
                    "unknown (it may come after the request was performed)"
                )
        return v

    @field_validator("step_from")
    @classmethod
    def _step_from(cls, v: str) -> str:
        return check_step_from(v)

    @field_validator("tenants", mode="before")
    @classmethod
    def _tenants(cls, v: Any) -> Any:
        return tenant_list(v)

    @field_validator("routes")
    @classmethod
    def _routes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("list at least one route (default deny), e.g. 'POST /v1/refunds'")
        for route in v:
            parse_route(route)  # raises ValueError naming the route
        return v

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        if parts.username or parts.password or parts.query or parts.fragment:
            raise ValueError("must have no user info, query or fragment")
        if "\\" in v or any(ord(c) < 0x21 or ord(c) > 0x7E for c in v):
            raise ValueError("must be printable ASCII without backslashes")
        return v.rstrip("/")

    @field_validator("inject_header", "idempotency_header")
    @classmethod
    def _header_name(cls, v: str) -> str:
        check_header(v, "", "header")
        return v

    @field_validator("tenant_header_values")
    @classmethod
    def _tenant_header_values(
        cls, v: dict[str, dict[str, tuple[str, ...]]]
    ) -> dict[str, dict[str, tuple[str, ...]]]:
        for tenant, headers in v.items():
            for name, values in headers.items():
                if not values:
                    raise ValueError(
                        f"{tenant}.{name}: list at least one value (leave the header out of "
                        "the tenant's table to refuse every value)"
                    )
                for value in values:
                    check_header(name, value, f"{tenant}.{name}")
        return v

    @field_validator("forward_headers", "response_headers", "intent_headers")
    @classmethod
    def _header_names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            check_header(name, "", "header")
            if name.lower() in NEVER_FORWARD:
                raise ValueError(f"{name} is never forwarded (fencegate sets or strips it)")
        return v


@dataclass(frozen=True)
class Upstream:
    """A validated upstream, with its credentials read (never logged: ``repr`` hides them)."""

    name: str
    config: UpstreamConfig
    routes: tuple[RoutePattern, ...]
    tenants: frozenset[str] | None  # None: every tenant of the deployment
    _credentials: Mapping[str, str]  # tenant ("*": every tenant) -> the injected value
    # tenant -> lower-case header -> its allowed values (tenant_header_values)
    header_values: Mapping[str, Mapping[str, frozenset[str]]] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"Upstream({self.name!r}, {self.config.base_url!r})"

    @property
    def adapter_name(self) -> str:
        """The adapter name of its steps' records: ``proxy:<name>``."""
        return f"proxy:{self.name}"

    def serves(self, tenant: str) -> bool:
        return self.tenants is None or tenant in self.tenants

    def credential(self, tenant: str) -> tuple[str, str] | None:
        """``(header, value)`` injected for ``tenant``'s requests, or None (no credential)."""
        value = self._credentials.get(tenant) or self._credentials.get("*")
        if value is None:
            return None
        header = self.config.inject_header
        return header, (f"Bearer {value}" if header.lower() == "authorization" else value)

    @cached_property
    def forwarded(self) -> frozenset[str]:
        """Request headers forwarded from the client (lower-case)."""
        names = (*DEFAULT_FORWARD, *self.config.forward_headers, "Content-Type")
        return frozenset(n.lower() for n in names)

    @cached_property
    def guarded(self) -> frozenset[str]:
        """Forwarded headers whose values are allowed per tenant (lower-case)."""
        return frozenset(h for headers in self.header_values.values() for h in headers)

    @cached_property
    def in_intent(self) -> frozenset[str]:
        """Request headers whose values are part of the intent (lower-case)."""
        return frozenset(h.lower() for h in self.config.intent_headers) | self.guarded

    def value_allowed(self, tenant: str, header: str, value: str) -> bool:
        """Whether ``tenant`` may send ``value`` in ``header`` (lower-case), a guarded one."""
        return value in self.header_values.get(tenant, {}).get(header, frozenset())

    @cached_property
    def recorded(self) -> frozenset[str]:
        """Response headers recorded and replayed (lower-case)."""
        names = (*DEFAULT_RESPONSE, *self.config.response_headers, "Content-Type")
        return frozenset(n.lower() for n in names)


def _check_host(name: str, config: UpstreamConfig) -> None:
    host = urlsplit(config.base_url).hostname or ""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if _NUMERIC_HOST.fullmatch(host) and not _DOTTED.fullmatch(host):
            raise ConfigError(
                f"upstreams.{name}.base_url: the numeric host {host!r} is ambiguous; "
                "write an address in dotted form or a name"
            ) from None
        return  # a name: its addresses are checked as it is resolved, per connection
    if not config.allow_private and address_refused(ip):
        raise ConfigError(
            f"upstreams.{name}.base_url: {host} is not a public address (private, loopback, "
            "link-local or reserved); set allow_private = true if that is intended"
        )


def _header_values(name: str, config: UpstreamConfig) -> dict[str, dict[str, frozenset[str]]]:
    out: dict[str, dict[str, frozenset[str]]] = {}
    for tenant, headers in config.tenant_header_values.items():
        table: dict[str, frozenset[str]] = {}
        for header, values in headers.items():
            if header.lower() in table:
                raise ConfigError(
                    f"upstreams.{name}.tenant_header_values.{tenant} names {header} twice"
                )
            table[header.lower()] = frozenset(values)
        out[tenant] = table
    return out


def load_upstreams(
    sections: Mapping[str, Mapping[str, Any]],
    tenants: Collection[str],
    secret: SecretReader,
) -> dict[str, Upstream]:
    """Every ``[upstreams.<name>]`` validated and its credentials read, else
    :class:`ConfigError` naming the key."""
    out: dict[str, Upstream] = {}
    known = frozenset(tenants)
    for name, section in sections.items():
        if not NAME.fullmatch(name):
            raise ConfigError(f"upstream name {name!r} {NAME_RULE}")
        try:
            config = UpstreamConfig(**section)
        except ValidationError as exc:
            raise ConfigError(describe(exc, prefix=f"upstreams.{name}.")) from exc
        _check_host(name, config)
        listed = None if config.tenants == ("*",) else frozenset(config.tenants)
        for t in sorted((listed or frozenset()) - known):
            raise ConfigError(
                f"upstreams.{name}.tenants names {t!r}, which no [[auth.keys]] entry carries"
            )
        serving = listed if listed is not None else known
        credentials: dict[str, str] = {}
        if config.credential_env and config.credentials_env:
            raise ConfigError(f"upstreams.{name}: set credential_env or credentials_env, not both")
        if config.credential_env:
            if len(serving) > 1:
                raise ConfigError(
                    f"upstreams.{name}.credential_env: {len(serving)} tenants may use this "
                    "upstream and would share one provider credential; use credentials_env "
                    "(tenant -> environment variable)"
                )
            credentials["*"] = secret(config.credential_env, f"upstreams.{name}.credential_env")
        elif config.credentials_env:
            for t in sorted(set(config.credentials_env) - serving):
                raise ConfigError(
                    f"upstreams.{name}.credentials_env names {t!r}, which may not use it"
                )
            for t in sorted(serving - set(config.credentials_env)):
                raise ConfigError(f"upstreams.{name}.credentials_env has no entry for {t!r}")
            for t, env in config.credentials_env.items():
                credentials[t] = secret(env, f"upstreams.{name}.credentials_env.{t}")
        for who, value in credentials.items():
            try:
                check_header(config.inject_header, value, f"upstreams.{name} credential ({who})")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        routes = tuple(parse_route(r) for r in config.routes)
        up = Upstream(name, config, routes, listed, credentials, _header_values(name, config))
        for t in sorted(set(up.header_values) - serving):
            raise ConfigError(
                f"upstreams.{name}.tenant_header_values names {t!r}, which may not use it"
            )
        for h in sorted(up.in_intent - up.forwarded):
            raise ConfigError(
                f"upstreams.{name}: {h} is in intent_headers or tenant_header_values but "
                "not forwarded; list it in forward_headers"
            )
        out[name] = up
    return out
