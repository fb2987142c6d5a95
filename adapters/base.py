"""The adapter protocol: one async ``dispatch``, an optional ``lookup``, ``aclose``.

An adapter receives an :class:`EffectRequest` (idempotency key ``<job>:<step>``,
the fencing generation, the operation and payload) and classifies the result as
exactly one :data:`Outcome`:

=================  ===========================================  =================
outcome            meaning                                      step becomes
=================  ===========================================  =================
``Delivered``      the downstream did it; ``result`` is kept    ``succeeded``
``Failed``         permanently refused; ``error`` is kept       ``failed``
``NotDelivered``   known not done (e.g. connection refused)     ``released``
``Unknown``        may or may not have happened                 ``unknown``
=================  ===========================================  =================

``NotDelivered`` is a promise that the downstream did not act: the step is
released and the next call sends it again. Return it only when that is proven —
nothing was sent (the connection never opened, the deadline passed first), or
the origin itself said so in a way nothing in between could fake after
forwarding (Stripe's documented 409 idempotency conflict and 429, a status the
deployment listed in a webhook's ``not_delivered_statuses``). Anything a proxy
in front of the downstream may answer *after* forwarding — 502, 503, 504 —
and a reset or timeout after sending is ``Unknown``: a downstream that
``dedupes_by_key`` gets it again under the same key, one with ``lookup`` is
asked, any other stays ``unknown`` for an operator.

Adapters never take a URL, host, port or header from the request: where they
send is fixed by configuration.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import aiohttp
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from gateway.core.names import tenant_list

__all__ = [
    "Adapter",
    "AdapterConfig",
    "AdapterContext",
    "Capabilities",
    "Delivered",
    "EffectRequest",
    "Failed",
    "InvalidPayload",
    "NotDelivered",
    "Outcome",
    "Unknown",
    "describe",
]


class InvalidPayload(ValueError):
    """The payload does not fit the operation; the gateway answers 400 and sends nothing."""


def describe(exc: ValidationError, prefix: str = "", root: str = "") -> str:
    """A pydantic error as one line: ``prefix.a.b: message; …`` (``root`` for an empty path)."""
    parts = []
    for e in exc.errors():
        path = ".".join(str(p) for p in e["loc"]) or root
        parts.append(f"{prefix}{path}: {e['msg']}")
    return "; ".join(parts)


class AdapterConfig(BaseModel):
    """Base of every adapter type's config section (``[adapters.<name>]``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str
    # The tenants whose workers may use this adapter: ["a", "b"], or "*" (every tenant).
    # Any other tenant is told the adapter does not exist (422 unknown_adapter).
    tenants: tuple[str, ...] = ("*",)
    # Downstream key "<tenant>/<job>:<step>" (true) or "<job>:<step>" (false). Unset, the
    # gateway decides: tenant-qualified whenever the deployment has more than one tenant.
    # In such a deployment false is refused at start (gateway.fencing.tenancy); the gateway hands
    # every adapter the resolved value.
    tenant_in_key: bool | None = None

    @field_validator("tenants", mode="before")
    @classmethod
    def _tenants(cls, v: Any) -> Any:
        return tenant_list(v)

    @property
    def tenant_keyed(self) -> bool:
        """Whether the downstream key (and label, Message-ID, metadata) carries the tenant."""
        return bool(self.tenant_in_key)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What the gateway may do when a step's outcome is ``unknown``.

    ``dedupes_by_key``: the downstream honours the idempotency key, so re-sending
    with the same key is safe. ``lookup``: :meth:`Adapter.lookup` can ask the
    downstream whether the effect with a key happened.
    """

    dedupes_by_key: bool = False
    lookup: bool = False

    @property
    def can_resolve(self) -> bool:
        return self.dedupes_by_key or self.lookup


@dataclass(frozen=True, slots=True)
class EffectRequest:
    tenant: str
    job_id: str
    step: str
    generation: int
    idempotency_key: str
    operation: str
    payload: Mapping[str, Any]
    deadline: float  # time.monotonic() after which nothing may be sent

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


@dataclass(frozen=True, slots=True)
class Delivered:
    result: Any = None


@dataclass(frozen=True, slots=True)
class Failed:
    error: Any = None


@dataclass(frozen=True, slots=True)
class NotDelivered:
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Unknown:
    reason: str = ""


Outcome = Delivered | Failed | NotDelivered | Unknown


@dataclass(frozen=True)
class AdapterContext:
    """What the gateway lends every adapter: one shared HTTP session, a secret reader."""

    http: aiohttp.ClientSession
    secret: Callable[[str, str], str]  # (env var name, what it is for) -> value
    extras: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class Adapter(Protocol):
    """What the gateway needs from an adapter."""

    name: str
    capabilities: Capabilities

    def validate(self, operation: str, payload: Mapping[str, Any]) -> None:
        """Raise :class:`InvalidPayload` if the call cannot be sent as is."""

    async def dispatch(self, request: EffectRequest) -> Outcome:
        """Perform the effect once; never raise for downstream behaviour, classify it."""

    async def lookup(self, request: EffectRequest) -> Delivered | NotDelivered | None:
        """Did the effect with this key happen? ``None``: the downstream cannot tell."""

    async def aclose(self) -> None:
        """Release what the adapter holds (the shared HTTP session is not its own)."""
