"""What the store answers: effect records and the typed verdicts of its scripts (pure data)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gateway.core import fastjson

__all__ = [
    "DEFAULT_TYPE",
    "RECORD_FIELDS",
    "AdmitVerdict",
    "Admitted",
    "AuditCheck",
    "AuditEntry",
    "CompletionRecord",
    "EffectRecord",
    "EffectResult",
    "EffectState",
    "InProgress",
    "JobView",
    "OutputRecord",
    "OverQuota",
    "Queued",
    "Registration",
    "RelayClaim",
    "Replay",
    "Unresolved",
    "chain_hash",
    "downstream_key",
    "proxied_key",
]

EffectState = Literal["pending", "dispatching", "succeeded", "failed", "unknown", "released"]


# The effect hash's fields a record is read from: everything but the stored async payload
# (``payload``, up to quotas.payload_bytes) and the dispatch's bookkeeping. Views read these
# with HMGET, never HGETALL, so listing a job costs the size of its records, not its payloads.
RECORD_FIELDS = (
    "state",
    "generation",
    "intent_sha256",
    "adapter",
    "operation",
    "result",
    "error",
    "updated_at",
    "created_at",
    "attempts",
    "worker_id",
    "resolved_by",
)


@dataclass(frozen=True, slots=True)
class EffectRecord:
    """One step's effect as stored."""

    state: EffectState
    generation: int
    intent_sha256: str
    adapter: str
    operation: str
    result: Any
    error: Any
    updated_at_ms: int
    created_at_ms: int
    attempts: int
    worker_id: str | None
    resolved_by: str | None = None  # an operator resolution: the key's name, else its role

    @classmethod
    def from_values(cls, values: Sequence[str | None]) -> EffectRecord | None:
        """A record from ``HMGET <effect hash> *RECORD_FIELDS`` (None: no such hash)."""
        h = {f: v for f, v in zip(RECORD_FIELDS, values, strict=True) if v is not None}
        return cls.from_hash(h) if "state" in h else None

    @classmethod
    def from_flat(cls, flat: Sequence[str]) -> EffectRecord:
        return cls.from_hash(dict(zip(flat[::2], flat[1::2], strict=True)))

    @classmethod
    def from_hash(cls, h: dict[str, str]) -> EffectRecord:
        return cls(
            state=h["state"],  # type: ignore[arg-type]
            generation=int(h.get("generation") or 0),
            intent_sha256=h.get("intent_sha256", ""),
            adapter=h.get("adapter", ""),
            operation=h.get("operation", ""),
            result=fastjson.loads(h["result"]) if h.get("result") else None,
            error=fastjson.loads(h["error"]) if h.get("error") else None,
            updated_at_ms=int(h.get("updated_at") or 0),
            created_at_ms=int(h.get("created_at") or 0),
            attempts=int(h.get("attempts") or 0),
            worker_id=h.get("worker_id") or None,
            resolved_by=h.get("resolved_by") or None,
        )


def downstream_key(tenant: str, job_id: str, step: str, *, tenant_keyed: bool) -> str:
    """The idempotency key a step's adapter sends downstream: ``<job>:<step>``, or
    ``<tenant>/<job>:<step>`` for an adapter whose key carries the tenant (every adapter of a
    deployment with several tenants, gateway.fencing.tenancy). The dispatch, the effect
    record's API view, the console and the SDK all show this one string."""
    key = f"{job_id}:{step}"
    return f"{tenant}/{key}" if tenant_keyed else key


PROXIED_KEY_LIMIT = 255  # Stripe's limit on Idempotency-Key, and a common bound elsewhere


def proxied_key(tenant: str, job_id: str, step: str) -> str:
    """The key a proxied step's upstream sees (adapter ``proxy:<upstream>``, gateway.proxy):
    always ``<tenant>/<job>:<step>`` (an upstream is shared by its tenants' workers), or
    ``fg-<SHA-256 hex>`` of it when longer than :data:`PROXIED_KEY_LIMIT`."""
    key = downstream_key(tenant, job_id, step, tenant_keyed=True)
    if len(key) > PROXIED_KEY_LIMIT:
        return "fg-" + hashlib.sha256(key.encode()).hexdigest()
    return key


@dataclass(frozen=True, slots=True)
class EffectResult:
    """What an effect call answers (the gateway's service and the SDK share it)."""

    job_id: str
    step: str
    generation: int
    state: str
    replayed: bool
    idempotency_key: str
    adapter: str
    result: Any


DEFAULT_TYPE = "application/octet-stream"  # an output's media type when none was given


