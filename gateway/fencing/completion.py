"""The fenced completion of a job, and its checkpoints. No HTTP here.

A completion is one Lua script (``complete-3``, :mod:`gateway.store.jobstate`): cancel, fence,
lease, "not completed yet" and "every named output recorded by this generation" are
checked and the job is marked completed by that generation — its outputs promoted — in
one atomic step. The zombie's completion matches nothing and changes nothing.

Before the script, outputs uploaded straight to the object store through a pre-signed
URL are recorded (each staged object is copied to its output's key, then the fenced
record script runs: :class:`OutputRecorder`). That step decides nothing: the
completion script re-checks every condition itself, so a recorder that refuses (the
fence moved) only leaves the verdict to the script, which audits it.

A checkpoint is one script too (``checkpoint-3``), charged to the tenant's
``checkpoint_bytes`` quota around it (:meth:`CompletionService.checkpoint`: reserve, write,
settle; :mod:`gateway.fencing.quotas`) and bounded per job by ``checkpoints.max_per_job``
names (checked in the script, so two new names at once cannot both pass the last place).

The reply of a completion may be lost on the wire. The store's client re-sends a call on
a reset connection with the same request id, and a call that timed out is sent once more
with the same id (the prelude answers what the first one answered, or runs it now): a
completion is decided once, whatever the wire did.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import Sequence
from typing import Any, Protocol

from gateway.core.errors import InvalidRequest, Rejection, StoreUnavailable
from gateway.core.names import checked_name
from gateway.core.records import CompletionRecord
from gateway.fencing.quotas import Quotas
from gateway.store.jobstate import (
    CHECKPOINT_ENVELOPE,
    CheckpointWritten,
    JobState,
    canonical_json,
)
from gateway.store.keys import JobKeys
from gateway.store.scripts import new_request_id

__all__ = ["MAX_OUTPUTS", "CompletionService", "OutputRecorder", "body_sha"]

MAX_OUTPUTS = 256  # names in one completion


class OutputRecorder(Protocol):
    """What the object-store side provides: record the outputs of ``generation`` that were
    uploaded by a pre-signed URL and not recorded yet (HEAD, then the fenced record)."""

    async def ensure_recorded(
        self, tenant: str, job: str, generation: int, names: Sequence[str]
    ) -> object: ...


def body_sha(outputs: Sequence[str], result: Any) -> str:
    """The completion's identity: sha256 of its canonical body (outputs as a set)."""
    canonical = canonical_json({"outputs": sorted(outputs), "result": result})
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_output_names(outputs: Sequence[str]) -> None:
    if len(outputs) > MAX_OUTPUTS:
        raise InvalidRequest(f"a completion names at most {MAX_OUTPUTS} outputs")
    for name in outputs:
        checked_name(name, f"output name {name!r}")
    if len(set(outputs)) != len(outputs):
        raise InvalidRequest("each output is named once")


class CompletionService:
    """Completes jobs and writes their checkpoints under the fence; see the module docstring."""

    def __init__(
        self,
        state: JobState,
        quotas: Quotas,
        *,
        max_checkpoints: int,
        recorder: OutputRecorder | None = None,
    ) -> None:
        self._state = state
        self._quotas = quotas
        self._max_checkpoints = max_checkpoints
        self.recorder = recorder  # None: no object store configured

    async def checkpoint(
        self,
        keys: JobKeys,
        name: str,
        value_json: str,
        *,
        generation: int,
        worker_id: str | None,
        by: str = "",
    ) -> int:
        """Write a checkpoint under the fence, charged to the tenant; returns when (ms,
        Redis's clock). Over a cap: ``TooManyCheckpoints`` / ``QuotaExceeded``, audited."""
        worker_json = "null" if worker_id is None else json.dumps(worker_id)
        bound = len(value_json.encode()) + len(worker_json.encode()) + len(name)
        hold = await self._quotas.reserve_checkpoint(keys.tenant, bound + CHECKPOINT_ENVELOPE)
        stored = hold.charge  # unless the verdict says otherwise: counted as written in full
        try:
            written = await self._state.checkpoint(
                keys,
                name,
                value_json,
                generation=generation,
                worker_id=worker_id,
                by=by,
                closed=hold.closed,
            )
            if isinstance(written, CheckpointWritten):
                stored = written.charge - written.replaced
                return written.at_ms
            stored = 0
            raise await self._quotas.checkpoint_refused(
                keys, name, written.quota, worker_id=worker_id or "", limit=self._max_checkpoints
            )
        except Rejection:
            stored = 0
            raise
        except StoreUnavailable as exc:
            if not exc.maybe_applied:
                stored = 0
            raise
        finally:
            self._quotas.settle_checkpoint(keys, hold, stored)

    async def complete(
        self,
        keys: JobKeys,
        *,
        generation: int,
        outputs: Sequence[str],
        result: Any,
        worker_id: str | None,
        by: str = "",
    ) -> CompletionRecord:
        check_output_names(outputs)
        sha = body_sha(outputs, result)
        if outputs and self.recorder is not None:
            # the fence moved, or the job completed: the script says so, audited
            with contextlib.suppress(Rejection):
                await self.recorder.ensure_recorded(keys.tenant, keys.job_id, generation, outputs)
        request_id = new_request_id()
        result_json = canonical_json(result)

        async def once() -> CompletionRecord:
            return await self._state.complete(
                keys,
                generation=generation,
                result_json=result_json,
                outputs=list(outputs),
                body_sha=sha,
                worker_id=worker_id,
                request_id=request_id,
                by=by,
            )

        try:
            return await once()
        except StoreUnavailable as exc:
            if not exc.maybe_applied:
                raise
            failure = exc
        # sent, not answered: it may have run. Once more with the same request id.
        await asyncio.sleep(0.05)
        try:
            return await once()
        except StoreUnavailable:
            raise StoreUnavailable(
                "Redis did not answer the completion; it may have been recorded. Send the "
                "same completion again (it is safe): it replays if it was."
            ) from failure
