"""The only module that talks to Redis: runs the Lua scripts and turns their replies into verdicts.

Every decision (register, admit, record, heartbeat, cancel, reject, resolve,
relay claim) is one script, one round trip. Each method below turns its
script's reply into a typed verdict (:mod:`gateway.records`); every rejection
becomes its typed error in one place, :meth:`Store._rejected`. The durability
checks around the store (markers, epochs, the audit chain) are in
:mod:`gateway.durability`.

Durability (SPEC §7): every deciding script first checks the durability marker
of its job's slot (written for all 16384 slots by ``fencegate init``, see
:mod:`gateway.keys`). A Redis that restarted empty, was flushed, or lost a slot
answers ``{8}`` and the call fails closed with
:class:`~gateway.errors.StoreUnavailable` — atomically, in the same round trip
as the decision — until an operator runs ``fencegate init --confirm-data-loss``.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import redis.asyncio as aioredis
import structlog
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway import durability, statefile
from gateway.audit_anchor import note_audit
from gateway.batching import Batcher, NotSent
from gateway.errors import (
    BadToken,
    EffectNotUnknown,
    FencegateError,
    GenerationExhausted,
    GenerationRegression,
    IntentMismatch,
    JobCancelled,
    LeaseExpired,
    NotFound,
    StaleGeneration,
    StoreUnavailable,
    UnregisteredGeneration,
)
from gateway.keys import (
    MARKER,
    RELAY_TENANTS,
    SLOTS,
    JobKeys,
    audit_feed,
    relay_hint,
    relay_queue,
)
from gateway.records import (
    Admitted,
    AdmitVerdict,
    AuditCheck,
    AuditEntry,
    EffectRecord,
    EffectState,
    InProgress,
    JobView,
    Queued,
    Registration,
    RelayClaim,
    Replay,
    Unknown,
)
from gateway.replication import AckPolicy, NotReplicated
from gateway.tokens import MAX_GENERATION

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

T = TypeVar("T")
READY_PROBE = "fg:readyz:probe"  # /readyz's probe write (10 s TTL)
log = structlog.get_logger("fencegate.store")

SCRIPT_NAMES = (
    "admit-5",
    "record-2",
    "register-2",
    "heartbeat-2",
    "cancel-1",
    "reject-2",
    "resolve-4",
    "relay-4",
    "void-3",
)
# Redis error prefixes that mean "this Redis cannot serve us now", not a bug.
_UNAVAILABLE_PREFIXES = ("OOM", "MISCONF", "READONLY", "LOADING", "NOREPLICAS", "MASTERDOWN")


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
}


def _lua_source(name: str) -> str:
    """The prelude (the trailer, re-send memory, the slot counter, the audit chain), then the
    script's body as a function the prelude runs."""
    lua = resources.files("gateway") / "lua"
    prelude = (lua / "_prelude.lua").read_text(encoding="utf-8")
    body = (lua / f"{name}.lua").read_text(encoding="utf-8")
    return f"{prelude}\nreturn run_script(function()\n{body}\nend)\n"


_FEED_FIELDS = ("step", "reason", "presented", "current", "worker_id", "adapter")

_REDIS_FAILURES = (RedisConnectionError, RedisTimeoutError, OSError, ResponseError)


def _oom(exc: Exception) -> bool:
    return isinstance(exc, OutOfMemoryError) or (
        isinstance(exc, ResponseError) and "-OOM " in str(exc)
    )


