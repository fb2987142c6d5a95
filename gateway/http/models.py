"""Pydantic models of the HTTP API v1: request validation and the OpenAPI schemas."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

from gateway.core.names import NAME_PATTERN
from gateway.core.reasons import REASONS
from gateway.core.records import EffectState
from gateway.core.tokens import MAX_GENERATION

__all__ = [
    "AttentionItemOut",
    "AttentionPageOut",
    "AuditEntryOut",
    "AuditPageOut",
    "CancelOut",
    "CheckpointBody",
    "CheckpointListOut",
    "CheckpointOut",
    "CheckpointSummaryOut",
    "CompleteBody",
    "CompletionOut",
    "EffectAcceptedOut",
    "EffectBody",
    "EffectOut",
    "EffectRecordOut",
    "GenerationOut",
    "HealthOut",
    "HeartbeatOut",
    "JobOut",
    "OutputOut",
    "OutputRecordOut",
    "Problem",
    "PromotedOutputOut",
    "ReadyOut",
    "RegisterBody",
    "ResolveBody",
    "iso_ms",
]

Generation = Field(ge=1, le=MAX_GENERATION)


def iso_ms(ms: int | None) -> str | None:
    """Milliseconds since the epoch as an RFC 3339 UTC timestamp."""
    if not ms:
        return None
    dt = datetime.fromtimestamp(ms / 1000, UTC)
    return dt.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class _In(BaseModel):
    # strict: 5 is a generation, "5", 5.0 and true are not
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class RegisterBody(_In):
    """Register ``generation``; omit it to have the gateway allocate fence + 1."""

    generation: int | None = Field(default=None, ge=1, le=MAX_GENERATION)
    lease_ms: int | None = Field(default=None, ge=1000, le=86_400_000)


class EffectBody(_In):
    """The intent of one step: adapter, operation, payload."""

    adapter: str = Field(pattern=NAME_PATTERN)
    operation: str = Field(min_length=1, max_length=128)
    payload: dict[str, Any]


class ResolveBody(_In):
    """An operator's finding for a step whose outcome is unknown."""

    model_config = ConfigDict(extra="forbid", strict=False, frozen=True)

    outcome: Literal["delivered", "not_delivered"]
    result: Any = None


class CheckpointBody(RootModel[Any]):
    """A checkpoint's value: any JSON value (at most ``checkpoints.max_bytes``)."""


class CompleteBody(_In):
    """A fenced completion: the outputs this generation recorded, promoted, and a result."""

    outputs: list[str] = Field(default_factory=list, max_length=256)
    result: Any = None


class GenerationOut(BaseModel):
    job_id: str
    generation: int
    token: str
    lease_expires_at: str | None


class HeartbeatOut(BaseModel):
    job_id: str
    generation: int
    current: bool
    lease_expires_at: str | None


class EffectOut(BaseModel):
    job_id: str
    step: str
    generation: int
    state: Literal["succeeded"]
    replayed: bool
    idempotency_key: str
    adapter: str
    result: Any


class EffectAcceptedOut(BaseModel):
    """202 for ``Prefer: respond-async``: recorded under the fence; the relay performs it."""

    job_id: str
    step: str
    generation: int
    state: Literal["pending", "dispatching"]
    idempotency_key: str
    adapter: str
    location: str


class EffectRecordOut(BaseModel):
    job_id: str
    step: str
    state: EffectState
    generation: int
    intent_sha256: str
    adapter: str
    operation: str
    idempotency_key: str
    result: Any = None
    error: Any = None
    attempts: int
    worker_id: str | None
    created_at: str | None
    updated_at: str | None
    resolved_by: str | None = None  # an operator resolution: the key's name, else its role


class CheckpointOut(BaseModel):
    """A checkpoint as written: its value and the generation that wrote it."""

    job_id: str
    name: str
    generation: int
    worker_id: str | None
    at: str | None
    value: Any = None


