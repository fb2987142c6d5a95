"""The only module that talks to Redis: runs the Lua scripts and turns their replies into verdicts.

Every decision (register, admit, record, heartbeat, cancel, reject, resolve, relay claim) is
one script, one round trip. Each method below turns its script's reply into a typed verdict
(:mod:`gateway.core.records`); every rejection becomes its typed error in one place,
:meth:`Store._rejected`. The durability checks around the store (markers, epochs, the audit
chain) are in :mod:`gateway.store.durability`.

Durability (docs/operations.md): every deciding script first checks the durability marker of
its job's slot (written for all 16384 slots by ``fencegate init``, see :mod:`gateway.store.keys`).
A Redis that restarted empty, was flushed, or lost a slot answers ``{8}`` and the call fails
closed with :class:`~gateway.core.errors.StoreUnavailable` — atomically, in the same round trip
as the decision — until an operator runs ``fencegate init --confirm-data-loss``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gateway.core.errors import (
    BadToken,
    EffectNotUnknown,
    FencegateError,
    GenerationExhausted,
    GenerationRegression,
    IntentMismatch,
    JobCancelled,
    JobCompleted,
    LeaseExpired,
    NotFound,
    StaleGeneration,
    StoreUnavailable,
    UnregisteredGeneration,
)
from gateway.core.reasons import resolution
from gateway.core.records import (
    Admitted,
    AdmitVerdict,
    AuditCheck,
    AuditEntry,
    EffectRecord,
    EffectState,
    InProgress,
    JobView,
    OverQuota,
    Queued,
    Registration,
    RelayClaim,
    Replay,
    Unknown,
)
from gateway.core.tokens import MAX_GENERATION
from gateway.store import scripts
from gateway.store.anchors import note_audit
from gateway.store.keys import JobKeys
from gateway.store.reads import StoreReads
from gateway.store.relayq import RelayQueue
from gateway.store.scripts import connect, new_request_id

__all__ = [
    "Admitted",
    "AuditCheck",
    "AuditEntry",
    "EffectRecord",
    "InProgress",
    "JobView",
    "Queued",
    "Registration",
    "RelayClaim",
    "Store",
    "connect",
    "new_request_id",
]

_REJECTIONS: dict[str, type[FencegateError]] = {
    c.code: c
    for c in (
        BadToken,
        StaleGeneration,
        UnregisteredGeneration,
        LeaseExpired,
        JobCancelled,
        GenerationRegression,
        GenerationExhausted,
        IntentMismatch,
        JobCompleted,
    )
}

_DETAILS = {
    "stale_generation": "generation {p} is below the job's fence {c}; stop working on this job",
    "unregistered_generation": "generation {p} is above the fence {c} and was never registered",
    "lease_expired": "the lease of generation {p} ran out without renewal",
    "job_cancelled": "the job was cancelled",
    "generation_regression": "generation {p} is below the job's fence {c}",
    "generation_exhausted": "the job's fence {c} is the largest generation; nothing to allocate",
    "intent_mismatch": "this step is pinned to a different adapter, operation or payload",
    "bad_token": "the fencing token is not valid",
    "job_completed": "the job completed (its fence is {c}): it takes nothing new",
}

_REGISTERED_LAST = {0: 7, 2: 3, 4: 3, 12: 3}  # admit-6 replies ending in a registration audit id


class Store(RelayQueue, StoreReads):
    """Fences, effects and audit entries in Redis; every decision is one Lua script."""

    async def script(
        self, name: str, job: JobKeys, keys: Sequence[str], args: Sequence[str]
    ) -> list[Any]:
        """Run one of ``SCRIPT_NAMES`` for a service above the store (gateway.fencing.outputs),
        through the same prelude, trailer and failure handling as the store's own calls."""
        return await self._run(name, job, keys, args)

    async def rejected(
        self, keys: JobKeys, reply: list[Any], *, step: str = "", worker_id: str = ""
    ) -> FencegateError:
        """The typed error of a script's ``{9, …}`` reply (copied to the tenant's feed)."""
        return await self._rejected(keys, reply, step=step, worker_id=worker_id)

    # -- decisions -----------------------------------------------------------
    async def _rejected(
        self,
        keys: JobKeys,
        reply: list[Any],
        *,
        step: str = "",
        worker_id: str = "",
        adapter: str = "",
        detail: str | None = None,
    ) -> FencegateError:
        """Turn a ``{9, reason, presented, current, audit_id, pinned}`` reply into an error.

        The entry is already in the job's audit stream (written by the script,
        atomically with the decision); a copy goes to the tenant-wide feed so
        the audit log can be listed across jobs without touching many slots.
        """
        _, reason, presented, current, audit_id, pinned = reply
        await self._to_feed(
            keys, str(audit_id), step=step, reason=reason, presented=presented, current=current,
            worker_id=worker_id, adapter=adapter,
        )  # fmt: skip
        fields: dict[str, Any] = {
            "presented": int(presented) if presented else None,
            "current": int(current),
        }
        if pinned:
            fields["pinned_intent_sha256"] = pinned
        detail = detail or _DETAILS[reason].format(p=presented or "(next)", c=current)
        return _REJECTIONS[reason](detail, **fields)

    async def register(
        self,
        keys: JobKeys,
        generation: int | None,
        lease_ms: int | None,
        *,
        by: str = "",
        request_id: str | None = None,
    ) -> Registration:
        """Register a generation (a new one is audited with ``by``, who registered it).
        ``request_id``: a re-send with the same one answers the first one's registration
        (within ``redis.request_memory_seconds``) instead of allocating another."""
        reply = await self._run(
            "register-2",
            keys,
            (keys.job, keys.audit),
            (
                "" if generation is None else str(generation),
                "" if lease_ms is None else str(lease_ms),
                keys.job_id,
                keys.tenant,
                self._retention,
                str(MAX_GENERATION),
                by,
            ),
            request_id,
        )
        if int(reply[0]) == 9:
            raise await self._rejected(keys, reply)
        if len(reply) > 3:
            note_audit(self.audit_touched, keys, str(reply[3]))
        lease = int(reply[2])
        return Registration(int(reply[1]), lease or None, created=int(reply[0]) == 0)

    async def heartbeat(
        self, keys: JobKeys, generation: int, worker_id: str, *, by: str = ""
    ) -> tuple[int, int | None]:
        reply = await self._run(
            "heartbeat-2",
            keys,
            (keys.job, keys.audit),
            (
                str(generation),
                self._registration,
                keys.job_id,
                worker_id,
                keys.tenant,
                self._retention,
                by,
            ),
        )
        if int(reply[0]) == 9:
            raise await self._rejected(keys, reply, worker_id=worker_id)
        if len(reply) > 3 and reply[3]:  # an implicit registration
            note_audit(self.audit_touched, keys, str(reply[3]))
        return int(reply[1]), (int(reply[2]) or None)

    async def reject(
        self,
        keys: JobKeys,
        err: FencegateError,
        *,
        step: str = "",
        worker_id: str = "",
        adapter: str = "",
    ) -> FencegateError:
        """Audit a rejection decided outside Redis (bad token); returns the error to raise."""
        presented = err.fields.get("presented")
        reply = await self._run(
            "reject-2",
            keys,
            (keys.job, keys.audit),
            (err.code, "" if presented is None else str(presented), keys.job_id, step, worker_id,
             adapter, keys.tenant, self._retention),
        )  # fmt: skip
        return await self._rejected(
            keys, reply, step=step, worker_id=worker_id, adapter=adapter, detail=err.detail
        )

    async def resolve(
        self, keys: JobKeys, step: str, *, delivered: bool, result: Any, operator: str, by: str
    ) -> EffectRecord:
        """Record an operator's finding for an ``unknown`` step (audited; ``operator`` is the
        entry's worker_id, ``by`` the key's name, else its role)."""
        reply = await self._run(
            "resolve-5",
            keys,
            (keys.effect(step), keys.job, keys.audit, keys.relayq, keys.needs),
            (
                "delivered" if delivered else "not_delivered",
                "" if result is None else json.dumps(result, separators=(",", ":")),
                keys.job_id,
                step,
                keys.tenant,
                self._retention,
                operator,
                keys.member(step),
                by or operator,
            ),
        )
        code = int(reply[0])
        if code == 1:
            raise NotFound(f"no effect recorded for {keys.job_id}:{step}")
        if code == 2:
            raise EffectNotUnknown(
                f"the step is {reply[1]}: only an unknown outcome can be resolved", state=reply[1]
            )
        await self._to_feed(
            keys,
            str(reply[2]),
            step=step,
            reason=resolution(delivered),
            worker_id=operator,
            by=by or operator,
        )
        await self.needs.unhint(keys, step)
        record = await self.effect(keys, step)
        assert record is not None
        return record

    async def cancel(self, keys: JobKeys) -> tuple[int, bool]:
        """Cancel the job; returns (fence, was_already_cancelled). A completed job is not
        cancelled (:class:`JobCompleted`, not audited: the scheduler's call, not a worker's)."""
        reply = await self._run("cancel-1", keys, (keys.job,), ())
        if int(reply[0]) == 2:
            raise JobCompleted(
                "the job completed; a completed job is not cancelled",
                presented=None,
                current=int(reply[1]),
            )
        return int(reply[1]), int(reply[0]) == 1

    async def admit(
        self,
        keys: JobKeys,
        step: str,
        *,
        generation: int,
        intent_sha256: str,
        adapter: str,
        operation: str,
        worker_id: str,
        resolvable: bool,
        payload_json: str = "",
        dispatch_id: str | None = None,
        by: str = "",
        run_before_ms: int | None = None,
        closed: str = "",
    ) -> AdmitVerdict:
        """Admit a call; with ``payload_json`` (async) the intent is queued for the relay.

        ``dispatch_id`` is also the call's request id: sent again with the same one (its
        reply was lost), the admit answers what it answered the first time; ``run_before_ms``
        too (the first send's bound, see ``_run_bounded``: a copy arriving later does nothing).
        ``closed``: the tenant's used-up quotas (admit-6's ARGV[18]) -> ``OverQuota``.
        """
        dispatch_id = dispatch_id or scripts._dispatch_id()
        reply = await self._run_bounded(
            "admit-6",
            keys,
            (keys.job, keys.effect(step), keys.audit, keys.steps, keys.relayq, keys.needs),
            (
                str(generation),
                self._registration,
                intent_sha256,
                adapter,
                operation,
                dispatch_id,
                self._dispatch_timeout_ms,
                self._retention,
                "1" if resolvable else "0",
                keys.job_id,
                step,
                worker_id,
                keys.tenant,
                payload_json,
                keys.member(step),
                by,
            ),
            dispatch_id,
            run_before_ms,
            (closed,),
        )
        code = int(reply[0])
        if len(reply) == _REGISTERED_LAST.get(code) and reply[-1]:  # implicit registration
            note_audit(self.audit_touched, keys, str(reply[-1]))
        if code == 0:
            if reply[5]:
                await self._copy_to_feed(keys, str(reply[5]))
            return Admitted(str(reply[1]), int(reply[2]), int(reply[3]), reply[4] == "1")
        if code == 1:
            return Replay(EffectRecord.from_flat(reply[1:]))
        if code == 2:
            return InProgress(int(reply[1]))
        if code == 3:
            unknown = EffectRecord.from_flat(reply[1:])
            await self.needs.hint(keys, step, unknown.updated_at_ms)
            return Unknown(unknown)
        if code == 4:
            if reply[1]:
                await self._copy_to_feed(keys, str(reply[1]))
            return Queued("pending", generation)
        if code == 5:
            record = EffectRecord.from_flat(reply[1:])
            return Queued(record.state, record.generation, repeated=True)
        if code == 12:
            return OverQuota(str(reply[1]))  # a quota the caller said is used up (closed)
        if code == 10:
            raise StoreUnavailable("this call was given up before Redis ran it; nothing was done")
        raise await self._rejected(keys, reply, step=step, worker_id=worker_id, adapter=adapter)

    async def void(
        self, keys: JobKeys, step: str, dispatch_id: str, run_before_ms: int | None = None
    ) -> str:
        """Give up an admit (or relay claim) whose reply never came, its mark outliving its bound
        ``run_before_ms``: 'voided' (it had not run and never will), 'released' / 'unknown' (it
        had run; the step is as before it), or what was there instead: nothing to undo."""
        reply = await self._run(
            "void-4",
            keys,
            (keys.effect(step), keys.relayq, keys.req(dispatch_id), keys.needs),
            (dispatch_id, self._retention, keys.member(step), str(run_before_ms or "")),
        )
        if reply[1] == "unknown":
            await self.needs.hint(keys, step)
        return str(reply[1])

    async def record(
        self,
        keys: JobKeys,
        step: str,
        dispatch_id: str,
        state: EffectState,
        *,
        result: Any = None,
        error: Any = None,
        request_id: str | None = None,
        retry_due_ms: int = 0,
    ) -> tuple[bool, int | None]:
        """Record a dispatch's outcome: (held, when the relay tries again). ``held`` is False
        when the step is no longer held by this dispatch. A relay dispatch that ends
        ``released`` stays queued, due at ``retry_due_ms``."""
        reply = await self._run(
            "record-3",
            keys,
            (keys.effect(step), keys.relayq, keys.needs),
            (
                dispatch_id,
                state,
                "" if result is None else json.dumps(result, separators=(",", ":")),
                "" if error is None else json.dumps(error, separators=(",", ":")),
                self._retention,
                keys.member(step),
                str(retry_due_ms),
            ),
            request_id=request_id,
        )
        if int(reply[0]) != 0:
            return False, None
        if state == "unknown":
            await self.needs.hint(keys, step)
        return True, (int(reply[1]) if reply[1] else None)