def _unavailable(exc: Exception) -> StoreUnavailable | None:
    """The ``StoreUnavailable`` a Redis failure means; None for an error reply that is a bug.

    redis-py strips the code of some error replies (``-OOM …`` becomes an
    ``OutOfMemoryError`` whose text starts "command not allowed"), and an error inside a
    script comes back as "Error running script … -OOM command not allowed …": all three
    forms are Redis refusing to serve, not a bug (503, never 500)."""
    if isinstance(exc, ResponseError):
        text = str(exc)
        if (
            isinstance(exc, OutOfMemoryError | ReadOnlyError)
            or text.startswith(_UNAVAILABLE_PREFIXES)
            or any(f"-{prefix} " in text for prefix in _UNAVAILABLE_PREFIXES)
        ):
            if _oom(exc) or text.startswith("OOM"):
                return StoreUnavailable("Redis is out of memory (maxmemory): nothing was done")
            return StoreUnavailable(f"Redis refused the command: {exc}")
        return None
    if isinstance(exc, NotReplicated):  # the script ran; its reply must not leave (replicas)
        unacked = StoreUnavailable(str(exc))
        unacked.unacknowledged = True
        return unacked
    return StoreUnavailable(f"Redis is unreachable: {type(exc).__name__}")


# Dispatch ids only have to be unique (they never leave the gateway: the admit hands one
# out, the record must present it): a random 64-bit prefix per process and a counter,
# instead of a getrandom() system call per admit.
_DISPATCH_PREFIX = secrets.token_hex(8)
_dispatch_counter = itertools.count()


def _dispatch_id() -> str:
    return f"{_DISPATCH_PREFIX}{next(_dispatch_counter):x}"


new_request_id = _dispatch_id


MARKER_MISSING = (
    "Redis has lost fencegate's data (the durability marker of this job's slot is "
    "missing): fences may be gone, so nothing is dispatched. An operator must run "
    "`fencegate init --confirm-data-loss` and re-register current generations."
)
UNINITIALISED = (
    "this Redis has no fencegate durability marker and the gateway does not initialise an "
    "external Redis on its own: if it is new, run `fencegate init --config <this config>` once "
    "(it refuses when this Redis or data dir held fencegate data before); if it was wiped or "
    "replaced, fences may be gone: `fencegate init --confirm-data-loss`, then re-register "
    "current generations. Nothing is dispatched until then."
)


def _optional_int(raw: str) -> int | None:
    return int(raw) if raw else None