class CheckpointSummaryOut(BaseModel):
    generation: int
    worker_id: str | None
    at: str | None


class CheckpointListOut(BaseModel):
    job_id: str
    checkpoints: dict[str, CheckpointSummaryOut]


class PromotedOutputOut(BaseModel):
    """An output the completion promoted: the job's official object."""

    generation: int
    key: str
    size: int
    sha256: str
    content_type: str


class CompletionOut(BaseModel):
    job_id: str
    generation: int
    completed_at: str | None
    result: Any = None
    outputs: dict[str, PromotedOutputOut]
    replayed: bool


class OutputOut(BaseModel):
    """An attempt-scoped output as its upload answers it (``PUT …/outputs/{name}``)."""

    job_id: str
    name: str
    generation: int
    state: Literal["staged", "recorded"]
    key: str = Field(description="the attempt-scoped object key <tenant>/<job>/g<gen>/<name>")
    size: int
    sha256: str
    content_type: str
    presigned: bool
    staged_at: str | None
    recorded_at: str | None


class OutputRecordOut(BaseModel):
    """An attempt-scoped output of one generation (staged, or recorded with its digest)."""

    name: str
    generation: int
    state: str
    key: str
    size: int | None
    sha256: str | None
    content_type: str | None
    at: str | None
    promoted: bool


class JobOut(BaseModel):
    job_id: str
    fence: int
    lease_ms: int | None
    lease_expires_at: str | None
    cancelled: bool
    effects: dict[str, EffectRecordOut]
    completion: CompletionOut | None = None
    checkpoints: dict[str, CheckpointSummaryOut] = Field(default_factory=dict)
    outputs: list[OutputRecordOut] = Field(default_factory=list)


class CancelOut(BaseModel):
    job_id: str
    cancelled: Literal[True]
    fence: int
    already_cancelled: bool


class AuditEntryOut(BaseModel):
    id: str
    at: str | None
    job_id: str
    step: str | None
    reason: str = Field(json_schema_extra={"enum": list(REASONS)})  # gateway.core.reasons
    presented: int | None
    current: int | None
    worker_id: str | None
    adapter: str | None
    by: str | None = None  # an operator resolution: the key's name, else its role


class AuditPageOut(BaseModel):
    items: list[AuditEntryOut]
    next_cursor: str | None


class AttentionItemOut(BaseModel):
    """A step that needs an operator's decision."""

    job_id: str
    step: str
    state: Literal["unknown", "dispatching"]  # dispatching: past its deadline
    since: str | None  # when it became unknown, or when its dispatch deadline passed
    age_ms: int
    deadline: str | None
    generation: int
    adapter: str
    operation: str
    attempts: int
    worker_id: str | None
    last_error: Any = None


class AttentionPageOut(BaseModel):
    items: list[AttentionItemOut]
    next_cursor: str | None


class HealthOut(BaseModel):
    status: Literal["ok"]


class ReadyOut(BaseModel):
    status: Literal["ready", "unavailable"]
    checks: dict[str, bool]
    # when not ready: the first check that failed, as a cause (redis_unreachable,
    # marker_missing, out_of_memory, topology, slot_went_back, ...: docs/operations.md)
    cause: str | None = None
    # for marker_missing: uninitialised, wiped, quarantined
    marker: str | None = None
    detail: str | None = None
    # for a quarantined Redis: why, as the gateway that quarantined it wrote (fg:quarantine:
    # cause, at_ms, slot, counter, seen, by, pid)
    quarantine: dict[str, Any] | None = None


class Problem(BaseModel):
    """RFC 9457 problem details (``application/problem+json``)."""

    model_config = ConfigDict(extra="allow")

    type: str
    title: str
    status: int
    detail: str
    code: str
    presented: int | None = None
    current: int | None = None
    missing: list[str] | None = None  # output_not_staged: the outputs not recorded
