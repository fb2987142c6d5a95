"""The whole fencegate error tree. Each class knows its problem ``code`` and HTTP status.

The same classes are raised by the gateway (and rendered as RFC 9457 problem
details by :mod:`gateway.http.problems`) and by the SDK (:mod:`gateway.client`, which
rebuilds them from a problem document), so a worker catches exactly what the
gateway decided::

    FencegateError
    ├── InvalidRequest            400 invalid_request
    │   └── BadToken              400 bad_token          (audited)
    ├── Unauthorized              401 unauthorized
    ├── Forbidden                 403 forbidden
    ├── NotFound                  404 not_found
    ├── MethodNotAllowed          405 method_not_allowed
    ├── PayloadTooLarge           413 payload_too_large
    ├── ExpectationFailed         417 expectation_failed (an Expect other than 100-continue)
    ├── TooManyCheckpoints        413 too_many_checkpoints (a new name past max_per_job; audited)
    ├── UnsupportedMediaType      415 unsupported_media_type (a body that is not application/json)
    ├── TryLater                  the same call may be answered later: back off and retry
    │   ├── RequestTimeout        408 request_timeout (the body did not arrive in time)
    │   ├── QuotaExceeded         429 quota_exceeded (Retry-After; audited)
    │   ├── TooManyHeld           429 too_many_held (Retry-After; ``limit``: the config key of
    │   │                             the per-tenant cap on long-lived requests reached)
    │   ├── EffectInProgress      409 effect_in_progress (Retry-After)
    │   ├── OutputInProgress      409 output_in_progress (Retry-After; an upload of it is running)
    │   ├── ObjectStoreUnavailable 503 object_store_unavailable (nothing was recorded)
    │   ├── InsufficientStorage   507 insufficient_storage (the volume's free-space floor)
    │   ├── AdapterUnavailable    502 adapter_unavailable
    │   ├── StoreUnavailable      503 store_unavailable
    │   └── GatewayUnreachable    (SDK only) no HTTP answer from the gateway
    ├── Rejection                 409, carries presented/current; audited
    │   ├── Superseded                this generation may act no more: stop the job's work
    │   │   ├── StaleGeneration       stale_generation
    │   │   ├── UnregisteredGeneration unregistered_generation
    │   │   ├── LeaseExpired          lease_expired
    │   │   ├── JobCancelled          job_cancelled
    │   │   └── JobCompleted          job_completed (the job completed: nothing new is taken)
    │   ├── GenerationRegression      generation_regression
    │   ├── GenerationExhausted       generation_exhausted (fence is 2^53-1: nothing to allocate)
    │   └── IntentMismatch        422 intent_mismatch
    ├── OutcomeUnknown            409 outcome_unknown (504 when this call timed out)
    ├── EffectNotUnknown          409 effect_not_unknown (resolve: the outcome is known)
    ├── UploadUrlUnsupported      501 upload_url_unsupported (the object store cannot sign URLs)
    ├── UnknownAdapter            422 unknown_adapter
    ├── OutputNotStaged           422 output_not_staged (completion names outputs this
    │                                 generation did not record; ``missing``: their names)
    ├── EffectFailed              424 effect_failed
    ├── ReplayUnavailable         502 replay_unavailable (a proxied response recorded by digest
    │                                 and size only: over the upstream's max_response_bytes)
    └── InternalError             500 internal_error

``TryLater`` and ``Superseded`` are the two categories a worker acts on: retry later, or stop.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "AdapterUnavailable",
    "BadToken",
    "EffectFailed",
    "EffectInProgress",
    "EffectNotUnknown",
    "FencegateError",
    "Forbidden",
    "GatewayUnreachable",
    "GenerationExhausted",
    "GenerationRegression",
    "InsufficientStorage",
    "IntentMismatch",
    "InternalError",
    "InvalidRequest",
    "JobCancelled",
    "JobCompleted",
    "LeaseExpired",
    "MethodNotAllowed",
    "NotFound",
    "ObjectStoreUnavailable",
    "OutcomeUnknown",
    "OutputInProgress",
    "OutputNotStaged",
    "PayloadTooLarge",
    "QuotaExceeded",
    "Rejection",
    "ReplayUnavailable",
    "RequestTimeout",
    "StaleGeneration",
    "StoreUnavailable",
    "Superseded",
    "TooManyCheckpoints",
    "TooManyHeld",
    "TryLater",
    "Unauthorized",
    "UnknownAdapter",
    "UnregisteredGeneration",
    "UnsupportedMediaType",
    "UploadUrlUnsupported",
    "error_for_code",
]

PROBLEM_BASE = "https://fencegate.dev/problems/"


class FencegateError(Exception):
    """Base of every error the gateway reports; rendered as problem+json."""

    code: ClassVar[str] = "error"  # abstract; InternalError is the 500 that is raised
    status: ClassVar[int] = 500
    title: ClassVar[str] = "Error"

    def __init__(self, detail: str = "", *, status: int | None = None, **fields: Any) -> None:
        super().__init__(detail or self.title)
        self.detail = detail or self.title
        self.fields: dict[str, Any] = fields
        # A few codes map to two statuses (outcome_unknown: 409 or 504).
        self.http_status = status or self.status

    def __getattr__(self, name: str) -> Any:
        # Problem fields (presented, current, retry_after …) read as attributes.
        fields = self.__dict__.get("fields", {})
        if name in fields:
            return fields[name]
        raise AttributeError(name)

    def problem(self) -> dict[str, Any]:
        """The RFC 9457 problem document for this error."""
        doc: dict[str, Any] = {
            "type": PROBLEM_BASE + self.code,
            "title": self.title,
            "status": self.http_status,
            "detail": self.detail,
            "code": self.code,
        }
        doc.update(self.fields)
        return doc


class TryLater(FencegateError):
    """The same call may be answered later: nothing was done, or sending it again is answered
    safely (the step's key deduplicates). Back off (``retry_after`` where given) and retry."""

    code = "try_later"  # abstract: only its subclasses are raised
    status = 503


class InvalidRequest(FencegateError):
    code = "invalid_request"
    status = 400
    title = "Invalid request"


class BadToken(InvalidRequest):
    code = "bad_token"
    title = "Bad fencing token"


class Unauthorized(FencegateError):
    code = "unauthorized"
    status = 401
    title = "Missing or unknown API key"


class Forbidden(FencegateError):
    code = "forbidden"
    status = 403
    title = "Forbidden"


class NotFound(FencegateError):
    code = "not_found"
    status = 404
    title = "Not found"


class MethodNotAllowed(FencegateError):
    code = "method_not_allowed"
    status = 405
    title = "Method not allowed"


class PayloadTooLarge(FencegateError):
    code = "payload_too_large"
    status = 413
    title = "Request body too large"


class ExpectationFailed(FencegateError):
    code = "expectation_failed"
    status = 417
    title = "Expectation failed"


class TooManyCheckpoints(FencegateError):
    code = "too_many_checkpoints"
    status = 413
    title = "The job holds as many checkpoints as it may; write one of them again"


class RequestTimeout(TryLater):
    code = "request_timeout"
    status = 408
    title = "The request body did not arrive in time"


class QuotaExceeded(TryLater):
    code = "quota_exceeded"
    status = 429
    title = "The tenant's quota is used up"


class TooManyHeld(TryLater):
    """A tenant (or a console login) holds as many long-lived requests as it may: SSE
    streams, uploads, connections. ``limit`` names the config key; nothing was done."""

    code = "too_many_held"
    status = 429
    title = "Too many long-lived requests held by this tenant"


class UnsupportedMediaType(FencegateError):
    code = "unsupported_media_type"
    status = 415
    title = "Request bodies must be application/json"


class Rejection(FencegateError):
    """A call refused by the fence; carries ``presented`` and ``current`` generations."""

    code = "rejection"  # abstract: only its subclasses are raised
    status = 409
    # the rejection's entry in the job's audit chain; '' when it was answered, not audited
    # (past the tenant's rejections cap). Not a problem field.
    audit_id: str = ""


class Superseded(Rejection):
    """This generation may act no more (another took the job over, its lease ran out, the job
    was cancelled or completed): stop the job's work; sending again is refused again."""

    code = "superseded"  # abstract: only its subclasses are raised


class StaleGeneration(Superseded):
    code = "stale_generation"
    title = "Generation is below the job's fence"


class UnregisteredGeneration(Superseded):
    code = "unregistered_generation"
    title = "Generation was never registered by the scheduler"


class LeaseExpired(Superseded):
    code = "lease_expired"
    title = "The generation's lease ran out without renewal"


class JobCancelled(Superseded):
    code = "job_cancelled"
    title = "The job was cancelled"


class GenerationRegression(Rejection):
    code = "generation_regression"
    title = "Generation is below the job's fence"


class GenerationExhausted(Rejection):
    code = "generation_exhausted"
    title = "The job's fence is the largest generation; no next one can be allocated"


class JobCompleted(Superseded):
    code = "job_completed"
    title = "The job completed; it takes no new effects, checkpoints, outputs or generations"


class IntentMismatch(Rejection):
    code = "intent_mismatch"
    status = 422
    title = "The step is pinned to a different intent"


class EffectInProgress(TryLater):
    code = "effect_in_progress"
    status = 409
    title = "Another request is dispatching this step"


class OutcomeUnknown(FencegateError):
    code = "outcome_unknown"
    status = 409
    title = "The outcome of this step is not known"


class EffectNotUnknown(FencegateError):
    code = "effect_not_unknown"
    status = 409
    title = "Only a step whose outcome is unknown can be resolved"


class OutputInProgress(TryLater):
    code = "output_in_progress"
    status = 409
    title = "An upload of this output by this generation is in progress"


class UploadUrlUnsupported(FencegateError):
    code = "upload_url_unsupported"
    status = 501
    title = "The configured object store cannot sign upload URLs"


class ObjectStoreUnavailable(TryLater):
    code = "object_store_unavailable"
    status = 503
    title = "The object store for outputs is unavailable"


class InsufficientStorage(TryLater):
    code = "insufficient_storage"
    status = 507
    title = "The output store's volume is at its free-space floor: nothing was stored"


class UnknownAdapter(FencegateError):
    code = "unknown_adapter"
    status = 422
    title = "No adapter of that name is configured"


class OutputNotStaged(FencegateError):
    code = "output_not_staged"
    status = 422
    title = "An output named by the completion was not recorded by this generation"


class EffectFailed(FencegateError):
    code = "effect_failed"
    status = 424
    title = "The downstream permanently refused the effect"


class AdapterUnavailable(TryLater):
    code = "adapter_unavailable"
    status = 502
    title = "The downstream is unavailable; the effect was not delivered"


class ReplayUnavailable(FencegateError):
    code = "replay_unavailable"
    status = 502
    title = "The recorded response cannot be replayed: only its digest and size were kept"


class StoreUnavailable(TryLater):
    code = "store_unavailable"
    status = 503
    title = "The fence store is unavailable"
    # True when a script was sent and no reply came: it may have run (the store re-sends
    # it with the same request id to learn its verdict).
    maybe_applied: bool = False
    # True when the script ran and answered but R replicas did not acknowledge its writes
    # ([redis] replicas_acked): its verdict was withheld (re-sending it only waits again).
    unacknowledged: bool = False
    # An admit that may have run: the Redis time (ms) after which no copy of it still on the
    # wire runs (admit-8's "run before"); a void of it must outlive this (void-5).
    run_before_ms: int | None = None


class GatewayUnreachable(TryLater):
    """Raised by the SDK when the gateway did not answer (a sent effect call may have run)."""

    code = "gateway_unreachable"
    status = 503
    title = "No answer from the gateway"


class InternalError(FencegateError):
    code = "internal_error"
    title = "Internal error"


def _all_subclasses(cls: type[FencegateError]) -> list[type[FencegateError]]:
    out: list[type[FencegateError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


_CLASSES: list[type[FencegateError]] = [FencegateError, *_all_subclasses(FencegateError)]
_BY_CODE: dict[str, type[FencegateError]] = {c.code: c for c in _CLASSES}


def error_for_code(code: str) -> type[FencegateError]:
    """The error class for a problem ``code`` (``FencegateError`` for unknown codes)."""
    return _BY_CODE.get(code, FencegateError)
