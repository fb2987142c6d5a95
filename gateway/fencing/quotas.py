"""Per-tenant quotas: a guard around the fence's decision, not the fence.

:class:`Quotas` is the effect service's admission hook (:mod:`gateway.fencing.admission`),
built only when some cap is configured. Three caps per tenant (``[quotas]``, overridable per
tenant in ``[quotas.tenants.<name>]``), counted in per-tenant keys outside the deciding
scripts (which stay one slot per job; the quota keys live in the tenant's slot, so nothing
crosses a slot on Redis Cluster):

* **effects per window** — effect calls *admitted or queued* in a fixed window of
  ``window_seconds``: ``fg:quota:{<tenant>}:fx:<window>``. Charged after the verdict, so a
  replay, an "in progress" answer and a rejection never spend it. Before the decision the
  call is checked against what this process last saw of the counter (the reply of its own
  last charge; read from Redis once per tenant and window): used up, the script is told so
  (``closed``) and refuses only a call that would pin, queue or claim a step, which gets
  ``429`` with nothing stored or sent. A replay or "in progress" answer is never refused.
  Bound: the cap, plus per gateway process the calls it admits between the counter reaching
  the cap and its next charge reply (at most the admits it has in flight at once).
* **rejections per window** — calls the fence rejected (stale, lease expired, …):
  ``fg:quota:{<tenant>}:rj:<window>``, and the metric ``fencegate_quota_rejections`` (always,
  ``audited`` true/false). Past the cap a rejection is still answered as before (409/422,
  nothing written) but no longer audited one by one, so a zombie flood cannot grow the audit
  streams without bound: the feed gets a summary instead (``quota_exceeded``, ``quota =
  rejections_per_window``, at most one a second with the count it stands for, as below); it
  never spends or closes the effects quota. On by default (10,000 per tenant per hour).
* **stored payload bytes** — async payloads held in Redis for the relay, each charged its
  size plus 1 KiB, reserved before the decision and settled after it:
  ``fg:quota:{<tenant>}:held`` (``[job, step]`` -> charge) and its sum
  ``fg:quota:{<tenant>}:held_bytes``. A reservation over the cap does not refuse the call:
  the script is told, and refuses only a call that would queue a new payload (an async
  repeat of a queued step is answered). A payload leaves Redis when its outcome is recorded
  (by the relay, or a synchronous call that takes the step over); the gateway does not hook
  every such place: when a tenant reaches its cap, the held entries whose payload is gone
  are given back (at most once a second per tenant), then the reservation is tried again.
* **stored checkpoint bytes** — every checkpoint of the tenant's jobs, each charged its stored
  record (value, envelope, name) plus :data:`CHECKPOINT_OVERHEAD`: ``fg:quota:{<tenant>}:ckpt``
  (job -> the charge of its checkpoints) and its sum ``fg:quota:{<tenant>}:ckpt_bytes``.
  Charged by the checkpoint writes (:meth:`Quotas.reserve_checkpoint`, then
  :meth:`Quotas.settle_checkpoint`), with or without the effect hook. The write's upper
  bound is reserved before the script runs; over the cap (after one reconciliation) the
  script is told (``closed``) and takes only a write that does not grow what the job
  stores — a replacement of a stored name by one no larger — and refuses the rest, nothing
  written. ``checkpoint-3`` answers the exact charge of the checkpoint and of the one of that
  name it replaced; the settlement turns the reservation into that difference (the job's
  script and the tenant's counter are two slots on Cluster: reserve before, settle after,
  through the auto-pipeline, never one script). A job's checkpoints leave Redis only when
  they expire with the retention (nothing else removes them, a completion keeps them): at
  the cap, the entries of jobs whose checkpoints are gone are given back (as for payloads).
  Bound: the counter is charged before the write, so it never counts less than what is
  stored; it counts more for a write whose reply never came (kept at its full reservation
  until the job's checkpoints expire) and for a process that died between a reservation and
  its settlement (that reservation, at most one checkpoint per write in flight).

* **stored output bytes and objects** — every object of the tenant in the output store
  (:mod:`gateway.fencing.outputs`), staged, recorded or promoted, charged its size and one
  object (``quotas.output_bytes``, ``quotas.output_objects``), with or without the effect
  hook, by :class:`OutputLedger`: ``fg:quota:{<tenant>}:out`` (object key -> the bytes of
  the object stored there), ``fg:quota:{<tenant>}:out_up`` (``"<object key> <upload id>"``
  -> the bytes reserved for that upload while it runs) and their sum
  ``fg:quota:{<tenant>}:out_bytes``; the objects counted are the two hashes' fields (an
  upload replacing an object already charged adds none). The charge is keyed by the
  object's key, so an upload sent again under the same name and generation replaces its
  own charge instead of adding one. An upload reserves before the stage script runs (the
  ``Content-Length``; a chunked body ``OUTPUT_STEP`` at a time as its bytes arrive,
  refused mid-stream when over; a pre-signed URL ``outputs.max_bytes``, the bound of its
  signature) and settles after it: recorded, written but refused by the fence, or replaced
  by a later upload, the object's key holds its exact size (it is in the store); failed,
  short, cut or refused before a byte, the reservation is given back. The sweeper gives
  back what it deletes. A pre-signed upload settles when it is recorded (at completion);
  an oversized one is deleted and given back. No TTL: an object stays charged as long as
  it may be in the store. At the cap (after one reconciliation) the upload is refused,
  nothing stored. Reconciliation (at most once a second per tenant, when it reaches a cap)
  lists the tenant's objects once: a charged key no longer in the store is given back, a
  reservation whose upload is no longer running (its entry in the job's outputs hash names
  another upload, is recorded, or its deadline passed) is given back, and its object, if
  there, charged at its listed size. Bound: never less than what is stored through the
  gateway (each object is charged before its bytes are written and given back only after
  it is deleted); more by the reservation of a process killed mid-upload (its
  ``Content-Length`` or ``outputs.max_bytes`` at most, per upload it had running, until
  the upload's deadline passes and the tenant reaches a cap) and by one object per upload
  running over an object already stored.

The counters go through the store's auto-pipeline (:attr:`Store.batcher`): a charge is
queued with the reply's tick and not waited for. Over a cap: ``429 quota_exceeded`` with
``Retry-After`` (the window's end; for payloads, ``retry_after_seconds``), audited in the
tenant's audit feed (``reason = quota_exceeded``), at most one entry per tenant and cap per
second (a flood is summarised by a ``suppressed`` count in the next entry).
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass
from typing import Any

import structlog

from gateway.core.errors import QuotaExceeded, Rejection, StoreUnavailable, TooManyCheckpoints
from gateway.core.records import (
    Admitted,
    AdmitVerdict,
    InProgress,
    OverQuota,
    Queued,
    Replay,
    Unresolved,
)
from gateway.fencing.admission import OPEN, AdmitCall, Gate
from gateway.fencing.output_ledger import OutputLedger
from gateway.runtime.metrics import Metrics
from gateway.runtime.settings import QuotaSettings
from gateway.store.keys import JobKeys
from gateway.store.output_records import LedgerReply
from gateway.store.quota_counters import Pool, Window
from gateway.store.store import Store

__all__ = [
    "CHECKPOINT_OVERHEAD",
    "OUTPUT_STEP",
    "PAYLOAD_OVERHEAD",
    "Caps",
    "CheckpointHold",
    "Quotas",
]

log = structlog.get_logger("fencegate.quotas")

PAYLOAD_OVERHEAD = 1024  # the effect hash fields, the queue entry, the hint around a payload
CHECKPOINT_OVERHEAD = 256  # a hash field's own cost in Redis, beyond its name and value
OUTPUT_STEP = 1024 * 1024  # a chunked upload reserves this much more each time it passes


@dataclass(frozen=True, slots=True)
class Caps:
    """A tenant's caps; 0 is none."""

    effects: int
    rejections: int
    payload: int
    checkpoint: int
    output_bytes: int = 0
    output_objects: int = 0