@dataclass(frozen=True, slots=True)
class OutputRecord:
    """One attempt-scoped output as recorded in Redis: a field ``<generation>/<name>`` of the
    job's outputs hash ``fg:{t/j}:outputs``, written by the output scripts (``state`` staged,
    then recorded with its size and digest), read by the completion script, the views, the
    ledger and the sweeper. A field missing from the stored JSON reads as its zero value."""

    generation: int
    name: str
    state: str  # staged | recorded
    key: str
    size: int
    sha256: str
    content_type: str
    staged_ms: int
    recorded_ms: int
    presigned: bool
    etag: str
    upload: str
    deadline_ms: int
    worker_id: str
    copy: str = ""  # a completion copying this pre-signed upload to ``key`` (its claim id)
    copy_deadline_ms: int = 0  # until when that copy holds the entry

    @property
    def at_ms(self) -> int | None:
        """When it was recorded, else staged (ms; None: neither is known)."""
        return self.recorded_ms or self.staged_ms or None

    @classmethod
    def parse(cls, field: str, raw: str) -> OutputRecord:
        """The record of hash field ``field`` holding ``raw``; ValueError when it is not one."""
        gen, _, name = field.partition("/")
        try:
            d = fastjson.loads(raw)
        except ValueError as exc:
            raise ValueError(f"output record {field!r}: not JSON") from exc
        if not isinstance(d, dict):
            raise ValueError(f"output record {field!r}: not a JSON object")
        try:
            return cls(
                generation=int(gen),
                name=name,
                state=str(d.get("state", "")),
                key=str(d.get("key", "")),
                size=int(d.get("size") or 0),
                sha256=str(d.get("sha256", "")),
                content_type=str(d.get("content_type") or DEFAULT_TYPE),
                staged_ms=int(d.get("staged_ms") or 0),
                recorded_ms=int(d.get("recorded_ms") or 0),
                presigned=bool(d.get("presigned")),
                etag=str(d.get("etag", "")),
                upload=str(d.get("upload", "")),
                deadline_ms=int(d.get("deadline") or 0),
                worker_id=str(d.get("worker_id", "")),
                copy=str(d.get("copy") or ""),
                copy_deadline_ms=int(d.get("copy_deadline") or 0),
            )
        except (TypeError, ValueError) as exc:  # a field of another type (a list for a size)
            raise ValueError(f"output record {field!r}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class CompletionRecord:
    """The job's fenced completion as stored (the ``completed`` field of its job hash): which
    generation, when (ms, Redis's clock), its result and the outputs it promoted. The SDK's
    :class:`gateway.client.jobdata.Completion` is the API's answer built from it."""

    generation: int
    at_ms: int
    result: Any
    outputs: dict[str, dict[str, Any]]
    replayed: bool = False

    @classmethod
    def from_json(cls, raw: str, *, replayed: bool = False) -> CompletionRecord:
        d = fastjson.loads(raw)
        return cls(int(d["generation"]), int(d["at_ms"]), d["result"], d["outputs"], replayed)


@dataclass(frozen=True, slots=True)
class Admitted:
    """The caller now holds the step and must dispatch, then record under ``dispatch_id``."""

    dispatch_id: str
    fence: int
    deadline_ms: int
    resolving: bool  # the step was ``unknown``; resolve through lookup / dedupes first


@dataclass(frozen=True, slots=True)
class Replay:
    """The step already has a recorded outcome (succeeded or failed)."""

    record: EffectRecord


@dataclass(frozen=True, slots=True)
class InProgress:
    retry_after_ms: int


@dataclass(frozen=True, slots=True)
class Unresolved:
    """The step's outcome is unknown and the adapter cannot resolve it: an operator's
    decision (``resolve``) is needed. (Not :class:`adapters.base.Unknown`, the outcome an
    adapter reports for one send.)"""

    record: EffectRecord


@dataclass(frozen=True, slots=True)
class Queued:
    """Async: the intent is recorded (or already was) for the relay; ``state`` is where it is."""

    state: str
    generation: int
    repeated: bool = False  # the relay had the step already: this call added nothing


@dataclass(frozen=True, slots=True)
class OverQuota:
    """The call would have pinned, queued or claimed the step, and the tenant's ``quota``
    (gateway.fencing.quotas) is used up: nothing was stored or sent."""

    quota: str


@dataclass(frozen=True, slots=True)
class RelayClaim:
    dispatch_id: str
    generation: int
    adapter: str
    operation: str
    payload: Any
    deadline_ms: int


AdmitVerdict = Admitted | Replay | InProgress | Unresolved | Queued | OverQuota


@dataclass(frozen=True, slots=True)
class Registration:
    generation: int
    lease_expires_at_ms: int | None
    created: bool


@dataclass(frozen=True, slots=True)
class JobView:
    fence: int
    lease_ms: int | None
    lease_expires_at_ms: int | None
    cancelled: bool
    effects: dict[str, EffectRecord]


@dataclass(frozen=True, slots=True)
class AuditEntry:
    id: str
    at_ms: int
    job_id: str
    step: str | None
    reason: str
    presented: int | None
    current: int | None
    worker_id: str | None
    adapter: str | None
    by: str | None = None  # an operator resolution: the key's name, else its role

    @classmethod
    def from_fields(cls, entry_id: str, f: dict[str, str]) -> AuditEntry:
        return cls(
            id=entry_id,
            at_ms=int(f.get("at") or 0),
            job_id=f.get("job_id", ""),
            step=f.get("step") or None,
            reason=f.get("reason", ""),
            presented=int(f["presented"]) if f.get("presented") else None,
            current=int(f["current"]) if f.get("current") else None,
            worker_id=f.get("worker_id") or None,
            adapter=f.get("adapter") or None,
            by=f.get("by") or None,
        )


def chain_hash(fields: Sequence[tuple[str, str]], key: bytes | None = None) -> str:
    """The audit chain's hash of one entry over its "name=value" lines (every field before
    'hash', joined by newlines): HMAC-SHA1 with the audit key, or plain SHA-1 without one
    (the Lua prelude's ``audit()`` computes the same bytes)."""
    text = "\n".join(f"{k}={v}" for k, v in fields).encode()
    if key:
        return hmac.new(key, text, hashlib.sha1).hexdigest()
    return hashlib.sha1(text, usedforsecurity=False).hexdigest()


@dataclass(frozen=True, slots=True)
class AuditCheck:
    jobs: int
    entries: int
    broken: list[str]
