"""The Python SDK for workers and schedulers (docs/sdk.md).

::

    from gateway.client import Scheduler, FencedJob, StaleGeneration

    async with Scheduler("http://127.0.0.1:8080", api_key=...) as sched:
        gen = await sched.register("r", lease_ms=60_000)

    async with FencedJob("http://127.0.0.1:8080", "r", gen.token, api_key=...) as job:
        result = await job.effect("notify", adapter="email", operation="send", payload={...})
        await job.checkpoint("progress", {"page": 3})        # a new generation resumes from it
        await job.put_output("report.pdf", Path("report.pdf"), content_type="application/pdf")
        await job.complete(result={"pages": 3}, outputs=["report.pdf"])  # promotes the report

Errors are the gateway's own classes (:mod:`gateway.core.errors`), rebuilt from the
problem document, with its fields as attributes (``exc.presented``,
``exc.current``, ``exc.retry_after`` …).

While a :class:`FencedJob` is open it heartbeats. When the gateway says the
generation is no longer current (stale, cancelled, lease expired,
unregistered), the task that opened the job is **cancelled** — the work stops,
it is not merely logged — and leaving the ``async with`` block raises that
error instead of ``CancelledError``. Only ``effect_in_progress`` and
``adapter_unavailable`` are retried, with backoff and the same intent.
"""

from gateway.client.api import (
    AdapterUnavailable,
    BadToken,
    CheckpointValue,
    Completion,
    EffectFailed,
    EffectInProgress,
    EffectResult,
    FencedJob,
    FencegateError,
    GatewayUnreachable,
    Generation,
    IntentMismatch,
    InvalidRequest,
    JobCancelled,
    JobCompleted,
    LeaseExpired,
    OutcomeUnknown,
    OutputNotStaged,
    OutputUploaded,
    Rejection,
    Scheduler,
    StaleGeneration,
    StoreUnavailable,
    Superseded,
    TryLater,
    UnknownAdapter,
    UnregisteredGeneration,
    mint_token,
)
from gateway.client.sync import SyncFencedJob, SyncScheduler

__all__ = [
    "AdapterUnavailable",
    "BadToken",
    "CheckpointValue",
    "Completion",
    "EffectFailed",
    "EffectInProgress",
    "EffectResult",
    "FencedJob",
    "FencegateError",
    "GatewayUnreachable",
    "Generation",
    "IntentMismatch",
    "InvalidRequest",
    "JobCancelled",
    "JobCompleted",
    "LeaseExpired",
    "OutcomeUnknown",
    "OutputNotStaged",
    "OutputUploaded",
    "Rejection",
    "Scheduler",
    "StaleGeneration",
    "StoreUnavailable",
    "Superseded",
    "SyncFencedJob",
    "SyncScheduler",
    "TryLater",
    "UnknownAdapter",
    "UnregisteredGeneration",
    "mint_token",
]
