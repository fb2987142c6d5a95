"""The job view's completion, checkpoints and outputs as API models (no HTTP here): the one
place the wire models of an output (:class:`~gateway.http.models.OutputOut`,
:class:`~gateway.http.models.OutputRecordOut`, :class:`~gateway.http.models.PromotedOutputOut`)
are built from the records the store answers (:class:`~gateway.core.records.OutputRecord`,
:class:`~gateway.core.records.CompletionRecord`)."""

from __future__ import annotations

from typing import Any

from gateway.core.records import CompletionRecord, OutputRecord
from gateway.http.models import (
    CheckpointOut,
    CheckpointSummaryOut,
    CompletionOut,
    OutputOut,
    OutputRecordOut,
    PromotedOutputOut,
    iso_ms,
)
from gateway.store.jobstate import Checkpoint, JobStateView

__all__ = [
    "checkpoint_out",
    "completion_out",
    "job_state_out",
    "output_out",
    "output_record_out",
    "summary",
]


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


def completion_out(job_id: str, c: CompletionRecord) -> CompletionOut:
    return CompletionOut(
        job_id=job_id,
        generation=c.generation,
        completed_at=iso_ms(c.at_ms),
        result=c.result,
        outputs={n: PromotedOutputOut.model_validate(o) for n, o in c.outputs.items()},
        replayed=c.replayed,
    )


def output_out(job_id: str, o: OutputRecord) -> OutputOut:
    """An output as its upload answers it."""
    return OutputOut(
        job_id=job_id,
        name=o.name,
        generation=o.generation,
        state="recorded" if o.state == "recorded" else "staged",
        key=o.key,
        size=o.size,
        sha256=o.sha256,
        content_type=o.content_type,
        presigned=o.presigned,
        staged_at=iso_ms(o.staged_ms or None),
        recorded_at=iso_ms(o.recorded_ms or None),
    )


def output_record_out(o: OutputRecord, *, promoted: bool) -> OutputRecordOut:
    """An output as the job view lists it (``promoted``: the completion names it)."""
    return OutputRecordOut(
        name=o.name,
        generation=o.generation,
        state=o.state,
        key=o.key,
        size=o.size,
        sha256=o.sha256,
        content_type=o.content_type,
        at=iso_ms(o.at_ms),
        promoted=promoted,
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
            output_record_out(o, promoted=(o.generation, o.name) in promoted) for o in view.outputs
        ],
    }