class Store:
    """Fences, effects and audit entries in Redis; every decision is one Lua script."""

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
        self._client = client
        self._request_ttl = str(int(request_memory_seconds * 1000))
        self._audit_key = audit_key
        # Jobs whose audit chain got an entry in a reply seen here, with the newest such
        # entry's id: the anchorer's to-do (gateway.audit_anchor).
        self.audit_touched: dict[JobKeys, str] = {}
        # The highest value of each slot's marker seen in a reply (slot -> counter). A reply
        # below it means the slot went back in time: the script refuses ({8, 'behind'}).
        self.slot_seen: dict[int, int] = {}
        self._persisted: dict[int, int] = {}  # the marks the state file held at the last write
        # the detail of a 503 for a missing slot marker (a Redis never initialised: UNINITIALISED)
        self.marker_missing_detail = MARKER_MISSING
        self._registration = registration
        self._dispatch_timeout_ms = str(dispatch_timeout_ms)
        self._retention = str(retention_seconds)
        self._retention_ms = retention_seconds * 1000
        self._state_file = state_file
        self._sources = {name: _lua_source(name) for name in SCRIPT_NAMES}
        self._shas = {
            name: hashlib.sha1(src.encode(), usedforsecurity=False).hexdigest()
            for name, src in self._sources.items()
        }
        self._batcher = Batcher(client, ack)
        # the problems of the last replication topology check (gateway.topology); None: not
        # checked (replicas_acked 0)
        self.topology_problems: list[str] | None = None

    async def aclose(self) -> None:
        """Finish the pipelined batches in flight and close their connections."""
        await self._batcher.aclose()

    @property
    def batcher(self) -> Batcher:
        """The auto-pipeline every script and the audit feed go through."""
        return self._batcher

    @property
    def client(self) -> aioredis.Redis:
        return self._client

    # -- plumbing ------------------------------------------------------------

    async def _guard(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run a Redis call; availability failures become ``StoreUnavailable``."""
        try:
            return await call()
        except _REDIS_FAILURES as exc:
            if (unavailable := _unavailable(exc)) is None:
                raise
            raise unavailable from exc

    async def load_scripts(self) -> None:
        """Load every script (a syntax error fails here, at boot)."""

        async def load() -> None:
            for name, source in self._sources.items():
                sha = await self._client.script_load(source)
                if sha != self._shas[name]:  # pragma: no cover - Redis and hashlib disagree
                    raise RuntimeError("script SHA mismatch")

        await self._guard(load)

    async def _run(
        self,
        name: str,
        job: JobKeys,
        keys: Sequence[str],
        args: Sequence[str],
        request_id: str | None = None,
    ) -> list[Any]:
        """One script, one round trip, pipelined with the others of this tick (EVALSHA; EVAL on
        NOSCRIPT, see :mod:`gateway.batching`).

        Every call carries the prelude's trailer: a request id (a re-send of the same call
        gets the remembered reply and changes nothing), the job slot's marker and the highest
        value of it seen. The reply comes back without the slot counter it is prefixed with.
        """
        rid = request_id or _dispatch_id()
        slot = job.slot
        seen = self.slot_seen.get(slot, 0)
        try:  # awaited here, not through _guard: one coroutine frame less on the hot path
            reply: list[Any] = await self._batcher.evalsha(
                self._shas[name],
                self._sources[name],
                (*keys, job.req(rid), job.marker),
                (*args, rid, self._request_ttl, str(seen), self._audit_key),
            )
        except _REDIS_FAILURES as exc:
            if (unavailable := _unavailable(exc)) is None:
                raise
            # Redis refuses a script for OOM only before its first write (the check runs
            # while nothing is written, so the script stays atomic): then it did nothing
            unavailable.maybe_applied = not (isinstance(exc, NotSent) or _oom(exc))
            raise unavailable from exc
        seq = int(reply[0])
        if seq > seen:
            self.slot_seen[slot] = seq
        if reply[1] == 8:
            if len(reply) > 2:
                log.error(
                    "redis_slot_went_back",
                    slot=slot,
                    counter=seq,
                    seen=int(reply[3]),
                    detail="writes this gateway saw acknowledged are gone (a restored backup, "
                    "a lost tail of writes, a failover to a lagging replica): nothing is "
                    "dispatched in this slot until `fencegate init --confirm-data-loss`",
                )
                raise StoreUnavailable(
                    "Redis has lost writes fencegate saw acknowledged (this job's slot went "
                    "back in time): fences may be gone, so nothing is dispatched. An operator "
                    "must run `fencegate init --confirm-data-loss` and re-register current "
                    "generations."
                )
            raise StoreUnavailable(self.marker_missing_detail)
        del reply[0]
        return reply

    # -- durability marker ---------------------------------------------------

    async def initialize(
        self, *, auto: bool, confirm_data_loss: bool = False, write: bool = True
    ) -> str:
        """Write the durability markers when it is safe (see :mod:`gateway.durability`); first
        take in the slot marks of the state file (a restart keeps its high-water marks)."""
        self.load_marks()
        result = await self._guard(
            lambda: durability.initialize(
                self._client,
                self._state_file,
                auto=auto,
                confirm_data_loss=confirm_data_loss,
                write=write,
                seen=self.slot_seen,
            )
        )
        self.marker_missing_detail = UNINITIALISED if result == "uninitialised" else MARKER_MISSING
        return result

    def load_marks(self) -> None:
        """Merge the state file's slot marks into :attr:`slot_seen` (per slot the maximum)."""
        for slot, mark in durability.read_marks(self._state_file).items():
            if mark > self.slot_seen.get(slot, 0):
                self.slot_seen[slot] = mark

    async def persist_marks(self) -> bool:
        """Write the slot marks that rose since the last write to the state file (merged with
        the other processes' under the file's lock; the file I/O runs in a thread). Returns
        whether it wrote. The marks of other processes are read by :meth:`heartbeat_epoch`."""
        if self._state_file is None:
            return False
        snapshot = dict(self.slot_seen)
        if snapshot == self._persisted:
            return False
        done = self._persisted
        rose = {slot: mark for slot, mark in snapshot.items() if done.get(slot) != mark}
        await asyncio.to_thread(statefile.update, self._state_file, slots=rose)
        self._persisted = snapshot
        return True

    async def heartbeat_epoch(self) -> bool:
        """Periodic check (the app runs it every ``redis.epoch_interval_seconds``): the slot
        marks against Redis's markers, then the epoch."""
        if await self._guard(lambda: self._client.get(MARKER)) is None:
            return False
        self.marker_missing_detail = MARKER_MISSING  # initialised (by `fencegate init`) since
        if not await self._guard(
            lambda: durability.marks_check(self._client, self._state_file, self.slot_seen)
        ):
            return False
        return await self._guard(lambda: durability.epoch_check(self._client, self._state_file))

    async def ready(self) -> dict[str, bool]:
        """Readiness: Redis answers, scripts loaded, durability marker present, and Redis takes
        a write (a probe key with a TTL: not ready while Redis is out of memory)."""
        checks = {"redis": False, "scripts": False, "marker": False, "writable": False}
        acking = self._batcher.ack is not None
        if acking:  # replicas_acked: the probe write must be acknowledged by the replicas too
            checks["replicas_acked"] = False
            checks["topology"] = self.topology_problems == []
        try:
            await self._guard(self._client.ping)
            checks["redis"] = True
            exists = await self._guard(lambda: self._client.script_exists(*self._shas.values()))
            if not all(exists):  # cache flushed or Redis restarted: load them again
                await self.load_scripts()
            checks["scripts"] = True
            checks["marker"] = bool(await self._guard(lambda: self._client.exists(MARKER)))
            # a probe write: Redis out of memory (maxmemory, noeviction) refuses every call.
            # Only next to the marker: a wiped Redis must stay empty (no "fencegate data").
            if checks["marker"]:
                await self._guard(lambda: self._client.set(READY_PROBE, "1", px=10_000))
                checks["writable"] = True
                if acking:  # through the auto-pipeline: its tail is what the verdicts wait for
                    probe = ("SET", READY_PROBE, "1", "PX", "10000")
                    await self._guard(lambda: self._batcher.execute(*probe))
                    checks["replicas_acked"] = True
        except (StoreUnavailable, RedisError):
            pass
        return checks

    # -- decisions -----------------------------------------------------------

    async def _to_feed(self, keys: JobKeys, audit_id: str, **fields: str) -> None:
        """Copy a job's audit entry into the tenant-wide feed (trimmed by age).

        Best effort: the entry is already in the job's stream, written atomically
        with the decision, so a failed copy must not turn a true 409 into a 503.
        """
        note_audit(self.audit_touched, keys, audit_id)
        entry = {
            "at": audit_id.split("-")[0],
            "tenant": keys.tenant,
            "job_id": keys.job_id,
            "job_audit_id": audit_id,
            **fields,
        }
        min_id = f"{int(time.time() * 1000) - self._retention_ms}-0"
        xadd = ("XADD", audit_feed(keys.tenant), "MINID", "~", min_id, "*")
        try:  # pipelined with this tick's scripts
            await self._guard(
                lambda: self._batcher.execute(
                    *xadd, *(x for kv in entry.items() for x in kv), resend=False
                )
            )
        except StoreUnavailable:
            log.warning("audit_feed_copy_failed", job_id=keys.job_id, audit_id=audit_id)

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
        self, keys: JobKeys, generation: int | None, lease_ms: int | None
    ) -> Registration:
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
            ),
        )
        if int(reply[0]) == 9:
            raise await self._rejected(keys, reply)
        lease = int(reply[2])
        return Registration(int(reply[1]), lease or None, created=int(reply[0]) == 0)

    async def heartbeat(
        self, keys: JobKeys, generation: int, worker_id: str
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
            ),
        )
        if int(reply[0]) == 9:
            raise await self._rejected(keys, reply, worker_id=worker_id)
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
        self, keys: JobKeys, step: str, *, delivered: bool, result: Any, operator: str
    ) -> EffectRecord:
        """Record an operator's finding for an ``unknown`` step (audited)."""
        reply = await self._run(
            "resolve-4",
            keys,
            (keys.effect(step), keys.job, keys.audit, keys.relayq),
            (
                "delivered" if delivered else "not_delivered",
                "" if result is None else json.dumps(result, separators=(",", ":")),
                keys.job_id,
                step,
                keys.tenant,
                self._retention,
                operator,
                keys.member(step),
            ),
        )
        code = int(reply[0])
        if code == 1:
            raise NotFound(f"no effect recorded for {keys.job_id}:{step}")
        if code == 2:
            raise EffectNotUnknown(
                f"the step is {reply[1]}: only an unknown outcome can be resolved", state=reply[1]
            )
        outcome = "delivered" if delivered else "not_delivered"
        await self._to_feed(
            keys,
            str(reply[2]),
            step=step,
            reason=f"operator_resolved_{outcome}",
            worker_id=operator,
        )
        record = await self.effect(keys, step)
        assert record is not None
        return record

    async def cancel(self, keys: JobKeys) -> tuple[int, bool]:
        """Cancel the job; returns (fence, was_already_cancelled)."""
        reply = await self._run("cancel-1", keys, (keys.job,), ())
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
    ) -> AdmitVerdict:
        """Admit a call; with ``payload_json`` (async) the intent is queued for the relay.

        ``dispatch_id`` is also the call's request id: sent again with the same one (its
        reply was lost), the admit answers what it answered the first time.
        """
        dispatch_id = dispatch_id or _dispatch_id()
        reply = await self._run(
            "admit-5",
            keys,
            (keys.job, keys.effect(step), keys.audit, keys.steps, keys.relayq),
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
            ),
            request_id=dispatch_id,
        )
        code = int(reply[0])
        if code == 0:
            if reply[5]:
                await self._copy_to_feed(keys, str(reply[5]))
            return Admitted(str(reply[1]), int(reply[2]), int(reply[3]), reply[4] == "1")
        if code == 1:
            return Replay(EffectRecord.from_flat(reply[1:]))
        if code == 2:
            return InProgress(int(reply[1]))
        if code == 3:
            return Unknown(EffectRecord.from_flat(reply[1:]))
        if code == 4:
            if reply[1]:
                await self._copy_to_feed(keys, str(reply[1]))
            return Queued("pending", generation)
        if code == 5:
            record = EffectRecord.from_flat(reply[1:])
            return Queued(record.state, record.generation)
        if code == 10:
            raise StoreUnavailable("this call was given up before Redis ran it; nothing was done")
        raise await self._rejected(keys, reply, step=step, worker_id=worker_id, adapter=adapter)

    async def void(self, keys: JobKeys, step: str, dispatch_id: str) -> str:
        """Give up an admit (or relay claim) whose reply never came: 'voided' (it had not run and
        never will), 'released' / 'unknown' (it had run; the step is as before it), or what
        was there instead ('queued', 'answered', a state): nothing to undo."""
        reply = await self._run(
            "void-3",
            keys,
            (keys.effect(step), keys.relayq, keys.req(dispatch_id)),
            (dispatch_id, self._retention),
        )
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
            "record-2",
            keys,
            (keys.effect(step), keys.relayq),
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
        return True, (int(reply[1]) if reply[1] else None)

    async def _copy_to_feed(self, keys: JobKeys, audit_id: str) -> None:
        """Copy an entry a script wrote as a side note (not a rejection it answers) to the feed."""
        note_audit(self.audit_touched, keys, audit_id)

        async def read() -> list[tuple[str, dict[str, str]]]:
            rows = await self._client.xrange(keys.audit, audit_id, audit_id)
            return rows  # type: ignore[return-value]  # decode_responses=True: str

        try:
            rows = await self._guard(read)
        except StoreUnavailable:
            log.warning("audit_feed_copy_failed", job_id=keys.job_id, audit_id=audit_id)
            return
        for _, fields in rows:
            copy = {k: v for k, v in fields.items() if k in _FEED_FIELDS}
            await self._to_feed(keys, audit_id, **copy)

    # -- the async relay's queue --------------------------------------------
    #
    # The truth is the queue of each slot (fg:rq:{s}), written by the scripts atomically with
    # the step. The relay reads per-tenant hints, written after the admit; a hint lost in a
    # crash is found again by sweep(), which reads every slot's queue.

    async def relay_hint(self, keys: JobKeys, step: str, due_ms: int) -> None:
        """Point the relay at a queued step (best effort: the sweep finds a lost one)."""
        member = keys.member(step)
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.zadd(relay_hint(keys.tenant), {member: due_ms})
                pipe.sadd(RELAY_TENANTS, keys.tenant)
                await self._guard(pipe.execute)
        except StoreUnavailable:
            log.warning("relay_hint_failed", job_id=keys.job_id, step=step)

    async def relay_unhint(self, keys: JobKeys, step: str) -> None:
        try:
            await self._guard(lambda: self._client.zrem(relay_hint(keys.tenant), keys.member(step)))
        except StoreUnavailable:
            log.warning("relay_unhint_failed", job_id=keys.job_id, step=step)

    async def relay_due(self, now_ms: int, per_tenant: int) -> list[tuple[JobKeys, str, int]]:
        """Due hints, fair across tenants: up to ``per_tenant`` of each, interleaved."""

        async def read() -> list[list[tuple[str, float]]]:
            tenants: list[str] = sorted(await self._client.smembers(RELAY_TENANTS))  # type: ignore[arg-type]
            if not tenants:
                return []
            async with self._client.pipeline(transaction=False) as pipe:
                for tenant in tenants:
                    pipe.zrangebyscore(
                        relay_hint(tenant), "-inf", now_ms, start=0, num=per_tenant,
                        withscores=True,
                    )  # fmt: skip
                return await pipe.execute()

        per = await self._guard(read)
        due: list[tuple[JobKeys, str, int]] = []
        for i in range(max((len(rows) for rows in per), default=0)):
            for rows in per:
                if i < len(rows):
                    member, score = rows[i]
                    tenant, job_id, step = json.loads(member)
                    due.append((JobKeys(tenant, job_id), step, int(score)))
        return due

    async def sweep(self, now_ms: int, per_slot: int = 100) -> int:
        """Hint every due entry of every slot's queue (a hint lost in a crash); returns how
        many due entries were found. 16,384 reads, packed by hiredis on the auto-pipeline."""
        query = ("-inf", now_ms, "WITHSCORES", "LIMIT", 0, per_slot)
        replies: list[Any] = []
        for start in range(0, SLOTS, 1024):  # a few batches at a time, not 64 connections at once
            replies += await asyncio.gather(
                *(
                    self._batcher.execute("ZRANGEBYSCORE", relay_queue(s), *query)
                    for s in range(start, start + 1024)
                ),
                return_exceptions=True,
            )
        found = 0
        for rows in replies:
            if isinstance(rows, BaseException):
                if isinstance(rows, asyncio.CancelledError):
                    raise rows
                raise StoreUnavailable(f"the relay's sweep failed: {type(rows).__name__}")
            # RESP3 answers [member, score] pairs; RESP2 a flat list
            flat = not rows or not isinstance(rows[0], list)
            pairs = zip(rows[::2], rows[1::2], strict=True) if flat else rows
            for member, score in pairs:
                tenant, job_id, step = json.loads(member)
                await self.relay_hint(JobKeys(tenant, job_id), step, int(float(score)))
                found += 1
        return found

    async def relay_claim(
        self, keys: JobKeys, step: str, dispatch_id: str | None = None
    ) -> RelayClaim | int | str:
        """Claim a queued step: the claim; a deadline (ms) to look again at; or why there is
        nothing to send (the step has left the queue)."""
        dispatch_id = dispatch_id or _dispatch_id()
        reply = await self._run(
            "relay-4",
            keys,
            (keys.effect(step), keys.job, keys.audit, keys.relayq),
            (
                dispatch_id,
                self._dispatch_timeout_ms,
                self._retention,
                keys.member(step),
                keys.job_id,
                step,
                keys.tenant,
            ),
            request_id=dispatch_id,
        )
        code = int(reply[0])
        if code == 0:
            _, dispatch_id, gen, adapter, operation, payload, deadline = reply
            return RelayClaim(
                dispatch_id, int(gen), adapter, operation, json.loads(payload), int(deadline)
            )
        if code == 2:
            return int(reply[1])
        if reply[2]:
            await self._copy_to_feed(keys, str(reply[2]))
        return str(reply[1])

    # -- views ---------------------------------------------------------------

    async def effect(self, keys: JobKeys, step: str) -> EffectRecord | None:
        h: dict[str, str] = await self._guard(lambda: self._client.hgetall(keys.effect(step)))  # type: ignore[arg-type,return-value]
        return EffectRecord.from_hash(h) if h else None

    async def job(self, keys: JobKeys) -> JobView | None:
        async def read() -> tuple[dict[str, str], dict[str, EffectRecord]]:
            # decode_responses=True: every key and value is a str
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.hgetall(keys.job)
                pipe.smembers(keys.steps)
                job, steps = await pipe.execute()
            effects: dict[str, EffectRecord] = {}
            if steps:
                ordered = sorted(steps)
                async with self._client.pipeline(transaction=False) as pipe:
                    for step in ordered:
                        pipe.hgetall(keys.effect(step))
                    hashes = await pipe.execute()
                effects = {
                    s: EffectRecord.from_hash(h) for s, h in zip(ordered, hashes, strict=True) if h
                }
            return job, effects

        job, effects = await self._guard(read)
        if not job and not effects:
            return None
        lease_exp = int(job.get("lease_exp") or 0)
        return JobView(
            fence=int(job.get("fence") or 0),
            lease_ms=_optional_int(job.get("lease_ms", "")),
            lease_expires_at_ms=lease_exp or None,
            cancelled=job.get("cancelled") == "1",
            effects=effects,
        )

    async def verify_audit(self, **options: Any) -> AuditCheck:
        """Recompute every job's audit hash chain and check anchors (``fencegate audit verify``;
        ``options``: those of :func:`gateway.durability.verify_audit`)."""
        return await self._guard(lambda: durability.verify_audit(self._client, **options))

    async def audit(
        self, tenant: str, *, job_id: str | None, limit: int, cursor: str | None
    ) -> tuple[list[AuditEntry], str | None]:
        """Rejections newest first; returns (entries, next cursor)."""
        key = JobKeys(tenant, job_id).audit if job_id else audit_feed(tenant)
        end = f"({cursor}" if cursor else "+"

        async def read() -> list[tuple[str, dict[str, str]]]:
            rows = await self._client.xrevrange(key, max=end, min="-", count=limit + 1)
            return rows  # type: ignore[return-value]  # decode_responses=True: str

        rows = await self._guard(read)
        entries = [AuditEntry.from_fields(i, f) for i, f in rows[:limit]]
        next_cursor = entries[-1].id if len(rows) > limit else None
        return entries, next_cursor


def connect(url: str, *, timeout: float, max_connections: int) -> aioredis.Redis:
    """A redis-py client with one shared pool.

    Only connection errors are retried (twice, quickly): a command that timed
    out may have run, so it is never re-sent blindly; admit and record are safe
    to re-run with the same dispatch id when a reset connection lost the reply.
    """
    retry = Retry(ExponentialBackoff(cap=0.2, base=0.01), 2, (RedisConnectionError,))
    # A blocking pool: under a burst, requests wait (up to `timeout`) for a
    # connection instead of failing with "Too many connections".
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        decode_responses=True,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        max_connections=max_connections,
        timeout=timeout,
        retry=retry,
        health_check_interval=0,
    )
    return aioredis.Redis.from_pool(pool)  # the client owns and closes the pool
