"""The store: the deciding scripts (:class:`Decisions`, one method each, whose reply becomes a
typed verdict or error) and :class:`Store`, which composes them with the other parts given the
same link to Redis.

Every decision (register, admit, record, heartbeat, cancel, reject, resolve, relay claim, an
output's stage and record) is one script, one round trip, and this module (with
:mod:`gateway.store.relayq` and :mod:`gateway.store.jobstate`) is the one owner of their wire
layout: a method per script, its KEYS and ARGV one per line, its reply codes compared with
:mod:`gateway.store.replies`. Each method below turns its script's reply into a typed verdict
(:mod:`gateway.core.records`); every rejection becomes its typed error in one place,
:meth:`Decisions.rejected`. The calls themselves go through the link
(:class:`gateway.store.link.RedisLink`: the prelude's trailer, the slot marks, the feed copy).
The durability checks around the store (markers, epochs, the audit chain) are in
:mod:`gateway.store.durability`.

Durability (docs/operations.md): every deciding script first checks the durability marker of
its job's slot (written for all 16384 slots by ``fencegate init``, see :mod:`gateway.store.keys`).
A Redis that restarted empty, was flushed, or lost a slot answers ``{8}`` and the call fails
closed with :class:`~gateway.core.errors.StoreUnavailable` — atomically, in the same round trip
as the decision — until an operator runs ``fencegate init --confirm-data-loss``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import redis.asyncio as aioredis
import structlog

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
    Rejection,
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
    Unresolved,
)
from gateway.core.tokens import MAX_GENERATION
from gateway.store import scripts
from gateway.store.anchors import Anchorer, note_audit
from gateway.store.attention import AttentionIndex
from gateway.store.batching import Batcher
from gateway.store.console_reads import ConsoleReads
from gateway.store.consolestate import ConsoleState
from gateway.store.keys import JobKeys
from gateway.store.link import RedisLink
from gateway.store.output_records import OutputRecords
from gateway.store.quota_counters import QuotaCounters
from gateway.store.reads import StoreReads
from gateway.store.relayq import RelayQueue
from gateway.store.replication import AckPolicy
from gateway.store.replies import (
    AdmitReply,
    CancelReply,
    RecordReply,
    RegisterReply,
    Reply,
    ResolveReply,
)
from gateway.store.router import ClusterRouter
from gateway.store.scripts import connect, fenced_args, new_request_id

__all__ = [
    "Admitted",
    "AuditCheck",
    "AuditEntry",
    "Decisions",
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

# admit-8 replies ending in a registration audit id: their length then
_REGISTERED_LAST: dict[int, int] = {
    AdmitReply.ADMITTED: 7,
    AdmitReply.IN_PROGRESS: 3,
    AdmitReply.QUEUED: 3,
    AdmitReply.OVER_QUOTA: 3,
}

log = structlog.get_logger("fencegate.store")


class Decisions:
    """Fences, effects and audit entries in Redis: every decision is one Lua script, run on
    the store's link."""

    def __init__(
        self,
        link: RedisLink,
        attention: AttentionIndex,
        reads: StoreReads,
        *,
        registration: str,
        dispatch_timeout_ms: int,
        retention_seconds: int,
    ) -> None:
        self._link = link
        self._attention = attention
        self._reads = reads  # resolve answers the record as it reads afterwards
        self._registration = registration
        self._dispatch_timeout_ms = str(dispatch_timeout_ms)
        self._retention = str(retention_seconds)

    async def rejected(
        self,
        keys: JobKeys,
        reply: list[Any],
        *,
        step: str = "",
        worker_id: str = "",
        adapter: str = "",
        detail: str | None = None,
    ) -> FencegateError:
        """The typed error of a script's ``{9, reason, presented, current, audit_id, pinned}``
        reply (copied to the tenant's feed).

        The entry is already in the job's audit stream (written by the script,
        atomically with the decision); a copy goes to the tenant-wide feed so
        the audit log can be listed across jobs without touching many slots: written by the
        script too (includes/feed), but on a Cluster (here, after it).
        """
        _, reason, presented, current, audit_id, pinned = reply
        await self._link.to_feed(
            keys,
            str(audit_id),
            self._link.feeds_in_script,
            step=step,
            reason=reason,
            presented=presented,
            current=current,
            worker_id=worker_id,
            adapter=adapter,
        )
        fields: dict[str, Any] = {
            "presented": int(presented) if presented else None,
            "current": int(current),
        }
        if pinned:
            fields["pinned_intent_sha256"] = pinned
        detail = detail or _DETAILS[reason].format(p=presented or "(next)", c=current)
        error = _REJECTIONS[reason](detail, **fields)
        if isinstance(error, Rejection):
            error.audit_id = str(audit_id)
        return error

    # -- decisions -----------------------------------------------------------

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
        reply = await self._link.run_script(
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
        code = int(reply[0])
        if code == RegisterReply.REJECTED:
            raise await self.rejected(keys, reply)
        if len(reply) > 3:
            note_audit(self._link.audit_touched, keys, str(reply[3]))
        lease = int(reply[2])
        return Registration(int(reply[1]), lease or None, created=code == RegisterReply.REGISTERED)

    async def heartbeat(
        self, keys: JobKeys, generation: int, worker_id: str, *, by: str = ""
    ) -> tuple[int, int | None]:
        flag = self._link.unaudited_flag(keys.tenant)
        reply = await self._link.run_script(
            "heartbeat-2",
            keys,
            (keys.job, keys.audit),
            fenced_args(keys, generation, self._registration, worker_id, self._retention, by, flag),
        )
        if int(reply[0]) == Reply.REJECTED:
            self._link.rejection_spent(keys, "", flag, worker_id, str(reply[4]))
            raise await self.rejected(keys, reply, worker_id=worker_id)
        if len(reply) > 3 and reply[3]:  # an implicit registration
            note_audit(self._link.audit_touched, keys, str(reply[3]))
        return int(reply[1]), (int(reply[2]) or None)

    async def check(
        self,
        keys: JobKeys,
        generation: int,
        worker_id: str,
        *,
        step: str = "",
        adapter: str = "",
    ) -> tuple[int, int | None]:
        """Whether ``generation`` may act on the job now (check-2: a heartbeat that renews
        nothing and never raises the fence): ``(fence, lease_exp_ms or None)``, else its
        audited rejection raised."""
        flag = self._link.unaudited_flag(keys.tenant)
        reply = await self._link.run_script(
            "check-2",
            keys,
            (keys.job, keys.audit),
            (
                *fenced_args(
                    keys, generation, self._registration, worker_id, self._retention, "", flag
                ),
                step,
                adapter,
            ),
        )
        if int(reply[0]) == Reply.REJECTED:
            self._link.rejection_spent(keys, step, flag, worker_id, str(reply[4]))
            raise await self.rejected(keys, reply, step=step, worker_id=worker_id, adapter=adapter)
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
        flag = self._link.unaudited_flag(keys.tenant)
        reply = await self._link.run_script(
            "reject-2",
            keys,
            (keys.job, keys.audit),
            (
                err.code,
                "" if presented is None else str(presented),
                keys.job_id,
                step,
                worker_id,
                adapter,
                keys.tenant,
                self._retention,
                flag,
            ),
        )
        self._link.rejection_spent(keys, step, flag, worker_id, str(reply[4]))
        return await self.rejected(
            keys, reply, step=step, worker_id=worker_id, adapter=adapter, detail=err.detail
        )

    async def resolve(
        self, keys: JobKeys, step: str, *, delivered: bool, result: Any, operator: str, by: str
    ) -> EffectRecord:
        """Record an operator's finding for an ``unknown`` step (audited; ``operator`` is the
        entry's worker_id, ``by`` the key's name, else its role)."""
        reply = await self._link.run_script(
            "resolve-6",
            keys,
            (
                keys.effect(step),
                keys.job,
                keys.audit,
                keys.relayq,
                keys.attention,
                *self._link.relay_hint_keys(keys.tenant),
            ),
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
        if code == ResolveReply.NOT_FOUND:
            raise NotFound(f"no effect recorded for {keys.job_id}:{step}")
        if code == ResolveReply.KNOWN:
            raise EffectNotUnknown(
                f"the step is {reply[1]}: only an unknown outcome can be resolved", state=reply[1]
            )
        await self._link.to_feed(
            keys,
            str(reply[2]),
            step=step,
            reason=resolution(delivered),
            worker_id=operator,
            by=by or operator,
        )
        await self._attention.unhint(keys, step)
        record = await self._reads.effect(keys, step)
        assert record is not None
        return record

    async def cancel(self, keys: JobKeys) -> tuple[int, bool]:
        """Cancel the job; returns (fence, was_already_cancelled). A completed job is not
        cancelled (:class:`JobCompleted`, not audited: the scheduler's call, not a worker's)."""
        reply = await self._link.run_script("cancel-1", keys, (keys.job,), ())
        code = int(reply[0])
        if code == CancelReply.COMPLETED:
            raise JobCompleted(
                "the job completed; a completed job is not cancelled",
                presented=None,
                current=int(reply[1]),
            )
        return int(reply[1]), code == CancelReply.ALREADY

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
        charges: tuple[str, ...] = (),
    ) -> AdmitVerdict:
        """Admit a call; with ``payload_json`` (async) the intent is queued for the relay.

        ``dispatch_id`` is also the call's request id: sent again with the same one (its
        reply was lost), the admit answers what it answered the first time; ``run_before_ms``
        too (the first send's bound, see :meth:`RedisLink.run_bounded`: a copy arriving later
        does nothing).
        ``closed``: the tenant's used-up quotas (admit-8's ARGV[19]; 'r': its ARGV[8] is '1',
        else the rejections flag of :meth:`RedisLink.unaudited_flag`) -> ``OverQuota``.
        ``charges``: what the script charges against the tenant's caps (admit-8's ARGV[20] to
        ARGV[28], ``QuotaCounters.admit_args``): over one -> ``OverQuota``; a payload queued
        and an effect call claimed or queued are charged.
        """
        dispatch_id = dispatch_id or scripts.new_dispatch_id()
        reply = await self._link.run_bounded(
            "admit-8",
            keys,
            (
                keys.job,
                keys.effect(step),
                keys.audit,
                keys.steps,
                keys.relayq,
                keys.attention,
                *self._link.relay_hint_keys(keys.tenant, tenants=True),
            ),
            (
                *fenced_args(
                    keys,
                    generation,
                    self._registration,
                    worker_id,
                    self._retention,
                    by,
                    "1" if "r" in closed else self._link.unaudited_flag(keys.tenant),
                ),
                step,
                intent_sha256,
                adapter,
                operation,
                dispatch_id,
                self._dispatch_timeout_ms,
                "1" if resolvable else "0",
                payload_json,
                keys.member(step),
            ),
            dispatch_id,
            run_before_ms,
            (closed, *charges),
        )
        code = int(reply[0])
        if len(reply) == _REGISTERED_LAST.get(code) and reply[-1]:  # implicit registration
            note_audit(self._link.audit_touched, keys, str(reply[-1]))
        if code == AdmitReply.ADMITTED:
            if reply[5]:  # a supersession
                await self._link.copy_to_feed(
                    keys, str(reply[5]), copied=self._link.feeds_in_script
                )
            return Admitted(str(reply[1]), int(reply[2]), int(reply[3]), reply[4] == "1")
        if code == AdmitReply.REPLAY:
            return Replay(EffectRecord.from_flat(reply[1:]))
        if code == AdmitReply.IN_PROGRESS:
            return InProgress(int(reply[1]))
        if code == AdmitReply.UNKNOWN:
            unknown = EffectRecord.from_flat(reply[1:])
            await self._attention.hint(keys, step, unknown.updated_at_ms)
            return Unresolved(unknown)
        if code == AdmitReply.QUEUED:
            if reply[1]:  # a supersession
                await self._link.copy_to_feed(
                    keys, str(reply[1]), copied=self._link.feeds_in_script
                )
            return Queued("pending", generation)
        if code == AdmitReply.QUEUED_BEFORE:
            record = EffectRecord.from_flat(reply[1:])
            return Queued(record.state, record.generation, repeated=True)
        if code == AdmitReply.OVER_QUOTA:
            return OverQuota(str(reply[1]))  # a quota the caller said is used up (closed)
        if code == AdmitReply.VOIDED:
            raise StoreUnavailable("this call was given up before Redis ran it; nothing was done")
        raise await self.rejected(keys, reply, step=step, worker_id=worker_id, adapter=adapter)

    async def void(
        self, keys: JobKeys, step: str, dispatch_id: str, run_before_ms: int | None = None
    ) -> str:
        """Give up an admit (or relay claim) whose reply never came, its mark outliving its bound
        ``run_before_ms``: 'voided' (it had not run and never will), 'released' / 'unknown' (it
        had run; the step is as before it), or what was there instead: nothing to undo."""
        reply = await self._link.run_script(
            "void-5",
            keys,
            (
                keys.effect(step),
                keys.relayq,
                keys.req(dispatch_id),
                keys.attention,
                *self._link.relay_hint_keys(keys.tenant),
            ),
            (dispatch_id, self._retention, keys.member(step), str(run_before_ms or "")),
        )
        if reply[1] == "unknown":
            await self._attention.hint(keys, step)
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
        reply = await self._link.run_script(
            "record-4",
            keys,
            (
                keys.effect(step),
                keys.relayq,
                keys.attention,
                *self._link.relay_hint_keys(keys.tenant),
            ),
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
        if int(reply[0]) != RecordReply.RECORDED:
            return False, None
        if state == "unknown":
            await self._attention.hint(keys, step)
        return True, (int(reply[1]) if reply[1] else None)

    # -- outputs (gateway.fencing.outputs) -----------------------------------

    async def output_stage(
        self,
        keys: JobKeys,
        *,
        generation: int,
        name: str,
        object_key: str,
        upload: str,
        upload_ms: int,
        presigned: bool,
        worker_id: str,
        content_type: str,
        by: str,
        unaudited: str,
    ) -> list[Any]:
        """``output-stage-3``: the fenced decision before a byte of the output is written.
        The reply as the script answers it (:class:`~gateway.store.replies.OutputStageReply`);
        ``unaudited``: :meth:`RedisLink.unaudited_flag` of the tenant, reported back to the
        budget by the caller (:meth:`RedisLink.rejection_spent`)."""
        return await self._link.run_script(
            "output-stage-3",
            keys,
            (keys.job, keys.outputs, keys.audit),
            (
                *fenced_args(
                    keys, generation, self._registration, worker_id, self._retention, by, unaudited
                ),
                name,
                object_key,
                upload,
                str(upload_ms),
                "1" if presigned else "0",
                content_type,
            ),
        )

    async def output_record(
        self,
        keys: JobKeys,
        *,
        generation: int,
        name: str,
        upload: str,
        size: int,
        sha256: str,
        content_type: str,
        etag: str,
        worker_id: str,
        abandon: bool,
        copy: str = "",
        copy_op: Literal["", "copy", "uncopy"] = "",
    ) -> list[Any]:
        """``output-record-3``: the fenced record of a written output (``abandon``: the end of
        a failed upload's claim). ``copy``: the id of the completion's copy of a pre-signed
        upload that wrote the output's key (a record presents it); ``copy_op`` ``copy`` claims
        that copy for ``size`` ms, ``uncopy`` ends the claim. The reply as the script answers
        it (:class:`~gateway.store.replies.OutputRecordReply`)."""
        return await self._link.run_script(
            "output-record-3",
            keys,
            (keys.job, keys.outputs, keys.audit),
            (
                # the record never raises the fence (its stage did): mode 'required', every
                # rejection audited (no rejections flag) and counted after the script
                *fenced_args(keys, generation, "required", worker_id, self._retention, "", ""),
                name,
                upload,
                str(size),
                sha256,
                content_type,
                etag,
                copy_op or ("abandon" if abandon else "record"),
                copy,
            ),
        )


class Store:
    """The store: one link to Redis (:class:`RedisLink`) and the parts given it, each owning
    its own state: the decisions, the relay queue, the reads and the "needs a decision" index;
    the outputs' records and the console's reads; and, made on request with the caller's
    settings, the quota counters and the console's shared state.

    The parts are public (``store.decisions``, ``store.relay_queue``, ``store.reads``,
    ``store.attention_index``, ``store.output_records``, ``store.console_reads``,
    ``store.link``); the methods callers use are bound here once, from the part that owns
    them, so a call through the store is the part's own call (no frame more on the hot path).
    The link's state (the slot marks, the budget, the problems the periodic checks found) is
    read and set on ``store.link``. Nothing above the store is handed the client or the link's
    generic calls (``run_script``, ``guard``): the store's own modules are given the link."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        registration: str,
        dispatch_timeout_ms: int,
        retention_seconds: int,
        state_file: Path | None = None,
        request_memory_seconds: float = 60.0,
        audit_key: str = "",
        ack: AckPolicy | None = None,
    ) -> None:
        link = self.link = RedisLink(
            client,
            retention_seconds=retention_seconds,
            state_file=state_file,
            request_memory_seconds=request_memory_seconds,
            audit_key=audit_key,
            ack=ack,
        )
        attention = self.attention_index = AttentionIndex(link)
        reads = self.reads = StoreReads(link, attention)
        relay_queue = self.relay_queue = RelayQueue(
            link,
            attention,
            dispatch_timeout_ms=dispatch_timeout_ms,
            retention_seconds=retention_seconds,
        )
        decisions = self.decisions = Decisions(
            link,
            attention,
            reads,
            registration=registration,
            dispatch_timeout_ms=dispatch_timeout_ms,
            retention_seconds=retention_seconds,
        )
        self.output_records = OutputRecords(link.client, link.batcher)
        self.console_reads = ConsoleReads(link.client)
        # the link: boot, the periodic checks, readiness, the rejections budget's flag
        self.aclose = link.aclose
        self.load_scripts = link.load_scripts
        self.initialize = link.initialize
        self.load_marks = link.load_marks
        self.persist_marks = link.persist_marks
        self.heartbeat_epoch = link.heartbeat_epoch
        self.check_durability = link.check_durability
        self.witness = link.witness
        self.went_back = link.went_back
        self.quarantine_cause = link.quarantine_cause
        self.ready = link.ready
        self.readiness = link.readiness
        self.learn_clock = link.learn_clock
        self.clock_at = link.clock_at
        self.redis_clock_ms = link.redis_clock_ms
        self.unaudited_flag = link.unaudited_flag
        self.rejection_spent = link.rejection_spent
        # the decisions
        self.rejected = decisions.rejected
        self.register = decisions.register
        self.heartbeat = decisions.heartbeat
        self.check = decisions.check
        self.reject = decisions.reject
        self.resolve = decisions.resolve
        self.cancel = decisions.cancel
        self.admit = decisions.admit
        self.void = decisions.void
        self.record = decisions.record
        self.output_stage = decisions.output_stage
        self.output_record = decisions.output_record
        # the relay queue
        self.relay_hint = relay_queue.relay_hint
        self.relay_unhint = relay_queue.relay_unhint
        self.relay_queued = relay_queue.queued
        self.relay_left = relay_queue.left
        self.relay_due = relay_queue.relay_due
        self.sweep = relay_queue.sweep
        self.relay_rehint = relay_queue.rehint
        self.relay_claim = relay_queue.relay_claim
        # the reads
        self.effect = reads.effect
        self.job = reads.job
        self.verify_audit = reads.verify_audit
        self.audit = reads.audit
        self.history = reads.history
        self.attention = reads.attention
        self.overview = reads.overview
        self.record_chain_check = reads.record_chain_check
        self.reconcile_attention = reads.reconcile_attention

    def quota_counters(self, *, retention_seconds: int, window_ttl_seconds: int) -> QuotaCounters:
        """The tenants' quota counters (:mod:`gateway.store.quota_counters`) on this store's
        link, their windows' TTL ``window_ttl_seconds``."""
        return QuotaCounters(
            self.link.client,
            self.link.batcher,
            retention_seconds=retention_seconds,
            window_ttl_seconds=window_ttl_seconds,
            clock=self.link.redis_clock_ms,
            folds=self.link.feeds_in_script,
        )

    async def close(self) -> None:
        """The end of the store's lifetime, after the drain: the batches in flight and their
        connections, then the marks of the last writes (after the last reply; a state file
        that cannot be written is logged), then the client the store was given."""
        await self.link.aclose()
        try:
            await self.link.persist_marks()
        except OSError as exc:
            log.error("state_file_write_failed", error=str(exc))
        await self.link.client.aclose()

    def anchorer(self, path: Path, keys: Sequence[str]) -> Anchorer:
        """The audit chains' anchorer (:mod:`gateway.store.anchors`) on this store's link: it
        anchors the chains this process's replies extended (``link.audit_touched``) to
        ``path``, signed with the first of ``keys``."""
        return Anchorer(self.link.client, self.link.audit_touched, path, keys)

    def console_state(self, *, window_seconds: int) -> ConsoleState:
        """The console's shared state (:mod:`gateway.store.consolestate`: logouts, login
        throttling in windows of ``window_seconds``) on this store's link."""
        return ConsoleState(self.link.client, window_seconds=window_seconds)

    @property
    def batcher(self) -> Batcher | ClusterRouter:
        """The auto-pipeline every script and the audit feed go through."""
        return self.link.batcher

    @property
    def cluster(self) -> bool:
        return self.link.cluster

    @property
    def retention_ms(self) -> int:
        return self.link.retention_ms
