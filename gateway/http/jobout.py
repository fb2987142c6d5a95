"""The job view's completion, checkpoints and outputs as API models (no HTTP here)."""

from __future__ import annotations

from typing import Any

from gateway.http.models import (
    CheckpointOut,
    CheckpointSummaryOut,
    CompletionOut,
    OutputRecordOut,
    PromotedOutputOut,
    iso_ms,
)
from gateway.store.jobstate import Checkpoint, Completion, JobStateView

__all__ = ["checkpoint_out", "completion_out", "job_state_out", "summary"]


def checkpoint_out(job_id: str, c: Checkpoint) -> CheckpointOut:
    return CheckpointOut(
        job_id=job_id,
        name=c.name,
        generation=c.generation,
        worker_id=c.worker_id,
        at=iso_ms(c.at_ms),
        value=c.value,
    )


def summary(c: Checkpoint) -> CheckpointSummaryOut:
    return CheckpointSummaryOut(generation=c.generation, worker_id=c.worker_id, at=iso_ms(c.at_ms))


def completion_out(job_id: str, c: Completion) -> CompletionOut:
    return CompletionOut(
        job_id=job_id,
        generation=c.generation,
        completed_at=iso_ms(c.at_ms),
        result=c.result,
        outputs={n: PromotedOutputOut.model_validate(o) for n, o in c.outputs.items()},
        replayed=c.replayed,
    )


def job_state_out(job_id: str, view: JobStateView) -> dict[str, Any]:
    """The job view's completion, checkpoints and outputs (fields of ``JobOut``)."""
    promoted = {
        (o["generation"], name)
        for name, o in (view.completion.outputs.items() if view.completion else ())
    }
    return {
        "completion": completion_out(job_id, view.completion) if view.completion else None,
        "checkpoints": {n: summary(c) for n, c in view.checkpoints.items()},
        "outputs": [
            OutputRecordOut(
                name=o.name,
                generation=o.generation,
                state=o.state,
                key=o.key,
                size=o.size,
                sha256=o.sha256,
                content_type=o.content_type,
                at=iso_ms(o.at_ms),
                promoted=(o.generation, o.name) in promoted,
            )
            for o in view.outputs
        ],
    }