@dataclass(frozen=True, slots=True)
class CheckpointHold:
    """A checkpoint write's reservation: ``charge`` reserved (0: none) as ``reservation`` (its
    id, which the settlement closes), ``closed``: the tenant's checkpoint bytes are used up
    (the script takes only a write that does not grow)."""

    charge: int = 0
    closed: bool = False
    reservation: str = ""


@dataclass(frozen=True, slots=True)
class PayloadHold:
    """An async payload's reservation, from :meth:`Quotas.before` to :meth:`Quotas.after`:
    ``charge`` bytes as ``reservation`` (its id, which the settlement closes)."""

    charge: int
    reservation: str


_NO_HOLD = CheckpointHold()


class Quotas:
    """The admission hook that charges a tenant's quotas (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        settings: QuotaSettings,
        metrics: Metrics,
        *,
        retention_seconds: int,
    ) -> None:
        self._counters = store.quota_counters(
            retention_seconds=retention_seconds,
            window_ttl_seconds=settings.window_seconds + 60,
        )
        self._settings = settings
        self._metrics = metrics
        # (tenant, 'fx' | 'rj') -> (window index, the counter as this process last saw it)
        self._seen: dict[tuple[str, Window], tuple[int, int]] = {}
        self._summaries: set[asyncio.Task[None]] = set()  # past-cap entries being written
        # (tenant, 'fx' | 'rj') -> the window whose counter this process sent the TTL of
        self._expiring: dict[tuple[str, Window], int] = {}
        self._reconciled: dict[tuple[str, Pool], float] = {}
        self._reconciling: dict[tuple[str, Pool], asyncio.Task[int]] = {}
        self._audited: dict[tuple[str, str], tuple[float, int]] = {}
        self._flags: dict[str, tuple[int, str]] = {}  # tenant -> (window, its rejections flag)
        # a tenant's caps and its rejections' metric children, per call otherwise (the
        # settings do not change while the process runs; bounded like the metric's labels)
        self.caps = functools.lru_cache(maxsize=4096)(self._caps)
        self._rejected = functools.lru_cache(maxsize=8192)(metrics.quota_rejections.labels)

    def _caps(self, tenant: str) -> Caps:
        own = self._settings.tenants.get(tenant)
        s = self._settings
        if own is None:
            return Caps(
                s.effects_per_window,
                s.rejections_per_window,
                s.payload_bytes,
                s.checkpoint_bytes,
                s.output_bytes,
                s.output_objects,
            )
        return Caps(
            s.effects_per_window if own.effects_per_window is None else own.effects_per_window,
            s.rejections_per_window
            if own.rejections_per_window is None
            else own.rejections_per_window,
            s.payload_bytes if own.payload_bytes is None else own.payload_bytes,
            s.checkpoint_bytes if own.checkpoint_bytes is None else own.checkpoint_bytes,
            s.output_bytes if own.output_bytes is None else own.output_bytes,
            s.output_objects if own.output_objects is None else own.output_objects,
        )

    # -- the admission hook ----------------------------------------------------

    async def before(self, call: AdmitCall) -> Gate:
        caps = self.caps(call.keys.tenant)
        if not (caps.effects or caps.rejections or (call.payload_bytes and caps.payload)):
            return OPEN  # nothing of this call is capped (a sync call under a payload cap only)
        index, _ = self._window()
        folds = self._counters.folds  # the admit charges payloads and effect calls itself
        closed = ""
        windows: tuple[tuple[Window, int, str], ...] = (  # what the scripts count, they close
            ("fx", 0 if folds else caps.effects, "e"),
            ("rj", 0 if folds else caps.rejections, "r"),
        )
        for kind, cap, letter in windows:
            if not cap:
                continue
            seen = self._seen.get((call.keys.tenant, kind))
            # this process's view (no round trip); read from Redis once per window
            count = (
                seen[1]
                if seen and seen[0] == index
                else await self._count(call.keys.tenant, kind, index)
            )
            if count >= cap:
                closed += letter
        payload = call.payload_bytes and caps.payload
        if folds and (payload or caps.effects):
            args = self._counters.admit_args(
                call.keys,
                call.step,
                payload=(call.payload_bytes + PAYLOAD_OVERHEAD, caps.payload) if payload else None,
                effects=(index, caps.effects) if caps.effects else None,
            )
            return Gate(closed, None, args)
        hold = None
        if payload and "e" not in closed:
            hold = await self._reserve_payload(call.keys.tenant, call.payload_bytes, caps.payload)
            if hold is None:
                closed += "p"
        return Gate(closed, hold) if closed or hold else OPEN

    async def make_room(self, call: AdmitCall) -> None:
        """The admit found the payload over the tenant's cap: one reconciliation (payloads the
        relay delivered are charged until one runs). The call is admitted once more whatever
        this run freed: another process's run may have given the same entries back first."""
        await self.reconcile(call.keys.tenant)

    async def after(
        self, call: AdmitCall, gate: Gate, outcome: AdmitVerdict | BaseException
    ) -> None:
        keys, tenant = call.keys, call.keys.tenant
        if isinstance(gate.hold, PayloadHold):  # reserved before the admit (a Cluster)
            stored = isinstance(outcome, Queued)
            if isinstance(outcome, StoreUnavailable):
                stored = bool(outcome.fields.get("may_have_been_queued"))
            await self._settle_payload(keys, call.step, gate.hold, stored)
        if isinstance(outcome, Replay | InProgress | Unresolved):
            return  # nothing was written for this call: never charged
        index, left = self._window()
        caps = self.caps(tenant)
        if isinstance(outcome, Admitted) or (isinstance(outcome, Queued) and not outcome.repeated):
            if caps.effects and not gate.charges:  # else the admit counted it
                self._charge(tenant, "fx", index)
        elif isinstance(outcome, Rejection):
            audited = bool(outcome.audit_id)
            self._rejected(tenant, "true" if audited else "false").inc()
            if caps.rejections:
                self._count_rejection(tenant, index, audited, caps.rejections)
            if not audited:  # past the cap: a summary entry (at most one a second)
                who = {"worker_id": call.worker_id, "adapter": call.adapter}
                await self.audit(keys, call.step, "rejections_per_window", **who)
        elif isinstance(outcome, OverQuota):
            who = {"worker_id": call.worker_id, "adapter": call.adapter}
            await self.audit(keys, call.step, outcome.quota, **who)
            if outcome.quota == "payload_bytes":
                raise QuotaExceeded(
                    f"tenant {tenant!r} has {caps.payload} bytes of async payloads stored for "
                    "the relay; they are freed as the relay delivers them",
                    retry_after=self._settings.retry_after_seconds,
                    quota="payload_bytes",
                    limit=caps.payload,
                )
            raise QuotaExceeded(
                f"tenant {tenant!r} used its {caps.effects} effect calls of this "
                f"{self._settings.window_seconds} s window",
                retry_after=left,
                quota="effects_per_window",
                limit=caps.effects,
            )

    # -- counters per window -----------------------------------------------------

    def _window(self) -> tuple[int, int]:
        """(this window's index, seconds until it ends)."""
        size = self._settings.window_seconds
        now = time.time()
        return int(now // size), max(1, int(size - now % size + 0.999))

    async def _count(self, tenant: str, kind: Window, index: int) -> int:
        """The counter in Redis: the view of a window this process has not charged yet."""
        count = await self._counters.count(tenant, kind, index)
        current = self._seen.get((tenant, kind))
        if current is None or current[0] != index or current[1] < count:
            self._seen[(tenant, kind)] = (index, count)
        return count

    def _count_rejection(self, tenant: str, index: int, audited: bool, cap: int) -> None:
        """An effect call's rejection: the admit counted it where the scripts count (a
        standalone Redis), else it is charged here."""
        if self._counters.folds:
            self._note_rejection(tenant, index, audited, cap)
        else:
            self._charge(tenant, "rj", index)

    def _note_rejection(self, tenant: str, index: int, audited: bool, cap: int) -> None:
        """A rejection its script counted: this process's view follows (one more; the cap
        when it was past it, so the next calls are flagged used up without a count)."""
        seen = self._seen.get((tenant, "rj"))
        mine = seen[1] if seen is not None and seen[0] == index else 0
        self._seen[(tenant, "rj")] = (index, mine + 1 if audited else max(mine, cap))

    def _charge(self, tenant: str, kind: Window, index: int) -> None:
        """Count one call: this process's view at once, Redis in the pipeline of this tick
        (not waited for; its reply raises the view to what every process charged)."""
        seen = self._seen.get((tenant, kind))
        mine = seen[1] if seen is not None and seen[0] == index else 0
        self._seen[(tenant, kind)] = (index, mine + 1)
        key = self._counters.window_key(tenant, kind, index)

        def counted(future: asyncio.Future[Any]) -> None:
            if future.cancelled():
                return
            if (exc := future.exception()) is not None:
                log.warning("quota_charge_failed", key=key, error=str(exc))
                return
            total = int(future.result())
            if total == 1 and self._expiring.get((tenant, kind)) == index:
                self._expire(tenant, kind, index)  # the key was created again (a flushed Redis)
            current = self._seen.get((tenant, kind))
            if current is not None and current[0] == index and current[1] < total:
                self._seen[(tenant, kind)] = (index, total)

        self._counters.charge(tenant, kind, index).add_done_callback(counted)
        if self._expiring.get((tenant, kind)) != index:
            self._expire(tenant, kind, index)

    def _expire(self, tenant: str, kind: Window, index: int) -> None:
        """The window counter's TTL, sent with the first charge of the window in this process
        (its name holds the window's index, so that TTL outlives every later charge of it);
        a failed one is sent again with the next charge."""
        self._expiring[(tenant, kind)] = index

        def expired(future: asyncio.Future[Any]) -> None:
            failed = future.cancelled() or future.exception() is not None
            if failed and self._expiring.get((tenant, kind)) == index:
                del self._expiring[(tenant, kind)]

        self._counters.expire(tenant, kind, index).add_done_callback(expired)

    # -- stored payload bytes -------------------------------------------------

    async def _reserve_payload(self, tenant: str, size: int, cap: int) -> PayloadHold | None:
        """Reserve a payload's charge; None when it does not fit (after one reconciliation)."""
        charge = size + PAYLOAD_OVERHEAD
        for attempt in (0, 1):
            if reservation := await self._counters.reserve(tenant, "held", charge, cap):
                return PayloadHold(charge, reservation)
            if attempt == 0 and not await self.reconcile(tenant):
                break
        return None

    async def _settle_payload(
        self, keys: JobKeys, step: str, hold: PayloadHold, stored: bool
    ) -> None:
        """Settle a reservation made before the admit, waited for: a newer generation's call,
        sent after this answer, settles after it."""
        try:
            await self._counters.settle_payload(
                keys, step, hold.charge, hold.reservation, stored=stored
            )
        except StoreUnavailable:  # the reservation stays open: the reconciliation
            log.warning("quota_settle_failed", job_id=keys.job_id, step=step)

    async def reconcile(self, tenant: str) -> int:
        """Give back the charges of held payloads that left Redis; returns bytes freed (at
        most once a second per tenant: a call within the second waits for the next run)."""
        return await self._reconcile(tenant, "held")

    async def _reconcile(self, tenant: str, pool: Pool) -> int:
        """Drop the entries of ``pool`` whose stored thing is gone
        (:meth:`QuotaCounters.drop_gone`): bytes freed (0 when Redis does not answer). At most
        once a second per tenant and pool: a call within the second waits for the next run,
        and every call waiting shares it (a tenant whose payloads were delivered meanwhile is
        not refused because the last run was too recent)."""
        key = (tenant, pool)
        run = self._reconciling.get(key)
        if run is None or run.done():
            gap = self._reconciled.get(key, -1.0) + 1.0 - time.monotonic()
            run = asyncio.get_running_loop().create_task(self._reconcile_after(key, gap))
            self._reconciling[key] = run
        return await asyncio.shield(run)

    async def _reconcile_after(self, key: tuple[str, Pool], gap: float) -> int:
        if gap > 0:
            await asyncio.sleep(gap)
        self._reconciled[key] = time.monotonic()
        try:
            return await self._counters.drop_gone(*key)
        except StoreUnavailable:
            log.warning("quota_reconcile_failed", tenant=key[0], kind=key[1])
            return 0

    # -- stored checkpoint bytes ----------------------------------------------

    async def reserve_checkpoint(self, tenant: str, bound: int) -> CheckpointHold:
        """Reserve a checkpoint write's upper bound (its stored bytes at most, without the
        overhead); closed when it does not fit (after one reconciliation)."""
        cap = self.caps(tenant).checkpoint
        if not cap:
            return _NO_HOLD
        charge = bound + CHECKPOINT_OVERHEAD
        for attempt in (0, 1):
            if reservation := await self._counters.reserve(tenant, "ckpt", charge, cap):
                return CheckpointHold(charge, reservation=reservation)
            if attempt == 0 and not await self.reconcile_checkpoints(tenant):
                break
        return CheckpointHold(closed=True)

    def settle_checkpoint(self, keys: JobKeys, hold: CheckpointHold, stored: int) -> None:
        """The write stored ``stored`` bytes more (its charge minus the one it replaced; 0:
        nothing written; the reservation for a write whose reply never came). Queued in this
        tick's pipeline, not waited for: it lowers the counter (raises it only when the
        reconciliation gave the reservation back as abandoned before the write's end)."""
        if not hold.charge and not hold.closed:
            return  # the tenant has no checkpoint cap: nothing is counted
        future = self._counters.settle_checkpoint(keys, hold.charge, stored, hold.reservation)

        def settled(future: asyncio.Future[Any]) -> None:
            if not future.cancelled() and future.exception() is not None:
                log.warning("quota_settle_failed", job_id=keys.job_id, kind="checkpoint")

        future.add_done_callback(settled)

    async def reconcile_checkpoints(self, tenant: str) -> int:
        """Give back the charges of jobs whose checkpoints expired; returns bytes freed (at
        most once a second per tenant: a call within the second waits for the next run)."""
        return await self._reconcile(tenant, "ckpt")

    async def checkpoint_refused(
        self, keys: JobKeys, name: str, quota: str, *, worker_id: str, limit: int
    ) -> QuotaExceeded | TooManyCheckpoints:
        """Audit a refused checkpoint write; the problem to raise (``limit``: the job's
        checkpoint names, for ``checkpoints_per_job``)."""
        await self.audit(keys, f"checkpoint:{name}", quota, worker_id=worker_id)
        if quota == "checkpoints_per_job":
            return TooManyCheckpoints(
                f"job {keys.job_id!r} holds {limit} checkpoints (checkpoints.max_per_job); "
                "write one of them again instead of a new name",
                limit=limit,
            )
        cap = self.caps(keys.tenant).checkpoint
        return QuotaExceeded(
            f"tenant {keys.tenant!r} has {cap} bytes of checkpoints stored; they are freed "
            "when their jobs' checkpoints expire (fencing.retention_seconds after a job's "
            "last checkpoint). A checkpoint written again no larger is still taken",
            retry_after=self._settings.retry_after_seconds,
            quota="checkpoint_bytes",
            limit=cap,
        )

    # -- stored outputs ----------------------------------------------------------

    async def reserve_output(
        self,
        ledger: OutputLedger,
        keys: JobKeys,
        name: str,
        key: str,
        upload: str,
        amount: int,
        *,
        at_least: int | None = None,
        replaces: str = "",
        worker_id: str,
    ) -> int:
        """Reserve ``amount`` more bytes for ``upload`` of the object ``key`` (its first
        reservation also counts the object), else ``at_least`` if that fits; returns what
        was reserved. Over a cap (after one reconciliation) the refusal is audited and
        raised: ``429 quota_exceeded``, nothing reserved. ``replaces``: see
        :meth:`OutputLedger.reserve`."""
        caps = self.caps(keys.tenant)
        tries = [amount] if at_least is None or at_least >= amount else [amount, at_least]
        code = 0
        for attempt in (0, 1):
            for size in tries:
                code = await ledger.reserve(
                    keys.tenant,
                    key,
                    upload,
                    size,
                    caps.output_bytes,
                    caps.output_objects,
                    replaces=replaces,
                )
                if code not in (LedgerReply.OVER_BYTES, LedgerReply.OVER_OBJECTS):
                    return size
                if code == LedgerReply.OVER_OBJECTS:
                    break  # no smaller amount counts fewer objects
            if attempt == 0 and not await ledger.reconcile(keys.tenant):
                break
        quota = "output_bytes" if code == LedgerReply.OVER_BYTES else "output_objects"
        await self.audit(keys, f"output:{name}", quota, worker_id=worker_id)
        if quota == "output_bytes":
            detail = f"{caps.output_bytes} bytes of outputs (quotas.output_bytes)"
            limit = caps.output_bytes
        else:
            detail = f"{caps.output_objects} outputs (quotas.output_objects)"
            limit = caps.output_objects
        raise QuotaExceeded(
            f"tenant {keys.tenant!r} has {detail} in the output store; they are freed when "
            "their objects are deleted (the sweeper, the retention). Nothing was stored",
            retry_after=self._settings.retry_after_seconds,
            quota=quota,
            limit=limit,
        )

    # -- audit -----------------------------------------------------------------

    # -- the rejections budget of the other fenced scripts (gateway.store.budget) --------

    def closed(self, tenant: str) -> bool:
        """Whether the tenant's audited rejections of this window are used up, from the reply
        of this process's last charge (no round trip: a window this process has not charged
        yet counts as open; its first charge's reply closes it)."""
        cap = self.caps(tenant).rejections
        if not cap:
            return False
        index, _ = self._window()
        seen = self._seen.get((tenant, "rj"))
        return bool(seen and seen[0] == index and seen[1] >= cap)

    def counter(self, tenant: str) -> str:
        """The tenant's rejections window for the fenced scripts to count themselves (a
        standalone Redis), or '' (no cap; a Cluster: :meth:`spent` and :meth:`after` count)."""
        cap = self.caps(tenant).rejections
        if not cap or not self._counters.folds:
            return ""
        index = self._window()[0]
        flag = self._flags.get(tenant)
        if flag is None or flag[0] != index:
            flag = self._flags[tenant] = (index, self._counters.rejections_flag(tenant, index, cap))
        return flag[1]

    def spent(
        self, keys: JobKeys, step: str, *, audited: bool, worker_id: str, counted: bool
    ) -> None:
        """Count one rejection of a heartbeat, checkpoint, completion, output stage or bad
        token (the effect calls are counted by :meth:`after`), unless its script ``counted``
        it; past the cap, the summary."""
        tenant = keys.tenant
        self._rejected(tenant, "true" if audited else "false").inc()
        cap = self.caps(tenant).rejections
        if cap:
            index = self._window()[0]
            if counted:
                self._note_rejection(tenant, index, audited, cap)
            else:
                self._charge(tenant, "rj", index)
        if not audited:
            task = asyncio.get_running_loop().create_task(
                self.audit(keys, step, "rejections_per_window", worker_id=worker_id)
            )
            self._summaries.add(task)
            task.add_done_callback(self._summaries.discard)

    async def audit(self, keys: JobKeys, step: str, quota: str, **who: str) -> None:
        """One entry per tenant and quota per second in the tenant's audit feed."""
        now = time.monotonic()
        last, suppressed = self._audited.get((keys.tenant, quota), (0.0, 0))
        if now - last < 1.0:
            self._audited[(keys.tenant, quota)] = (last, suppressed + 1)
            return
        self._audited[(keys.tenant, quota)] = (now, 0)
        at = int(time.time() * 1000)
        fields: dict[Any, Any] = {
            "at": str(at),
            "tenant": keys.tenant,
            "job_id": keys.job_id,
            "job_audit_id": "",
            "step": step,
            "reason": "quota_exceeded",
            "presented": "",
            "current": "",
            "worker_id": who.get("worker_id", ""),
            "adapter": who.get("adapter", ""),
            "quota": quota,
            "suppressed": str(suppressed),
        }
        try:
            await self._counters.note(keys.tenant, fields, at_ms=at)
        except StoreUnavailable:
            log.warning("quota_audit_failed", tenant=keys.tenant)
        log.warning(
            "quota_exceeded", tenant=keys.tenant, quota=quota, suppressed_since_last=suppressed
        )
