"""The store's link to Redis: the client, the auto-pipeline, :meth:`RedisLink.run_script` (one
script, one round trip, the prelude's trailer), :meth:`RedisLink.guard` (every other Redis call),
Redis's clock, the durability marks the trailer carries (the quarantine, the witness, the
periodic checks) and readiness, and the copy of audit entries to the tenant-wide feed.

One link per store, given to each of its parts (:class:`gateway.store.store.Store` composes
them): the decisions (:mod:`gateway.store.store`), the relay queue (:mod:`gateway.store.relayq`),
the reads (:mod:`gateway.store.reads`), the "needs a decision" index
(:mod:`gateway.store.attention`) and the job state (:mod:`gateway.store.jobstate`). Nothing of
those lives here: the link decides nothing."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from gateway.core.errors import StoreUnavailable
from gateway.store import durability, scripts, statefile
from gateway.store.anchors import note_audit
from gateway.store.batching import Batcher, NotSent
from gateway.store.budget import RejectionBudget
from gateway.store.cluster import all_markers, is_cluster, per_slot, router_for
from gateway.store.failures import REDIS_FAILURES, guarded, is_oom, store_unavailable
from gateway.store.keys import (
    EPOCH,
    MARKER,
    QUARANTINE,
    RELAY_TENANTS,
    JobKeys,
    audit_feed,
    relay_hint,
    slot_marker,
    witness,
)
from gateway.store.marks import MARKS_FILE, SlotMarks
from gateway.store.replication import AckPolicy
from gateway.store.replies import Reply
from gateway.store.router import ClusterRouter
from gateway.store.scripts import (
    MARKER_MISSING,
    PLAIN_NAMES,
    SCRIPT_NAMES,
    UNINITIALISED,
    PlainScript,
    lua_source,
    plain_source,
)

T = TypeVar("T")
READY_PROBE = "fg:readyz:probe"  # /readyz's probe write (10 s TTL)
# the witness raise: INCR and EXPIRE of the witness key only while the marker still reads
# what was read; -1 when it does not
WITNESS_RAISE = PlainScript.load("witness-raise-2")

# a data dir's witness key outlives its last tick by this long (a data dir gone for good
# leaves no key behind); a data dir away for longer starts a new count (RedisLink.witness)
WITNESS_TTL = 7 * 86_400
MEMORY_READY = 0.95  # /readyz: a Redis using more of its maxmemory is not ready (`memory`)
MISSING_LOG_SECONDS = 30.0  # a lasting "marker missing" is logged again this often
log = structlog.get_logger("fencegate.store")

# /readyz's ``cause``: the first check that failed, in this order
CAUSES = {
    "redis": "redis_unreachable",
    "scripts": "scripts_not_loaded",
    "marker": "marker_missing",
    "writable": "not_writable",  # "out_of_memory" when Redis refused the probe for OOM
    "replicas_acked": "replicas_not_acknowledging",
    "topology": "topology",
    "cluster": "cluster_unhealthy",
    "slots": "slot_went_back",
    "memory": "memory_nearly_full",  # above MEMORY_READY of maxmemory
    "durable": "not_durable",  # appendonly / appendfsync / maxmemory-policy changed
}


@dataclass(frozen=True)
class Readiness:
    """``/readyz``: the checks by name; when one failed, why (``cause``, one of
    :data:`CAUSES`' values or ``out_of_memory``; for ``marker_missing`` also ``marker``, one
    of :data:`gateway.store.durability.MARKER_STATES`) and a sentence for the operator."""

    checks: dict[str, bool]
    cause: str | None = None
    marker: str | None = None
    detail: str | None = None
    quarantine: dict[str, Any] | None = None  # fg:quarantine, when Redis was quarantined

    @property
    def ok(self) -> bool:
        return all(self.checks.values())


def _readiness(
    checks: dict[str, bool],
    failure: Exception | None,
    marker: str,
    went_back: tuple[int, int, int] | None,
    topology: list[str] | None,
) -> Readiness:
    failed = next((name for name in CAUSES if checks.get(name) is False), None)
    if failed is None:
        return Readiness(checks)
    cause, detail = CAUSES[failed], None
    if isinstance(failure, StoreUnavailable):
        detail = failure.detail
    elif failure is not None:
        detail = f"{type(failure).__name__}: {failure}"
    if failed == "marker":
        return Readiness(
            checks, cause, marker or "unknown", durability.MARKER_STATES.get(marker, detail)
        )
    root = failure.__cause__ if failure is not None else None
    if (
        failed == "writable"
        and failure is not None
        and is_oom(root if isinstance(root, Exception) else failure)
    ):
        cause = "out_of_memory"
    elif failed == "replicas_acked" and (
        nodes := [n[15:] for n, ok in checks.items() if n.startswith("replicas_acked ") and not ok]
    ):
        detail = "no acknowledgement from the replicas of " + ", ".join(nodes)
    elif failed == "topology":
        detail = "; ".join(topology or ()) or "the replication topology was not checked yet"
    elif failed == "slots" and went_back is not None:
        slot, counter, mark = went_back
        detail = (
            f"slot {slot} went back in time (counter {counter} below {mark} seen): Redis lost "
            "writes this gateway saw acknowledged; nothing is dispatched in that slot"
        )
    return Readiness(checks, cause, detail=detail)


_FEED_FIELDS = ("step", "reason", "presented", "current", "worker_id", "adapter")


class RedisLink:
    """One store's connection side: every script call and every other Redis call goes through
    it, and it keeps what the prelude's trailer needs (the slot marks, the request memory, the
    audit key) and what follows from a reply (Redis's clock, a gone-back slot, the feed copy)."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        retention_seconds: int,
        state_file: Path | None = None,
        request_memory_seconds: float = 60.0,
        audit_key: str = "",
        ack: AckPolicy | None = None,
    ) -> None:
        self._client = client
        self._request_ttl = str(int(request_memory_seconds * 1000))
        self._request_ttl_ms = int(request_memory_seconds * 1000)
        # Redis's clock minus this host's (ms): learnt at boot (TIME) and from a {11} reply;
        # only the bounds of admits and claims use it (run_bounded)
        self._clock_offset_ms = 0
        self._audit_key = audit_key
        # Jobs whose audit chain got an entry in a reply seen here, with the newest such
        # entry's id: the anchorer's to-do (gateway.store.anchors).
        self.audit_touched: dict[JobKeys, str] = {}
        # The highest value of each slot's marker seen in a reply (slot -> counter), shared
        # by every process of the data dir (gateway.store.marks). A counter below it means
        # the slot went back in time: the script refuses ({8, 'behind'}) and this store
        # quarantines Redis for every gateway (went_back).
        self.slot_seen = SlotMarks(state_file.with_name(MARKS_FILE) if state_file else None)
        # this data dir's name in its witness key: the same for every process sharing it
        where = os.path.realpath(state_file) if state_file else f"pid-{os.getpid()}"
        self.host_id = hashlib.sha1(
            f"{socket.gethostname()}:{where}".encode(), usedforsecurity=False
        ).hexdigest()[:16]
        self._going_back: asyncio.Task[None] | None = None
        # what the last periodic check found wrong with Redis's durability settings
        # (appendonly, appendfsync, maxmemory-policy); None: not checked, or waived
        self.durability_problems: list[str] | None = None
        self._persisted: dict[int, int] = {}  # the marks the state file held at the last write
        # the detail of a 503 for a missing slot marker (a Redis never initialised: UNINITIALISED)
        self.marker_missing_detail = MARKER_MISSING
        # the last slot a script refused as gone back (slot, its counter, the mark), until a
        # reply in it or a marks check passes: /readyz names it (checks.slots)
        self.slot_behind: tuple[int, int, int] | None = None
        # "marker missing" refusals: when the last `redis_marker_missing` line was logged
        # (None: not since the last verdict) and how many refusals since
        self._missing_logged: float | None = None
        self._missing_refused = 0
        self._retention_ms = retention_seconds * 1000
        self._state_file = state_file
        self._sources = {name: lua_source(name) for name in SCRIPT_NAMES}
        self._shas = {
            name: hashlib.sha1(src.encode(), usedforsecurity=False).hexdigest()
            for name, src in self._sources.items()
        }
        self._batcher: Batcher | ClusterRouter = (
            router_for(client, self.slot_seen, ack)  # type: ignore[arg-type]
            if is_cluster(client)
            else Batcher(client, ack)
        )
        # the scripts copy their audit entries to the tenant feed themselves (the trailer names
        # it, includes/feed), except on a Cluster: the feed lives in another slot there
        self.feeds_in_script = not is_cluster(client)
        # the relay's per-tenant hints are written by the scripts that write the slot's queue
        # (includes/relayq), except on a Cluster: the gateway writes them after the script there
        self.hints_in_script = self.feeds_in_script
        # the problems of the last replication topology check (gateway.store.topology); None:
        # not checked (replicas_acked 0)
        self.topology_problems: list[str] | None = None
        # quotas.rejections_per_window: every fenced script's rejections flag, and the count of
        # every rejection but admit-8's (its admission hook counts those): None audits all
        self.rejection_budget: RejectionBudget | None = None

    async def aclose(self) -> None:
        """Finish the pipelined batches in flight and close their connections."""
        await self._batcher.aclose()

    @property
    def cluster(self) -> bool:
        """Redis/Valkey Cluster (``[redis] cluster = true``): scripts go through the router."""
        return isinstance(self._batcher, ClusterRouter)

    @property
    def batcher(self) -> Batcher | ClusterRouter:
        """The auto-pipeline every script and the audit feed go through."""
        return self._batcher

    def route_through(self, batcher: Batcher | ClusterRouter) -> None:
        """Send every later command through ``batcher`` instead (the model checker's wire,
        which records and reorders calls); a deployment never calls this."""
        self._batcher = batcher

    @property
    def script_shas(self) -> Mapping[str, str]:
        """Each script's name and the SHA1 it is sent by (``EVALSHA``), read-only."""
        return MappingProxyType(self._shas)

    def script_source(self, name: str) -> str:
        """The source of script ``name`` as Redis runs it (prelude and includes resolved)."""
        return self._sources[name]

    def replace_script(self, name: str, source: str) -> str:
        """Run ``source`` as script ``name`` from now on; returns its SHA1. For the model
        checker's mutation tests (a deliberately broken variant); a deployment never calls
        this."""
        self._sources[name] = source
        self._shas[name] = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()
        return self._shas[name]

    @property
    def client(self) -> aioredis.Redis:
        return self._client

    @property
    def retention_ms(self) -> int:
        return self._retention_ms

    # -- plumbing ------------------------------------------------------------

    async def guard(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run a Redis call of a store module (a read, a pipeline: not a script, see
        :meth:`run_script`); availability failures become ``StoreUnavailable``."""
        return await guarded(call)

    async def load_scripts(self) -> None:
        """Load every script (a syntax error fails here, at boot)."""

        async def load() -> None:
            for name, source in self._sources.items():
                sha = await self._client.script_load(source)
                if sha != self._shas[name]:  # pragma: no cover - Redis and hashlib disagree
                    raise RuntimeError("script SHA mismatch")
            # the plain ones too (their syntax checked at boot as well)
            for name in PLAIN_NAMES:
                await self._client.script_load(plain_source(name))

        await self.guard(load)
        await self.guard(self.learn_clock)

    async def learn_clock(self) -> None:
        """Learn Redis's clock (``TIME``) relative to this host's, for :meth:`redis_clock_ms`."""
        before = time.time()
        seconds, micros = await self._client.time()
        self.clock_at(seconds * 1000 + micros // 1000, (before + time.time()) / 2)

    def clock_at(self, redis_ms: int, local: float | None = None) -> None:
        """Redis's clock read ``redis_ms`` at this host's ``local`` (``time.time()``; now)."""
        self._clock_offset_ms = redis_ms - int((time.time() if local is None else local) * 1000)

    def redis_clock_ms(self) -> int:
        """Redis's clock now, as far as this process knows it (this host's plus the offset)."""
        return int(time.time() * 1000) + self._clock_offset_ms

    async def run_script(
        self,
        name: str,
        job: JobKeys,
        keys: Sequence[str],
        args: Sequence[str],
        request_id: str | None = None,
    ) -> list[Any]:
        """One script, one round trip, pipelined with the others of this tick (EVALSHA; EVAL on
        NOSCRIPT, see :mod:`gateway.store.batching`): the call every store module's script
        goes through (``KEYS`` and ``ARGV`` as the script's own, without the trailer).

        Every call carries the prelude's trailer: a request id (a re-send of the same call
        gets the remembered reply and changes nothing), the job slot's marker and the highest
        value of it seen. The reply comes back without the slot counter it is prefixed with.
        """
        rid = request_id or scripts.new_dispatch_id()
        slot = job.slot
        seen = self.slot_seen.get(slot, 0)
        try:  # awaited here, not through guard(): one coroutine frame less on the hot path
            reply: list[Any] = await self._batcher.evalsha(
                self._shas[name],
                self._sources[name],
                (*keys, job.req(rid), job.marker),
                (
                    *args,
                    rid,
                    self._request_ttl,
                    str(seen),
                    self._audit_key,
                    audit_feed(job.tenant) if self.feeds_in_script else "",
                ),
            )
        except REDIS_FAILURES as exc:
            if (unavailable := store_unavailable(exc)) is None:
                raise
            # Redis refuses a script for OOM only before its first write (the check runs
            # while nothing is written, so the script stays atomic): then it did nothing
            unavailable.maybe_applied = not (isinstance(exc, NotSent) or is_oom(exc))
            raise unavailable from exc
        seq = int(reply[0])
        if seq > seen:
            self.slot_seen.raise_to(slot, seq)
        if reply[1] == Reply.DATA_LOST:
            if len(reply) > 2:
                self.slot_behind = (slot, seq, int(reply[3]))
                await self.went_back(slot, seq, int(reply[3]))
                raise StoreUnavailable(
                    "Redis has lost writes fencegate saw acknowledged (this job's slot went "
                    "back in time): fences may be gone, so nothing is dispatched. An operator "
                    "must run `fencegate init --confirm-data-loss` and re-register current "
                    "generations."
                )
            self._missing_refused += 1
            last = self._missing_logged
            if last is None or time.monotonic() - last >= MISSING_LOG_SECONDS:
                self._missing_logged = time.monotonic()
                await self._log_marker_missing(slot)
            raise StoreUnavailable(self.marker_missing_detail)
        if self._missing_logged is not None or self.slot_behind is not None:
            self._verdict_in(slot)
        del reply[0]
        return reply

    def relay_hint_keys(self, tenant: str, *, tenants: bool = False) -> tuple[str, ...]:
        """The keys a script that writes the slot's relay queue writes the tenant's hint with
        (includes/relayq; ``tenants``: and the set of tenants with hints, for a script that
        queues a step): none on a Cluster, where they are other slots' keys."""
        if not self.hints_in_script:
            return ()
        return (relay_hint(tenant), RELAY_TENANTS) if tenants else (relay_hint(tenant),)

    async def run_bounded(
        self,
        name: str,
        job: JobKeys,
        keys: Sequence[str],
        args: Sequence[str],
        request_id: str,
        run_before_ms: int | None,
        after: Sequence[str] = (),
    ) -> list[Any]:
        """:meth:`run_script` with a "run before" as the last argument (admit-8, relay-6: arriving
        later, the script does nothing: {11}); None: Redis's clock as estimated here plus the
        request memory. A lost reply raises ``StoreUnavailable`` carrying the bound (a void
        outlives it). A {11} that came back means the estimate was behind: learnt, and once
        more with a fresh bound (unless the caller's: a re-send keeps the first send's)."""
        fresh = run_before_ms is None
        for _ in range(2):
            if fresh:
                run_before_ms = self.redis_clock_ms() + self._request_ttl_ms
            try:
                bounded = (*args, str(run_before_ms), *after)  # `after`: arguments past the bound
                reply = await self.run_script(name, job, keys, bounded, request_id)
            except StoreUnavailable as exc:
                exc.run_before_ms = run_before_ms
                raise
            if int(reply[0]) != Reply.TOO_LATE:
                return reply
            self.clock_at(int(reply[1]))
            if not fresh:
                break
        raise StoreUnavailable("this call reached Redis too late to run; nothing was done")

    def _verdict_in(self, slot: int) -> None:
        """A script gave a verdict in ``slot``: a gone-back slot there is caught up (a Redis
        initialised again), and the next "marker missing" is logged at once."""
        if self.slot_behind is not None and self.slot_behind[0] == slot:
            self.slot_behind = None
        self._missing_logged = None

    async def _log_marker_missing(self, slot: int) -> None:
        """One `redis_marker_missing` line (when it first happens, then every
        :data:`MISSING_LOG_SECONDS` while it lasts): the slot, whether the global marker is
        there, and what the data says happened (:func:`durability.marker_state`)."""
        present: bool | None = None
        state = "unknown"
        try:
            present = bool(await self._client.exists(MARKER))
            if present:
                state = "slot_marker_missing"
            else:
                state = await durability.marker_state(self._client, self._state_file)
        except REDIS_FAILURES:
            pass
        refused, self._missing_refused = self._missing_refused, 0
        log.error(
            "redis_marker_missing",
            slot=slot,
            global_marker_present=present,
            state=state,
            refused_since_last_line=refused,
            detail=durability.MARKER_STATES.get(state, self.marker_missing_detail),
        )

    # -- durability marker ---------------------------------------------------

    async def went_back(self, slot: int, counter: int, seen: int) -> None:
        """A script met its slot's counter below the mark: writes a gateway saw acknowledged are
        gone. Quarantine Redis at once, for every gateway of every host (the markers removed:
        every script fails closed), latch it for this data dir, and say why. Concurrent calls
        that meet it share one quarantine."""
        if self._going_back is None or self._going_back.done():
            self._going_back = asyncio.ensure_future(self._quarantine(slot, counter, seen))
        with contextlib.suppress(StoreUnavailable):  # Redis failed: the next call meets it again
            await asyncio.shield(self._going_back)

    async def _quarantine(self, slot: int, counter: int, seen: int) -> None:
        self.slot_seen.latch(int(time.time() * 1000))
        log.error(
            "redis_slot_went_back",
            slot=slot,
            counter=counter,
            seen=seen,
            detail="writes a gateway of this host saw acknowledged are gone (a restored "
            "backup, a lost tail of writes, a failover to a lagging replica): Redis is "
            "quarantined for every gateway until `fencegate init --confirm-data-loss`",
        )
        await self._quarantine_for("slot_went_back", slot=slot, counter=counter, seen=seen)

    async def _quarantine_for(self, cause: str, **facts: int) -> None:
        """Quarantine Redis, recording the cause, this data dir and this process."""
        await self.guard(
            lambda: durability.quarantine(
                self._client, cause=cause, by=self.host_id, pid=os.getpid(), **facts
            )
        )

    async def quarantine_cause(self) -> dict[str, Any] | None:
        """Why Redis was quarantined (``fg:quarantine``), or None."""
        raw = await self.guard(lambda: self._client.get(QUARANTINE))
        if raw is None:
            return None
        try:
            cause: dict[str, Any] = json.loads(raw)
        except ValueError:
            return {"cause": "unreadable"}
        return cause

    async def witness(self) -> bool:
        """Raise this data dir's witness counter and compare (every
        ``redis.marks_interval_seconds``; standalone Redis only).

        Only the processes of one data dir raise ``fg:witness:<baseline>:<host>``, and each
        compares the answer with the highest value any of them recorded before it asked: a
        healthy Redis answers more. An answer at or below it means Redis lost the raise it
        acknowledged (a restored backup, a lost tail of writes): quarantined, whatever the
        slot counters say, so writes of other hosts that caught a slot's counter up since
        cannot hide it. The baseline is the durability marker's id: a new one after
        ``fencegate init`` starts the count again. Returns False when it quarantined."""
        if self.cluster:  # one key lives on one shard: the cluster check reads every marker
            return True
        raw: str | None = await self.guard(lambda: self._client.get(MARKER))  # type: ignore[arg-type,return-value]
        if raw is None:
            return True  # nothing to witness: the scripts fail closed already
        base = int(hashlib.sha1(raw.encode(), usedforsecurity=False).hexdigest()[:15], 16)
        before = self.slot_seen.witness(base)
        key = witness(format(base, "x"), self.host_id)
        # raised only next to the marker read above, in one step: a Redis flushed or
        # re-initialised since that read must not get a witness key (a wiped Redis stays
        # empty, reported as wiped, not as quarantined)
        value = int(
            await self.guard(
                lambda: self._batcher.execute(
                    "EVAL", WITNESS_RAISE.source, "2", MARKER, key, raw, str(WITNESS_TTL)
                )
            )
        )
        if value < 0:
            return True  # the marker changed under us: the next tick witnesses the new one
        if value > before:
            self.slot_seen.record_witness(base, value)
            return True
        if value == 1 and time.time() - self.slot_seen.witnessed_at() > WITNESS_TTL - 60:
            # the key expired while no process of this data dir ticked (away for longer than
            # its TTL): a new count, not a loss. A key a restore took away while this data dir
            # was ticking cannot be mistaken for this: it would have lived on.
            self.slot_seen.record_witness(base, value, fresh=True)
            log.warning("redis_witness_restarted", after_seconds=WITNESS_TTL)
            return True
        self.slot_seen.latch(int(time.time() * 1000))
        log.error(
            "redis_witness_went_back",
            witness=value,
            recorded=before,
            detail="Redis answered a lower witness count than this host recorded: it lost "
            "writes it acknowledged and is quarantined for every gateway until "
            "`fencegate init --confirm-data-loss`",
        )
        await self._quarantine_for("witness_went_back", counter=value, seen=before)
        return False

    async def initialize(
        self, *, auto: bool, confirm_data_loss: bool = False, write: bool = True
    ) -> str:
        """Write the durability markers when it is safe (see :mod:`gateway.store.durability`); first
        take in the slot marks of the state file (a restart keeps its high-water marks)."""
        self.load_marks()
        result = await self.guard(
            lambda: durability.initialize(
                self._client,
                self._state_file,
                auto=auto,
                confirm_data_loss=confirm_data_loss,
                write=write,
                seen=self.slot_seen.snapshot(),
                bump=self._epoch_bump(),
            )
        )
        self.marker_missing_detail = UNINITIALISED if result == "uninitialised" else MARKER_MISSING
        if result == "written":  # a new baseline: the latch and the old marks are void
            self.slot_seen.reset()
        return result

    def load_marks(self) -> None:
        """Merge the state file's slot marks into :attr:`slot_seen` (per slot the maximum)."""
        self.slot_seen.merge(durability.read_marks(self._state_file))

    async def persist_marks(self) -> bool:
        """Write the slot marks that rose since the last write to the state file (merged with
        the other processes' under the file's lock; the file I/O runs in a thread). Returns
        whether it wrote. The marks of other processes are read by :meth:`heartbeat_epoch`."""
        if self._state_file is None:
            return False
        snapshot = dict(self.slot_seen.own)  # each process writes what it saw itself
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
        if await self.guard(lambda: self._client.get(MARKER)) is None:
            return False
        self.marker_missing_detail = MARKER_MISSING  # initialised (by `fencegate init`) since
        if self.cluster:  # every slot's marker is its epoch (gateway.store.durability)
            if not await self.guard(self._cluster_marks_check):
                return False
            self.slot_behind = None
            return True
        self.load_marks()  # the marks other processes wrote, before Redis is read
        if not await self.guard(
            lambda: durability.marks_check(
                self._client, self._state_file, self.slot_seen.snapshot()
            )
        ):
            return False
        self.slot_behind = None
        return await self.guard(
            lambda: durability.epoch_check(self._client, self._state_file, self._epoch_bump())
        )

    def _epoch_bump(self) -> durability.Bump | None:
        """With replicas_acked, the epoch is bumped through the acknowledged auto-pipeline."""
        if self._batcher.ack is None:
            return None
        return lambda: self._batcher.execute("INCR", EPOCH)

    async def _cluster_marks_check(self) -> bool:
        """Cluster: take the marks, then read all 16,384 markers through the router (so they
        wait for whatever the scripts' replies wait for), compare them with the marks (a slot
        found below is read again before it is believed), then keep them as marks.

        The marks are taken before the read (it lasts 100-350 ms): a slot written meanwhile
        can only show a marker above its mark, never below."""
        assert isinstance(self._batcher, ClusterRouter)
        router = self._batcher
        marks = durability.read_marks(self._state_file)
        for slot, mark in tuple(self.slot_seen.items()):
            marks[slot] = max(mark, marks.get(slot, 0))
        current = await all_markers(router)

        async def reread(slots: Sequence[int]) -> list[str | None]:
            return await per_slot(router, [("GET", slot_marker(s)) for s in slots])

        if not await durability.compare_marks(self._client, marks, current, reread=reread):
            return False
        for slot, value in current.items():
            counter = durability.counter_of(value)
            if counter and counter > self.slot_seen.get(slot, 0):
                self.slot_seen.raise_to(slot, counter)
        return True

    async def check_durability(self) -> list[str] | None:
        """Read Redis's durability settings again (every ``redis.epoch_interval_seconds``): a
        Redis switched to ``appendfsync everysec`` (or eviction, or no AOF) while serving is
        logged on every transition and makes ``/readyz`` 503 (``durable``). Verdicts go on: a
        write it then loses in a crash is caught by the marks and the witness (quarantine),
        not silently. Not on a cluster (checked per node at start)."""
        if self.cluster:
            return None
        problems = await self.guard(lambda: durability.durability_settings(self._client))
        before = self.durability_problems
        self.durability_problems = problems
        if problems and problems != before:
            log.error(
                "redis_not_durable",
                detail="; ".join(problems)
                + ": a restart, a crash or an eviction would lose fences; fix Redis",
                while_serving=True,
            )
        elif before and not problems:
            log.info("redis_durable_again")
        return problems

    async def ready(self) -> dict[str, bool]:
        """Readiness checks by name (see :meth:`readiness`)."""
        return (await self.readiness()).checks

    async def readiness(self) -> Readiness:
        """Readiness: Redis answers, scripts loaded, durability marker present, and Redis takes
        a write (a probe key with a TTL: not ready while Redis is out of memory); with the
        cause of the first check that failed (:data:`CAUSES`)."""
        checks = {"redis": False, "scripts": False, "marker": False, "writable": False}
        if self.durability_problems:
            checks["durable"] = False
        acking = self._batcher.ack is not None
        if acking:  # replicas_acked: the probe write must be acknowledged by the replicas too
            checks["replicas_acked"] = False
            checks["topology"] = self.topology_problems == []
        failure: Exception | None = None
        marker = ""
        quarantine: dict[str, Any] | None = None
        try:
            await self.guard(self._client.ping)
            checks["redis"] = True
            exists = await self.guard(lambda: self._client.script_exists(*self._shas.values()))
            if not all(exists):  # cache flushed or Redis restarted: load them again
                await self.load_scripts()
            checks["scripts"] = True
            checks["marker"] = bool(await self.guard(lambda: self._client.exists(MARKER)))
            if not checks["marker"]:
                marker = await self.guard(
                    lambda: durability.marker_state(self._client, self._state_file)
                )
                if marker == "quarantined":
                    quarantine = await self.quarantine_cause()
            # a probe write: Redis out of memory (maxmemory, noeviction) refuses every call.
            # Only next to the marker: a wiped Redis must stay empty (no "fencegate data").
            if checks["marker"]:
                await self.guard(lambda: self._client.set(READY_PROBE, "1", px=10_000))
                checks["writable"] = True
                cluster = isinstance(self._batcher, ClusterRouter)
                if acking and not cluster:  # through the auto-pipeline, as the verdicts
                    probe = ("SET", READY_PROBE, "1", "PX", "10000")
                    await self.guard(lambda: self._batcher.execute(*probe))
                    checks["replicas_acked"] = True
            if not self.cluster:  # a Redis with maxmemory: not ready when (nearly) full
                memory = await self.guard(lambda: self._client.info("memory"))
                bound = int(memory.get("maxmemory") or 0)
                if bound:
                    checks["memory"] = int(memory.get("used_memory") or 0) < MEMORY_READY * bound
            if isinstance(self._batcher, ClusterRouter):  # every slot served, every primary up
                checks["cluster"] = False
                if acking:  # each shard: a batch on its primary acknowledged now
                    shards = await self.guard(self._batcher.acknowledging)
                    checks.update({f"replicas_acked {node}": ok for node, ok in shards.items()})
                    checks["replicas_acked"] = checks["marker"] and all(shards.values())
                checks["cluster"] = await self.guard(self._batcher.healthy)
        except (StoreUnavailable, RedisError) as exc:
            failure = exc
        if self.slot_behind is not None and checks["marker"]:
            checks["slots"] = False  # a slot went back and Redis is not quarantined (yet)
        ready = _readiness(checks, failure, marker, self.slot_behind, self.topology_problems)
        if quarantine is not None:
            ready = dataclasses.replace(ready, quarantine=quarantine)
        return ready

    # -- the tenant-wide audit feed -------------------------------------------

    def unaudited_flag(self, tenant: str) -> str:
        """The fenced scripts' rejections argument (includes/reject's ``past_rejection_cap``):
        ``'1'`` when the tenant's rejections budget is used up, else its counter for the
        script to count (``'<cap> <ttl> <key>'``, a standalone Redis), else ``''``."""
        budget = self.rejection_budget
        if budget is None:
            return ""
        return "1" if budget.closed(tenant) else budget.counter(tenant)

    def rejection_spent(
        self, keys: JobKeys, step: str, flag: str, worker_id: str, audit_id: str
    ) -> None:
        """Report a ``{9, …}`` reply (its ``audit_id``, '' when not audited) of a script called
        with ``flag`` to the budget."""
        if self.rejection_budget is not None:
            self.rejection_budget.spent(
                keys, step, audited=bool(audit_id), worker_id=worker_id, counted=len(flag) > 1
            )

    async def to_feed(
        self, keys: JobKeys, audit_id: str, copied: bool = False, /, **fields: str
    ) -> None:
        """Copy a job's audit entry into the tenant-wide feed (trimmed by age).

        Best effort: the entry is already in the job's stream, written atomically
        with the decision, so a failed copy must not turn a true 409 into a 503. No
        ``audit_id`` (a rejection the script did not audit: the tenant's rejections quota):
        nothing to copy. ``copied``: the script copied it already (includes/feed: a
        rejection, a supersession, when :attr:`feeds_in_script`); only noted for the anchorer.
        """
        if not audit_id:
            return
        note_audit(self.audit_touched, keys, audit_id)
        if copied:
            return
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
            await self.guard(
                lambda: self._batcher.execute(
                    *xadd, *(x for kv in entry.items() for x in kv), resend=False
                )
            )
        except StoreUnavailable:
            log.warning("audit_feed_copy_failed", job_id=keys.job_id, audit_id=audit_id)

    async def copy_to_feed(self, keys: JobKeys, audit_id: str, *, copied: bool = False) -> None:
        """Copy an entry a script wrote as a side note (not a rejection it answers) to the feed
        (``copied``: the script did, see :meth:`to_feed`)."""
        note_audit(self.audit_touched, keys, audit_id)
        if copied:
            return

        async def read() -> list[tuple[str, dict[str, str]]]:
            rows = await self._client.xrange(keys.audit, audit_id, audit_id)
            return rows  # type: ignore[return-value]  # decode_responses=True: str

        try:
            rows = await self.guard(read)
        except StoreUnavailable:
            log.warning("audit_feed_copy_failed", job_id=keys.job_id, audit_id=audit_id)
            return
        for _, fields in rows:
            copy = {k: v for k, v in fields.items() if k in _FEED_FIELDS}
            await self.to_feed(keys, audit_id, **copy)
