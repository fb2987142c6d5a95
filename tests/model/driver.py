"""The one place where a model actor's step becomes a call of the real store.

Re-point this module when the store API, the scripts or the relay change; the
explorer (:mod:`tests.model.explore`) and the invariants
(:mod:`tests.model.invariants`) only see what the step functions below return.

Every step is ONE call of :class:`gateway.store.store.Store` against a real
redis-server (at most one Lua script per step: each script is atomic, so the
interleavings are over steps), or one gateway-side action (a downstream send).
Each step function names the service code it mirrors (``gateway/fencing/``
of fe3ffa8 and after: the relay under the fence, re-send-safe scripts).

Faults on the wire are injected by :class:`Wire`, which stands where
:class:`gateway.store.batching.Batcher` stands: ``lost`` runs the script, drops the
reply and runs the very same EVALSHA again (what the batcher does after a
connection error: the script already ran), ``timeout`` runs the script and
raises a timeout (the store marks it ``maybe_applied``; the service sends it
again later, with the same request id, as its own step).

Time. Everything runs on the real clocks, as the service does (Redis ``TIME``
in the scripts, ``time.time()`` for queue hints), but every timer is an hour
long: the dispatch timeout the scripts get, the relay's retry delay. So no
timer fires during a run, and the explorer's ``advance`` action is the only
way time passes: it fires every timer at once (:meth:`Driver.advance`: stored
deadlines into the past, every future queue score and hint due; the gateway
side marks its in-flight deadlines passed and its sweep due). Queue scores
enter the state as due / later, so runs are exact and reproducible.

Processes and restores. The actors may run on two gateway processes, each with its
own :class:`gateway.store.store.Store` and its own :class:`gateway.store.marks.SlotMarks`
(``marks``: ``shared`` -- both on one data dir, one memory-mapped marks file; ``hosts`` -- one
data dir each, with the per-data-dir witness of :meth:`RedisLink.witness`; ``own`` -- the
store of 4a7c224: each process's marks in its memory only, and a ``behind`` reply refused
without the quarantine). The marks are part of the explored state: the explorer sets them
before every step (:meth:`Driver.set_marks`) and reads them after it (:meth:`Driver.get_marks`),
as it puts Redis back from a snapshot.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import re
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

import gateway.store.durability as durability_module
import gateway.store.scripts as store_module
from gateway.core.errors import (
    EffectNotUnknown,
    FencegateError,
    NotFound,
    OutputNotStaged,
    Rejection,
    StoreUnavailable,
)
from gateway.core.intents import intent_digest
from gateway.core.records import Admitted, InProgress, Queued, RelayClaim, Replay, Unresolved
from gateway.store.jobstate import JobState
from gateway.store.keys import MARKER, QUARANTINE, JobKeys, attention_hint, relay_hint
from gateway.store.marks import MARKS_FILE, SlotMarks
from gateway.store.replies import OutputRecordReply, OutputStageReply
from gateway.store.store import Store

TENANT, JOB = "t", "j"
KEYS = JobKeys(TENANT, JOB)
ADAPTER, OPERATION = "hook", "refund"

HOUR_MS = 3_600_000
REDIS_DISPATCH_MS = HOUR_MS  # the dispatch timeout the scripts get: no deadline passes alone
RELAY_RETRY_MS = HOUR_MS  # dispatch.RELAY_RETRY_MS (1 s): a released relay step is due again
IN_PROGRESS_SLACK_MS = 50  # _relay_one: "look again after its deadline" + 50 ms
RECORD_TRIES = 6  # _record: one try and len(_RECORD_BACKOFF) retries
CLAIM_TRIES = 3  # _claim: (0.0, 0.05, 0.2), then void
RELAY_PER_TENANT = 16  # Relay.run(per_tenant=16)
RETENTION_S = 7 * 86_400
REQUEST_MEMORY_S = 3600  # redis.request_memory_seconds: no remembered reply expires in a run
BASELINE = "model-baseline"  # the durability marker's id (fencegate init writes one)
# RedisLink.witness: the witness key's baseline, a hash of the durability marker's id
WITNESS_BASE = int(hashlib.sha1(BASELINE.encode(), usedforsecurity=False).hexdigest()[:15], 16)
MARKS = ("shared", "hosts", "own")  # see the module doc


def now_ms() -> int:
    return int(time.time() * 1000)


# What the downstream can do with a send (the explorer branches on each allowed one):
#   ok       delivered, the adapter says Delivered            -> record succeeded
#   refused  connection refused, NotDelivered (not delivered) -> record released
#   timeout  sent and delivered, but the reply never came     -> record unknown
#   lost     timed out and never arrived (not delivered)      -> record unknown
#   failed   permanent refusal, Failed (not delivered)        -> record failed
DELIVERS = {"ok": True, "refused": False, "timeout": True, "lost": False, "failed": False}
RECORDS = {
    "ok": "succeeded",
    "refused": "released",
    "timeout": "unknown",
    "lost": "unknown",
    "failed": "failed",
    "late": "released",  # _send: the gateway's own deadline passed, nothing sent
}


def payload_json(payload: Any) -> str:
    # EffectService.perform: json.dumps(payload, separators=(",", ":"))
    return json.dumps(payload, separators=(",", ":"))


def digest(payload: Any) -> str:
    return intent_digest(ADAPTER, OPERATION, payload)


# -- what the actors remember (frozen: part of the explored state) -----------------


@dataclass(frozen=True)
class Auth:
    """What authorised a send, read from Redis right after the admit or claim that granted it."""

    by: str  # "admit" | "relay_claim"
    gen: int  # the generation the send carries
    fence: int  # the job's fence right after the authorising script
    cancelled: bool
    pinned: str  # the step's intent_sha256 right after the authorising script
    was: str = ""  # the step's state right before it ("-" : no record)
    resolved: bool = False  # an operator had resolved the step before it
    acked: int = 0  # the highest generation whose register was acknowledged before it ran
    phase: str = ""  # where it ran: "" (no restore yet), or "on the restored Redis, ..."
    quarantined: bool = False  # Redis was quarantined (fg:quarantine) when it ran

    @property
    def what(self) -> str:
        op = ", operator-resolved" if self.resolved else ""
        return f"{self.by} of a {self.was}{op} step"


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    gen: int
    step: str
    mode: str  # "sync" | "async"
    payload: tuple[tuple[str, Any], ...]  # a dict, frozen
    retries: int = 0  # SDK retries on effect_in_progress / adapter_unavailable / 503

    @property
    def body(self) -> dict[str, Any]:
        return dict(self.payload)


@dataclass(frozen=True)
class WorkerLocal:
    # start -> [resend ->] admitted -> sent -> done   (sync; "void" when a re-send gives up)
    # start -> [resend ->] hint -> done               (async)
    pc: str = "start"
    did: str = ""  # the admit's dispatch id = its request id
    rid: str = ""  # the record's request id (one for every try)
    auth: Auth | None = None
    late: bool = False  # an advance happened since it took the step / sent the admit
    outcome: str = ""
    tries: int = 0
    retries: int = 0


# A job worker's program: each step one fenced script of the job's own state.
JOB_STEPS = ("heartbeat", "checkpoint", "stage", "record", "complete")
OUTPUT = "o"  # the one output a job worker uploads
UPLOAD_MS = HOUR_MS  # outputs.upload_timeout_seconds: no upload's claim ends by itself


@dataclass(frozen=True)
class JobWorkerSpec:
    """A worker of generation ``gen`` working on the job itself (not an effect): its
    ``program`` of :data:`JOB_STEPS`, in order, each one call of the store."""

    name: str
    gen: int
    program: tuple[str, ...] = ("checkpoint", "stage", "record", "complete")

    @property
    def sha256(self) -> str:  # the bytes of its output
        return hashlib.sha256(f"output of generation {self.gen}".encode()).hexdigest()


@dataclass(frozen=True)
class JobLocal:
    # at: the index of the next step of the program (len: done); then, after a timeout,
    # follow: "abandon" (a stage or record whose reply never came: OutputService._abandon_soon)
    # or "resend" (a completion: CompletionService.complete sends it once more, same id)
    at: int = 0
    follow: str = ""
    stopped: bool = False  # refused (409), given up (503) or crashed: it does nothing more
    upload: str = ""  # the stage's upload id
    rid: str = ""  # the completion's request id
    recorded: bool = False  # its output was recorded (the completion names it)


@dataclass(frozen=True)
class RelayLocal:
    # idle -> (sweep | poll) -> batch -> claim [-> resend* -> void] -> claimed -> sent
    #      -> hint | requeued | unhint -> batch | idle
    pc: str = "idle"
    sweep: bool = True  # Relay.run sweeps at start and every sweep_seconds
    batch: tuple[str, ...] = ()  # the steps relay_due returned
    idx: int = 0
    did: str = ""
    rid: str = ""
    gen: int = 0
    payload: str = ""
    auth: Auth | None = None
    late: bool = False
    outcome: str = ""
    tries: int = 0
    due: int = 0  # the hint's score (ms) for pc == "hint" | "requeued"

    @property
    def step(self) -> str:
        return self.batch[self.idx]


@dataclass
class Effects:
    """What one step did besides changing its actor's memory and Redis."""

    text: str
    sends: list[Send] = field(default_factory=list)
    acks: list[tuple[Any, ...]] = field(default_factory=list)
    rejections_seen: list[str] = field(default_factory=list)  # audit ids the caller saw


@dataclass(frozen=True)
class Send:
    """One request that reached (or was sent towards) the downstream."""

    step: str
    gen: int
    payload: str
    digest: str
    delivered: bool
    by: str
    auth: Auth

    @property
    def key(self) -> tuple[Any, ...]:
        return (self.step, self.gen, self.digest, self.delivered)


# -- the wire: a real Redis, with lost replies and timeouts on demand ---------------


@dataclass
class Resend:
    script: str
    first: list[Any]
    second: list[Any]
    state_before: Any
    state_after: Any


class Wire:
    """Where the store's Batcher (gateway.store.batching) stands: every script comes here.

    One round trip per script call: the snapshot the explorer put back (:meth:`restore`, sent
    with the first command of the step), the authority reads around an admit or relay claim,
    the script, and the read of every key after it (:meth:`read`) go in one pipeline."""

    def __init__(
        self,
        client: redis.Redis,
        names: dict[str, str],
        snapshot: Callable[[], Any],
        read_sha: str = "",
        restore_sha: str = "",
    ) -> None:
        self.r = client  # decodes with surrogateescape: DUMP payloads survive as str
        self.names = names  # sha -> script name
        self.snapshot = snapshot
        self.read_sha, self.restore_sha = read_sha, restore_sha
        self.pending: list[bytes] | None = None  # a snapshot to put back before any command
        self.last_read: list[Any] | None = None  # the read after the last command, if no other
        self.mode = "ok"
        # (script, request id, reply, ARGV without the trailer) of every script run
        self.replies: list[tuple[str, str, list[Any], Sequence[str]]] = []
        self.resends: list[Resend] = []
        # request id -> (fence, cancelled, pinned intent, state before, resolved before,
        # acknowledged fence, phase, quarantined) as the first run of an admit / relay claim
        # saw them (ids are unique in a run)
        self.ran: dict[str, tuple[int, bool, str, str, bool, int, str, bool]] = {}
        self.context: tuple[int, str] = (1, "")  # (acknowledged fence, phase): the explorer's

    def restore(self, args: list[bytes]) -> None:
        """Redis is to be put back to this snapshot before the next command reaches it."""
        self.pending = args
        self.last_read = None

    def touch(self, writes: bool = True) -> None:
        """A command outside the pipeline follows: the snapshot first, and the read is stale
        unless the command only reads."""
        if self.pending is not None:
            self.r.evalsha(self.restore_sha, 0, *self.pending)
            self.pending = None
        if writes:
            self.last_read = None

    def read(self) -> list[Any]:
        """The read script's reply for Redis as it is now (no round trip when cached)."""
        if self.pending is None and self.last_read is not None:
            return self.last_read
        self.touch()
        self.last_read = self.r.evalsha(self.read_sha, 0)
        return self.last_read

    def _eval(self, sha: str, source: str | None, keys: Sequence[str], args: Sequence[str]) -> Any:
        name = self.names.get(sha, sha)
        rid = args[-5]  # the prelude's trailer: request id, memory, seen, audit key, feed
        fx = {"admit-8": keys[1], "relay-6": keys[0]}.get(name)
        first = bool(fx) and rid not in self.ran  # an authorising script's first run
        pipe = self.r.pipeline(transaction=False)
        if self.pending is not None:
            pipe.evalsha(self.restore_sha, 0, *self.pending)
            self.pending = None
        if first:  # what the authorising run sees before it runs
            pipe.hmget(fx, "state", "resolved_by")
            pipe.exists(QUARANTINE)
        pipe.evalsha(sha, len(keys), *keys, *args)
        if first:
            # An authorising script's run, read right after it: a re-send of the same request
            # gets its remembered reply, so the authority is this run's, not the re-send's.
            pipe.hmget(keys[0] if name == "admit-8" else keys[1], "fence", "cancelled")
            pipe.hget(fx, "intent_sha256")
        pipe.evalsha(self.read_sha, 0)
        out = pipe.execute(raise_on_error=False)
        for x in out:
            if isinstance(x, Exception) and not isinstance(x, NoScriptError):
                self.last_read = None
                raise x
        self.last_read = out.pop()
        if first:
            (fence, cancelled), pinned = out.pop(-2), out.pop()
        reply = out.pop()
        if first:
            (state, resolved), quarantined = out[-2], bool(out[-1])
        if isinstance(reply, NoScriptError):  # not loaded: sent as EVAL, read again after it
            assert source is not None
            self.last_read = None
            reply = self.r.eval(source, len(keys), *keys, *args)
            if first:
                (fence, cancelled), pinned = (
                    self.r.hmget(keys[0] if name == "admit-8" else keys[1], "fence", "cancelled"),
                    self.r.hget(fx, "intent_sha256"),
                )
        if first:
            self.ran[rid] = (int(fence or 0), cancelled == "1", pinned or "", state or "-",
                             bool(resolved), *self.context, quarantined)  # fmt: skip
        self.replies.append((name, rid, reply[1:], args[:-5]))  # {seq, code, ...}, its ARGV
        return reply

    async def evalsha(
        self, sha: str, source: str | None, keys: Sequence[str], args: Sequence[str]
    ) -> Any:
        if sha not in self.names:  # a plain script (the sweep's relay-rehint-3): as it is
            assert source is not None
            self.touch()
            return self.r.eval(source, len(keys), *keys, *args)
        mode, self.mode = self.mode, "ok"  # a fault hits one script call
        reply = self._eval(sha, source, keys, args)
        if mode == "lost":  # the connection dropped after the script ran: the batcher re-sends
            before = self.snapshot()
            second = self._eval(sha, source, keys, args)
            name = self.names[sha]
            self.resends.append(Resend(name, reply[1:], second[1:], before, self.snapshot()))
            return second
        if mode == "timeout":  # the script ran; the caller gets no reply
            raise RedisTimeoutError("model: no reply within redis.timeout_seconds")
        return reply

    async def execute(self, *args: Any, resend: bool = True) -> Any:
        """Batcher.execute: the audit feed copy (``resend`` only matters on a real wire)."""
        self.touch()
        return self.r.execute_command(*args)

    async def aclose(self) -> None:
        pass


def writes_audit(script: str, reply: list[Any]) -> bool:
    """Whether a script's reply says it wrote an audit entry (I-audit counts them)."""
    code = int(reply[0])
    if code == 9:  # every rejection is audited by the script that decided it
        return True
    if script == "admit-8" and code == 0:  # a superseded pending step, a registration
        return bool(reply[5] or reply[6])
    if script == "admit-8" and code == 4:
        return bool(reply[1] or reply[2])
    if script == "register-2" and code == 0:  # a new generation: recorded in the chain
        return True
    if script == "relay-6" and code == 3:  # released as superseded / lease_expired
        return bool(reply[2])
    return script == "resolve-6" and code == 0  # operator_resolved_<outcome>


def verdict(script: str, reply: list[Any]) -> tuple[Any, ...]:
    """What a caller concludes from a script's reply (Store's conversion, in short): a
    re-sent call must conclude the same (I-resend). Clock readings are left out."""
    code = int(reply[0])
    if code == 9:  # rejected: reason, presented, current, audit id
        return (9, *reply[1:5])
    if script == "admit-8":
        if code in (0, 4):  # Admitted(...) / Queued, with the superseded audit id
            return (code, *reply[1:])
        if code == 5:  # Queued: accepted again
            return ("queued",)
        if code == 2:  # InProgress(retry_after_ms = deadline - now)
            return (2,)
        rec = dict(zip(reply[1::2], reply[2::2], strict=True))  # Replay / Unknown
        return (code, rec.get("state"), rec.get("generation"), rec.get("intent_sha256"))
    if script in ("register-2", "cancel-1"):  # 201 / 200 "already": the documented retry
        return ("ok", *reply[1:])
    if script == "relay-6" and code == 0:  # claimed; a re-send's answer leaves the payload
        return (0, *reply[1:5], *reply[6:])  # out: the store reads it from the effect hash
    return tuple(reply)


# -- the driver -------------------------------------------------------------------------


class Driver:
    """A real Store on a real Redis, and the step functions of every actor."""

    def __init__(
        self,
        url: str,
        *,
        dedupes: bool,
        steps: Sequence[str],
        processes: int = 1,
        marks: str = "shared",
    ) -> None:
        self.r = redis.Redis.from_url(url, decode_responses=True)
        # DUMP payloads are bytes: decoded with surrogateescape they survive the round trip
        # as str (and hiredis does the decoding)
        self.rb = redis.Redis.from_url(
            url, decode_responses=True, encoding_errors="surrogateescape"
        )
        self._read_sha = self.rb.script_load(_READ_LUA)
        self._restore_sha = self.rb.script_load(_RESTORE_LUA)
        self._aclient = aioredis.Redis.from_url(url, decode_responses=True)
        # every script goes through the wire (one round trip each); the store's other commands
        # (relay hints, reads, a quarantine) through this client, which puts the snapshot back
        # first
        self.wire = Wire(self.rb, {}, self.raw_state, self._read_sha, self._restore_sha)
        self.aclient = _Touching(self._aclient, self.wire)
        if marks not in MARKS:
            raise ValueError(f"marks: one of {MARKS}")
        self.marks_mode = marks
        # The data dirs: one for every process (hosts, own) or one for all (shared). A marks
        # file per data dir, and a reader of it with no marks of its own (its shared part).
        self._dirs = tempfile.TemporaryDirectory(prefix="fencegate-model-marks-")
        n_dirs = 1 if marks == "shared" else processes
        self.dir_of = [0 if marks == "shared" else p for p in range(processes)]
        paths = [Path(self._dirs.name) / f"dir{i + 1}" / MARKS_FILE for i in range(n_dirs)]
        self.readers = [SlotMarks(path) for path in paths] if marks != "own" else []
        self.stores: list[Store] = []
        for p in range(processes):
            store = Store(
                self.aclient,
                registration="required",
                dispatch_timeout_ms=REDIS_DISPATCH_MS,
                retention_seconds=RETENTION_S,
                request_memory_seconds=REQUEST_MEMORY_S,
            )
            # the marks as RedisLink builds them from a state file in the data dir (a store
            # without one has marks of its own only: what every store of 4a7c224 had)
            store.link.slot_seen = SlotMarks(paths[self.dir_of[p]] if marks != "own" else None)
            store.link.host_id = f"dir{self.dir_of[p] + 1}"  # the witness key's data dir
            if marks == "own":  # 4a7c224: a 'behind' reply refused the call, nothing more
                store.link.went_back = _refuse_only  # type: ignore[method-assign]
            self.stores.append(store)
        self.store = self.stores[0]  # the store of the actor whose step runs (use())
        self.jobstates = {
            id(store): JobState(
                store.link, store.decisions, registration="required", retention_seconds=RETENTION_S
            )
            for store in self.stores
        }
        self._uploads = itertools.count(1)  # upload ids: u-<n>, named by their holder
        self.steps = tuple(steps)
        self.dedupes = dedupes  # the adapter's capabilities: dedupes_by_key, no lookup
        self.wire.names.update({sha: name for name, sha in self.store.link.script_shas.items()})
        for store in self.stores:
            store.link.route_through(self.wire)  # type: ignore[arg-type]
        # Dispatch and request ids: unique per run and recognisable (the explorer names them
        # by the actor that holds them).
        self._ids = itertools.count(1)
        self._saved_id = store_module.new_dispatch_id
        store_module.new_dispatch_id = self.new_id
        # A quarantine deletes every slot's marker; the model's Redis holds the job slot's
        # only, and DEL of the 16,383 absent ones (50 ms) changes nothing: they are skipped.
        self._saved_delete = durability_module.delete_slots
        saved, marker = self._saved_delete, KEYS.marker

        async def delete_slots(client: Any, keys: Sequence[str]) -> None:
            if marker in keys:
                await saved(client, [marker])

        durability_module.delete_slots = delete_slots
        # ... and the names of the 16,384 markers it builds are the same every time (20 ms)
        self._saved_marker = durability_module.slot_marker
        durability_module.slot_marker = functools.cache(self._saved_marker)

    def new_id(self) -> str:
        return f"d-{next(self._ids)}"

    def new_upload(self) -> str:
        return f"u-{next(self._uploads)}"

    def mutate(self, script: str, old: str, new: str) -> None:
        """Load a deliberately broken variant of one script (mutation test of the explorer)."""
        src = self.store.link.script_source(script)
        if old not in src:
            raise LookupError(f"{old!r} is not in {script}: update the mutation")
        src = src.replace(old, new)
        for store in self.stores:
            sha = store.link.replace_script(script, src)
        self.wire.names[sha] = script

    def use(self, process: int) -> None:
        """The next step runs on this gateway process (its store, its marks)."""
        self.store = self.stores[process]

    async def setup(self) -> None:
        """The initial state: the slot's durability marker, generation 1 registered."""
        self.wire.touch()
        old = self.r.keys("fg:*")
        if old:
            self.r.delete(*old)
        self.r.set(KEYS.marker, "1")
        self.r.set(MARKER, BASELINE)  # the witness's baseline (no script reads it)
        self.set_marks(self.zero_marks())
        self.use(0)
        await self.store.register(KEYS, 1, None)

    # -- the marks of every process: part of the explored state --------------------------
    # (per process: its own mark of the job's slot, the latch and the witness it records
    # when it has no data dir; per data dir: the shared mark, the latch, the witness)

    def zero_marks(self) -> tuple[Any, ...]:
        return (((0, 0, 0),) * len(self.stores), ((0, 0, 0),) * len(self.readers))

    def get_marks(self) -> tuple[Any, ...]:
        slot = KEYS.slot
        own = tuple(
            (s.link.slot_seen.own.get(slot, 0), s.link.slot_seen.latched_at_ms,
             s.link.slot_seen.witness(WITNESS_BASE)) if s.link.slot_seen.path is None
            else (s.link.slot_seen.own.get(slot, 0), 0, 0)
            for s in self.stores
        )  # fmt: skip
        shared = tuple(
            (m.get(slot), m.latched_at_ms, m.witness(WITNESS_BASE)) for m in self.readers
        )
        return own, shared

    def set_marks(self, marks: tuple[Any, ...]) -> None:
        """Put every process's marks back as :meth:`get_marks` read them."""
        slot = KEYS.slot
        own, shared = marks
        for m, (mark, latch, wit) in zip(self.readers, shared, strict=True):
            m.reset()
            if mark:
                m.raise_to(slot, mark)
            m.own.clear()
            if latch:
                m.latch(latch)
            if wit:
                m.record_witness(WITNESS_BASE, wit)
        for store, (mark, latch, wit) in zip(self.stores, own, strict=True):
            m = store.link.slot_seen
            if m.path is None:
                m.reset()
                if latch:
                    m.latch(latch)
                if wit:
                    m.record_witness(WITNESS_BASE, wit)
            m.own = {slot: mark} if mark else {}

    def presented(self, marks: tuple[Any, ...]) -> list[tuple[int, int]]:
        """Per process: (its own mark, its data dir's shared mark; 0 without one)."""
        own, shared = marks
        return [
            (own[p][0], shared[self.dir_of[p]][0] if self.readers else 0)
            for p in range(len(self.stores))
        ]

    def witness_recorded(self, marks: tuple[Any, ...]) -> list[int]:
        """Per data dir: the highest witness value its processes recorded."""
        own, shared = marks
        if self.readers:
            return [w for _, _, w in shared]
        return [w for _, _, w in own]

    async def witness_tick(self, process: int) -> Effects:
        """The marks task's witness (RedisLink.witness, every redis.marks_interval_seconds)."""
        try:
            ok = await self.stores[process].witness()
        except StoreUnavailable:
            return Effects("witness: 503")
        return Effects("witness: ahead" if ok else "witness went back: quarantined")

    async def aclose(self) -> None:
        store_module.new_dispatch_id = self._saved_id
        durability_module.delete_slots = self._saved_delete
        durability_module.slot_marker = self._saved_marker
        for store in self.stores:
            store.link.slot_seen.close()
        for m in self.readers:
            m.close()
        self._dirs.cleanup()
        await self._aclient.aclose()
        self.r.close()
        self.rb.close()

    # -- state of Redis: snapshot, restore, canonical view -------------------------------

    def read(self) -> tuple[dict[str, Any], dict[str, str]]:
        """Every ``fg:*`` key as data (see :meth:`raw_state`) and its DUMP: one command, or
        none when the last script's pipeline read it and nothing was sent since."""
        reply = self.wire.read()
        dumps: dict[str, str] = {}
        keys: dict[str, tuple[str, Any]] = {}
        for name, kind, dump, content in zip(*(reply[i::4] for i in range(4)), strict=True):
            dumps[name] = dump
            keys[name] = (kind, content)
        return self._raw(keys), dumps

    def restore(self, dumps: dict[str, str]) -> None:
        """Put back a snapshot taken by :meth:`read`: sent with the next command."""
        self.wire.restore(
            [x.encode("utf-8", "surrogateescape") for kv in dumps.items() for x in kv]
        )

    def raw_state(self) -> dict[str, Any]:
        return self.read()[0]

    def _raw(self, keys: dict[str, tuple[str, Any]]) -> dict[str, Any]:
        def content(name: str, default: Any) -> Any:
            return keys[name][1] if name in keys else default

        raw: dict[str, Any] = {
            "job": _pairs(content(KEYS.job, [])),
            "audit": [(i, _pairs(f)) for i, f in content(KEYS.audit, [])],
            "queue": _zset(content(KEYS.relayq, [])),  # the truth: per-slot relay queue
            "hints": _zset(content(relay_hint(TENANT), [])),
            # the "needs a decision" index of the slot (the truth) and the tenant's hint
            "attention": _zset(content(KEYS.attention, [])),
            "attention_hints": _zset(content(attention_hint(TENANT), [])),
            "fx": {s: _pairs(content(KEYS.effect(s), [])) for s in self.steps},
            "ckpt": _pairs(content(KEYS.ckpt, [])),
            "outputs": _pairs(content(KEYS.outputs, [])),
            "keys": keys,
        }
        return raw

    TIME_FIELDS = frozenset(
        {"updated_at", "created_at", "registered_at", "cancelled_at", "audit_head", "at", "prev"}
        | {"hash", "job_audit_id", "attempts", "audit_last"}
    )
    ID_FIELDS = frozenset({"dispatch_id"})  # values: ids the actors hold

    def canonical(self, raw: dict[str, Any], ids: dict[str, str] | None = None) -> tuple[Any, ...]:
        """The Redis part of the explored state, every ``fg:*`` key: clock readings (and the
        slot counter, and ``attempts``, which no script reads) dropped, deadlines as
        live/past, sorted-set scores as due/later, dispatch and request ids named by the
        actor that holds them (``ids``). A remembered reply whose request id no actor holds
        is left out: nothing will ever send that request again."""
        t = now_ms()

        def fields(h: dict[str, str]) -> tuple[tuple[str, str], ...]:
            out = []
            for k, v in sorted(h.items()):
                if k in self.TIME_FIELDS:
                    continue
                if k == "completed":  # the completion, without its clock reading
                    v = _AT_MS.sub("", v)
                elif k == "deadline":
                    v = deadline_class(v)
                elif ids is not None and k in self.ID_FIELDS and v:
                    v = "held:" + ids[v] if v in ids else "orphan"
                out.append((k, v))
            return tuple(out)

        out = []
        for name, (kind, c) in sorted(raw["keys"].items()):
            if name == KEYS.marker:
                out.append((name, "marker"))  # its value counts writes
            elif name == QUARANTINE:
                out.append((name, json.loads(c)["cause"]))  # with a clock reading
            elif name.startswith("fg:witness:"):
                out.append((name, "witness"))  # a counter: the explorer keeps its relation
            elif ":req:" in name:
                rid = name.rsplit(":", 1)[1]
                if ids is None:
                    out.append((name, c))
                elif rid in ids:
                    c = _UPLOADS.sub(lambda m: ids.get(m.group(), "orphan"), c)
                    out.append(("req:" + ids[rid], _TIMES.sub("T", c)))
            elif name == KEYS.ckpt:  # name -> its JSON, without the clock reading
                out.append(
                    (name, tuple((k, _AT_MS.sub("", v)) for k, v in sorted(_pairs(c).items())))
                )
            elif name == KEYS.outputs:
                entries = sorted((k, _output_entry(v, ids)) for k, v in _pairs(c).items())
                out.append((name, tuple(entries)))
            elif kind == "hash":
                out.append((name, fields(_pairs(c))))
            elif kind == "stream":
                out.append((name, tuple(fields(_pairs(f)) for _, f in c)))
            elif kind == "zset":
                z = sorted((m, "due" if sc <= t else "later") for m, sc in _zset(c))
                out.append((name, tuple(z)))
            elif kind == "set":
                out.append((name, tuple(sorted(c))))
            else:
                out.append((name, c))
        return tuple(out)

    def advance(self) -> None:
        """Time passes beyond every timer set so far (see the module doc): stored dispatch
        deadlines into the past, every future queue score and hint due."""
        self.wire.touch()
        t = now_ms()
        for s in self.steps:
            d = self.r.hget(KEYS.effect(s), "deadline")
            if d is not None and deadline_class(d) == "live":
                self.r.hset(KEYS.effect(s), "deadline", "1")
                if self.r.zscore(KEYS.attention, KEYS.member(s)) is not None:  # scored by it
                    self.r.zadd(KEYS.attention, {KEYS.member(s): 1})
        for z in (KEYS.relayq, relay_hint(TENANT)):
            for m, sc in self.r.zrange(z, 0, -1, withscores=True):
                if sc > t:
                    self.r.zadd(z, {m: t})

    def authority(self, by: str, gen: int, rid: str) -> Auth:
        """Fence, cancellation and pinned intent as the authorising script's run saw them."""
        fence, cancelled, pinned, was, resolved, acked, phase, quar = self.wire.ran[rid]
        return Auth(by, gen, fence, cancelled, pinned, was, resolved, acked, phase, quar)

    # -- worker: EffectService.perform -> _admit -> _dispatch -> _send -> _record ----------

    async def worker_admit(self, w: WorkerSpec, local: WorkerLocal) -> tuple[WorkerLocal, Effects]:
        """perform() -> _admit(): the admit, its dispatch id = its request id; a re-send (pc
        "resend") carries the same one."""
        pj = payload_json(w.body) if w.mode == "async" else ""
        did = local.did or self.new_id()
        resend = " (sent again)" if local.pc == "resend" else ""
        try:
            v = await self.store.admit(
                KEYS,
                w.step,
                generation=w.gen,
                intent_sha256=digest(w.body),
                adapter=ADAPTER,
                operation=OPERATION,
                worker_id=w.name,
                resolvable=self.dedupes,
                payload_json=pj,
                dispatch_id=did,
            )
        except StoreUnavailable as exc:
            if exc.maybe_applied:  # _admit: sent again with the same id, until the grace
                return replace(local, pc="resend", did=did), Effects(f"admit{resend}: no reply")
            return self._finish(w, local, f"admit{resend}: 503 store_unavailable", retry=True)
        except Rejection as exc:
            done, fx = self._finish(w, local, f"admit{resend}: 409 {exc.code}")
            fx.rejections_seen.append(exc.code)
            return done, fx
        if isinstance(v, Admitted):
            auth = self.authority("admit", w.gen, did)
            res = " resolving" if v.resolving else ""
            return replace(local, pc="admitted", did=v.dispatch_id, auth=auth), Effects(
                f"admit{resend}: admitted{res}"
            )
        if isinstance(v, Queued):  # 202 after the hint
            return replace(local, pc="hint", did=""), Effects(f"admit{resend}: queued {v.state}")
        if isinstance(v, Replay):
            st = v.record.state
            code = "200 replayed" if st == "succeeded" else f"424 replayed {st}"
            done, fx = self._finish(w, local, f"admit{resend}: {code}")
            fx.acks.append(("fx", w.step, st))
            return done, fx
        if isinstance(v, InProgress):
            return self._finish(w, local, f"admit{resend}: 409 effect_in_progress", retry=True)
        assert isinstance(v, Unresolved)
        return self._finish(w, local, f"admit{resend}: 409 outcome_unknown")

    async def worker_give_up(
        self, w: WorkerSpec, local: WorkerLocal
    ) -> tuple[WorkerLocal, Effects]:
        """_admit past its grace: async -> 503 "may have been queued"; sync -> void the admit
        (Store.void; if Redis does not answer, the process retries it later:
        Dispatcher.retry_voids)."""
        if w.mode == "async":
            return self._finish(w, replace(local, did=""), "503 (the call may have been queued)")
        try:
            what = await self.store.void(KEYS, w.step, local.did)
        except StoreUnavailable:
            return replace(local, pc="void"), Effects("void: no reply (retried later)")
        return self._finish(w, replace(local, did=""), f"void: {what}; 503 store_unavailable")

    def _finish(
        self, w: WorkerSpec, local: WorkerLocal, text: str, *, retry: bool = False
    ) -> tuple[WorkerLocal, Effects]:
        # gateway.client: the SDK retries effect_in_progress and adapter_unavailable (and a
        # caller may retry a 503) with the same intent: a new call from the start.
        if retry and local.retries < w.retries:
            return WorkerLocal(retries=local.retries + 1), Effects(text + " (will retry)")
        return replace(local, pc="done", did="", rid=""), Effects(text)

    async def worker_hint(self, w: WorkerSpec, local: WorkerLocal) -> tuple[WorkerLocal, Effects]:
        """perform(respond_async): relay_queued after the admit queued the step (its hint, unless
        the script wrote it); then 202."""
        await self.store.relay_queued(KEYS, w.step, now_ms())
        acks = [("async", w.step, w.gen, digest(w.body))]
        return replace(local, pc="done"), Effects("relay_queued; 202 pending", acks=acks)

    # -- the send, shared by the worker and the relay (_dispatch -> _send) -------------

    def send(self, by: str, step: str, gen: int, pj: str, auth: Auth, outcome: str) -> Effects:
        """_send: re-check the own deadline (late: nothing is sent), then the adapter."""
        if outcome == "late":
            return Effects("deadline passed: not sent")
        delivered = DELIVERS[outcome]
        s = Send(step, gen, pj, digest(json.loads(pj)), delivered, by, auth)
        return Effects(f"send gen={gen} {pj} -> {outcome}", sends=[s])

    async def record(self, step: str, did: str, rid: str, outcome: str) -> tuple[bool | None, str]:
        """_record: one try of record-4 (held; None: no answer, the caller tries again with
        the same request id)."""
        state = RECORDS[outcome]
        result = {"n": 1} if state == "succeeded" else None
        error = None if state == "succeeded" else {"reason": outcome}
        try:
            held, _ = await self.store.record(
                KEYS, step, did, state, result=result, error=error,  # type: ignore[arg-type]
                request_id=rid, retry_due_ms=now_ms() + RELAY_RETRY_MS,
            )  # fmt: skip
        except StoreUnavailable:
            return None, state
        return held, state

    async def worker_record(self, w: WorkerSpec, local: WorkerLocal) -> tuple[WorkerLocal, Effects]:
        """_dispatch: record the outcome, then _respond."""
        rid = local.rid or self.new_id()
        held, state = await self.record(w.step, local.did, rid, local.outcome)
        if held is None:
            if local.tries + 1 < RECORD_TRIES:
                return replace(local, rid=rid, tries=local.tries + 1), Effects(
                    "record: no reply, trying again"
                )
            return replace(local, pc="done", did="", rid=""), Effects("record gave up: 504")
        lost = "" if held else " (lost the step)"
        text = {
            "succeeded": "200 succeeded",
            "failed": "424 effect_failed",
            "released": "502 adapter_unavailable",
            "unknown": "504 outcome_unknown",
        }[state]
        done, fx = self._finish(
            w, local, f"record {state}{lost}: {text}", retry=state == "released"
        )
        if state in ("succeeded", "failed"):  # _respond answers from the outcome, held or not
            fx.acks.append(("fx", w.step, state))
        return done, fx

    # -- relay: Relay.run / _claim / _relay_one -----------------------------------

    async def relay_sweep(self, local: RelayLocal) -> tuple[RelayLocal, Effects]:
        """Relay.run -> Store.sweep, on the one slot a model job lives in: hint every due
        entry of the slot's queue (the same calls Store.sweep makes for that slot)."""
        rows = await self.aclient.zrangebyscore(
            KEYS.relayq, "-inf", now_ms(), start=0, num=100, withscores=True
        )
        await self.store.relay_rehint(KEYS.slot, rows)
        found = ",".join(json.loads(m)[2] for m, _ in rows) or "nothing"
        return replace(local, sweep=False), Effects(f"sweep: {found}")

    async def relay_poll(self, local: RelayLocal) -> tuple[RelayLocal, Effects]:
        """Relay.run: relay_due(now, per_tenant)."""
        try:
            due = await self.store.relay_due(now_ms(), RELAY_PER_TENANT)
        except StoreUnavailable:
            return local, Effects("relay_due: 503")
        batch = tuple(step for _, step, _ in due)
        if not batch:
            return local, Effects("relay_due: nothing")
        return replace(local, pc="batch", batch=batch, idx=0), Effects(
            f"relay_due: {','.join(batch)}"
        )

    def relay_next(self, local: RelayLocal) -> RelayLocal:
        if local.idx + 1 < len(local.batch):
            return RelayLocal(pc="batch", sweep=local.sweep, batch=local.batch, idx=local.idx + 1)
        return RelayLocal(sweep=local.sweep)

    async def relay_claim(self, local: RelayLocal) -> tuple[RelayLocal, Effects]:
        """_relay_one -> _claim: relay_claim (a re-send, pc "resend", carries the same id)."""
        step = local.step
        did = local.did or self.new_id()
        again = " (sent again)" if local.pc == "resend" else ""
        try:
            c = await self.store.relay_claim(KEYS, step, did)
        except StoreUnavailable as exc:
            if exc.maybe_applied and local.tries + 1 < CLAIM_TRIES:
                return replace(local, pc="resend", did=did, tries=local.tries + 1), Effects(
                    f"relay_claim {step}{again}: no reply"
                )
            if exc.maybe_applied:
                return replace(local, pc="void", did=did), Effects(
                    f"relay_claim {step}{again}: no reply, giving up"
                )
            return self.relay_next(local), Effects(f"relay_claim {step}{again}: 503")
        if isinstance(c, str):  # nothing to send: the step left the queue
            return replace(local, pc="unhint", did=""), Effects(
                f"relay_claim {step}{again}: nothing ({c})"
            )
        if isinstance(c, int):  # someone dispatches it: look again after its deadline
            return replace(local, pc="hint", did="", due=c + IN_PROGRESS_SLACK_MS), Effects(
                f"relay_claim {step}{again}: in progress"
            )
        assert isinstance(c, RelayClaim)
        auth = self.authority("relay_claim", c.generation, did)
        pj = payload_json(c.payload)
        claimed = replace(
            local, pc="claimed", did=c.dispatch_id, gen=c.generation, payload=pj, auth=auth
        )
        return claimed, Effects(f"relay_claim {step}{again}: claimed gen={c.generation} {pj}")

    async def relay_void(self, local: RelayLocal) -> tuple[RelayLocal, Effects]:
        """_claim gave up: Store.void (if Redis does not answer: Dispatcher.retry_voids, later)."""
        try:
            what = await self.store.void(KEYS, local.step, local.did)
        except StoreUnavailable:
            return local, Effects("void: no reply (retried later)")
        return self.relay_next(local), Effects(f"void: {what}")

    async def relay_record(self, local: RelayLocal) -> tuple[RelayLocal, Effects]:
        """_relay_one -> Dispatcher.spawn -> _dispatch -> _record; released -> hinted again
        later."""
        rid = local.rid or self.new_id()
        held, state = await self.record(local.step, local.did, rid, local.outcome)
        if held is None:
            if local.tries + 1 < RECORD_TRIES:
                return replace(local, rid=rid, tries=local.tries + 1), Effects(
                    "record: no reply, trying again"
                )
            return replace(local, pc="unhint", did="", rid=""), Effects("record gave up")
        lost = "" if held else " (lost the step)"
        if state == "released":  # AdapterUnavailable: relay_queued(now + RELAY_RETRY_MS)
            return replace(local, pc="requeued", did="", rid="", due=now_ms() + RELAY_RETRY_MS), (
                Effects(f"record {state}{lost}")
            )
        return replace(local, pc="unhint", did="", rid=""), Effects(f"record {state}{lost}")

    async def relay_unhint(self, local: RelayLocal) -> tuple[RelayLocal, Effects]:
        """The step left the queue: relay_left (its hint goes, unless the script removed it)."""
        await self.store.relay_left(KEYS, local.step)
        return self.relay_next(local), Effects(f"relay_left {local.step}")

    async def relay_requeued(self, local: RelayLocal) -> tuple[RelayLocal, Effects]:
        """Released, queued again: relay_queued (its hint, unless the script wrote it)."""
        await self.store.relay_queued(KEYS, local.step, local.due)
        later = "later" if local.due > now_ms() else "now"
        return self.relay_next(local), Effects(f"relay_queued {local.step} ({later})")

    async def relay_hint(self, local: RelayLocal) -> tuple[RelayLocal, Effects]:
        """Held by another dispatch: relay_queued(deadline + slack) (its hint, unless the
        claim's script keeps it with the queue entry)."""
        await self.store.relay_queued(KEYS, local.step, local.due)
        later = "later" if local.due > now_ms() else "now"
        return self.relay_next(local), Effects(f"relay_hint {local.step} ({later})")

    # -- job worker: checkpoints, outputs, completion (CompletionService, OutputService) --

    async def job_step(self, w: JobWorkerSpec, local: JobLocal) -> tuple[JobLocal, Effects]:
        """The job worker's next call: its follow-up after a timeout, else its program's."""
        if local.follow == "abandon":
            return await self.job_abandon(w, local)
        step = w.program[local.at]
        if step == "heartbeat":
            return await self.job_heartbeat(w, local)
        if step == "checkpoint":
            return await self.job_checkpoint(w, local)
        if step == "stage":
            return await self.job_stage(w, local)
        if step == "record":
            return await self.job_record(w, local)
        return await self.job_complete(w, local)

    @staticmethod
    def _next(local: JobLocal, **kw: Any) -> JobLocal:
        return replace(local, at=local.at + 1, follow="", **kw)

    @staticmethod
    def _stop(local: JobLocal, text: str, rejected: str = "") -> tuple[JobLocal, Effects]:
        done = replace(local, stopped=True, follow="", upload="", rid="")
        return done, Effects(text, rejections_seen=[rejected] if rejected else [])

    async def job_heartbeat(self, w: JobWorkerSpec, local: JobLocal) -> tuple[JobLocal, Effects]:
        """handlers: POST .../heartbeat -> Store.heartbeat (a 409 tells the worker to stop)."""
        try:
            fence, _ = await self.store.heartbeat(KEYS, w.gen, w.name)
        except Rejection as exc:
            return self._stop(local, f"heartbeat: 409 {exc.code}", exc.code)
        except StoreUnavailable:
            return self._next(local), Effects("heartbeat: 503")
        return self._next(local), Effects(f"heartbeat: fence {fence}")

    async def job_checkpoint(self, w: JobWorkerSpec, local: JobLocal) -> tuple[JobLocal, Effects]:
        """CompletionService.checkpoint -> JobState.checkpoint (checkpoint-3), no quota; a 503
        (it may have been written) and the worker goes on."""
        try:
            await self.jobstates[id(self.store)].checkpoint(
                KEYS, "c", json.dumps({"by": w.gen}), generation=w.gen, worker_id=w.name
            )
        except Rejection as exc:
            return self._stop(local, f"checkpoint: 409 {exc.code}", exc.code)
        except StoreUnavailable:
            return self._next(local), Effects("checkpoint: 503")
        return self._next(local), Effects("checkpoint: written")

    async def job_stage(self, w: JobWorkerSpec, local: JobLocal) -> tuple[JobLocal, Effects]:
        """OutputService.put -> _stage (output-stage-3); no reply: _abandon_soon."""
        upload = self.new_upload()
        try:
            reply = await self.store.output_stage(
                KEYS, generation=w.gen, name=OUTPUT, object_key=f"t/j/g{w.gen}/{OUTPUT}",
                upload=upload, upload_ms=UPLOAD_MS, presigned=False, worker_id=w.name,
                content_type="text/plain", by="", unaudited="",
            )  # fmt: skip
        except StoreUnavailable:
            return replace(local, follow="abandon", upload=upload), Effects("stage: no reply")
        code = int(reply[0])
        if code == OutputStageReply.REJECTED:
            return self._stop(local, f"stage: 409 {reply[1]}", str(reply[1]))
        if code == OutputStageReply.IN_PROGRESS:
            return self._stop(local, "stage: 409 output_in_progress")
        return self._next(local, upload=upload), Effects("stage: staged")

    async def job_record(self, w: JobWorkerSpec, local: JobLocal) -> tuple[JobLocal, Effects]:
        """OutputService._put, the bytes written: record_upload (output-record-3); no reply:
        _abandon_soon (a no-op if the record ran)."""
        try:
            reply = await self.store.output_record(
                KEYS, generation=w.gen, name=OUTPUT, upload=local.upload, size=5,
                sha256=w.sha256, content_type="text/plain", etag="e", worker_id=w.name,
                abandon=False,
            )  # fmt: skip
        except StoreUnavailable:
            return replace(local, follow="abandon"), Effects("record: no reply")
        code = int(reply[0])
        if code == OutputRecordReply.REJECTED:
            return self._stop(local, f"record: 409 {reply[1]}", str(reply[1]))
        if code == OutputRecordReply.LOST:
            return self._stop(local, "record: 409 output_in_progress (replaced)")
        return self._next(local, upload="", recorded=True), Effects("record: recorded")

    async def job_abandon(self, w: JobWorkerSpec, local: JobLocal) -> tuple[JobLocal, Effects]:
        """_abandon_soon: the upload's claim ends (the request had its 503); if Redis does not
        answer, it is tried again later."""
        try:
            reply = await self.store.output_record(
                KEYS, generation=w.gen, name=OUTPUT, upload=local.upload,
                size=0, sha256="", content_type="", etag="", worker_id="", abandon=True,
            )  # fmt: skip
        except StoreUnavailable:
            return local, Effects("abandon: no reply (tried again later)")
        what = "claim ended" if int(reply[0]) == 0 else "nothing to end"
        return self._stop(local, f"abandon: {what}; 503 store_unavailable")

    async def job_complete(self, w: JobWorkerSpec, local: JobLocal) -> tuple[JobLocal, Effects]:
        """CompletionService.complete -> JobState.complete (complete-3) with one request id;
        no reply: sent once more with it (follow "resend"), then 503."""
        rid = local.rid or self.new_id()
        again = " (sent again)" if local.follow == "resend" else ""
        outputs = [OUTPUT] if local.recorded else []
        sha = hashlib.sha256(json.dumps([outputs, w.gen]).encode()).hexdigest()
        try:
            c = await self.jobstates[id(self.store)].complete(
                KEYS, generation=w.gen, result_json=json.dumps({"by": w.gen}), outputs=outputs,
                body_sha=sha, worker_id=w.name, request_id=rid,
            )  # fmt: skip
        except Rejection as exc:
            return self._stop(local, f"complete{again}: 409 {exc.code}", exc.code)
        except OutputNotStaged:
            return self._stop(local, f"complete{again}: 409 output_not_staged")
        except StoreUnavailable:
            if again:
                return self._stop(local, f"complete{again}: 503")
            return replace(local, follow="resend", rid=rid), Effects("complete: no reply")
        replay = " (replayed)" if c.replayed else ""
        done = replace(self._next(local), rid="")
        fx = Effects(f"complete{again}: 200 completed{replay}",
                     acks=[("completed", w.gen, tuple(outputs))])  # fmt: skip
        return done, fx

    # -- scheduler and operator ----------------------------------------------------------

    async def register(self, gen: int) -> tuple[str, Effects]:
        """handlers: POST /v1/jobs/{job}/generations {"generation": gen}."""
        try:
            reg = await self.store.register(KEYS, gen, None)
        except StoreUnavailable:
            return "retry", Effects(f"register({gen}): 503")
        except Rejection as exc:
            return "next", Effects(f"register({gen}): 409 {exc.code}", rejections_seen=[exc.code])
        code = "201" if reg.created else "200"
        return "next", Effects(f"register({gen}): {code}", acks=[("fence", gen)])

    async def cancel(self) -> tuple[str, Effects]:
        try:
            await self.store.cancel(KEYS)
        except StoreUnavailable:
            return "retry", Effects("cancel: 503")
        except Rejection as exc:  # the job completed: its result stands (not audited)
            return "next", Effects(f"cancel: 409 {exc.code}")
        return "next", Effects("cancel: 200", acks=[("cancelled",)])

    async def resolve(self, step: str, delivered: bool) -> Effects:
        """POST .../resolve: the operator says what the downstream shows (truthfully)."""
        outcome = "delivered" if delivered else "not_delivered"
        result = {"n": 1} if delivered else None
        try:
            rec = await self.store.resolve(
                KEYS, step, delivered=delivered, result=result, operator="op", by="op"
            )
        except StoreUnavailable:
            return Effects(f"resolve {step} {outcome}: 503")
        except (EffectNotUnknown, NotFound) as exc:
            return Effects(f"resolve {step} {outcome}: 409 {exc.code}")
        acks = [("fx", step, rec.state)] if rec.state == "succeeded" else []
        return Effects(f"resolve {step} {outcome}: {rec.state}", acks=acks)


# Test-side helpers (not protocol): the state of every key in one reply, and back.
# KEYS: job, steps, audit, relay, feed, fx... (Driver.keys order)
_READ_LUA = """
local out = {}
for _, k in ipairs(redis.call('KEYS', 'fg:*')) do
  local kind = redis.call('TYPE', k)['ok']
  local c
  if kind == 'hash' then c = redis.call('HGETALL', k)
  elseif kind == 'stream' then c = redis.call('XRANGE', k, '-', '+')
  elseif kind == 'zset' then c = redis.call('ZRANGE', k, 0, -1, 'WITHSCORES')
  elseif kind == 'set' then c = redis.call('SMEMBERS', k)
  else c = redis.call('GET', k) end
  out[#out + 1] = k
  out[#out + 1] = kind
  out[#out + 1] = redis.call('DUMP', k)
  out[#out + 1] = c
end
return out
"""
_RESTORE_LUA = """
local cur = redis.call('KEYS', 'fg:*')
if #cur > 0 then redis.call('DEL', unpack(cur)) end
for i = 1, #ARGV, 2 do redis.call('RESTORE', ARGV[i], 0, ARGV[i + 1]) end
return 1
"""
_TIMES = re.compile(r"\d{13}(-\d+)?")  # ms clock readings and stream ids in a remembered reply
_AT_MS = re.compile(r'"at_ms":\d+,?')  # a checkpoint's or a completion's clock reading
_UPLOADS = re.compile(r"u-\d+")  # upload ids (Driver.new_upload)


def _output_entry(text: str, ids: dict[str, str] | None) -> tuple[tuple[str, Any], ...]:
    """An output entry (output-stage-3 / output-record-3), canonical: clock readings dropped,
    the deadline live/past/0, the upload id named by its holder."""
    e = json.loads(text)
    e.pop("staged_ms", None)
    e.pop("recorded_ms", None)
    e["deadline"] = deadline_class(str(e.get("deadline", 0)))
    if ids is not None:
        e["upload"] = ids.get(e.get("upload", ""), "orphan")
    return tuple(sorted(e.items()))


def _zset(flat: list[str]) -> list[tuple[str, float]]:
    return [(m, float(sc)) for m, sc in zip(flat[::2], flat[1::2], strict=True)]


def _pairs(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def deadline_class(v: str) -> str:
    n = int(v or 0)
    return "0" if n == 0 else ("past" if n < 10**12 else "live")


async def _refuse_only(slot: int, counter: int, seen: int) -> None:
    """RedisLink.went_back as 4a7c224 had it: the call is refused (503), Redis not quarantined."""


def counter_of(raw: dict[str, Any]) -> int | None:
    """The job slot's write counter in a raw state (None: no marker, the slot fails closed)."""
    kind_c = raw["keys"].get(KEYS.marker)
    return None if kind_c is None else int(kind_c[1])


def witness_of(raw: dict[str, Any], data_dir: int) -> int:
    """A data dir's witness counter in a raw state (0: never raised)."""
    for name, (_, c) in raw["keys"].items():
        if name.startswith("fg:witness:") and name.endswith(f":dir{data_dir + 1}"):
            return int(c)
    return 0


class _Touching:
    """The store's async client: any command through it first puts the explorer's snapshot
    back (:meth:`Wire.touch`) and makes the wire's cached read stale."""

    def __init__(self, client: aioredis.Redis, wire: Wire) -> None:
        self._client = client
        self._wire = wire

    def __getattr__(self, name: str) -> Any:
        self._wire.touch(writes=name not in _READS_ONLY)
        return getattr(self._client, name)


# the store's commands that change nothing in Redis (the wire's read stays valid)
_READS_ONLY = frozenset(
    {"xrange", "xrevrange", "smembers", "zrangebyscore", "zrange", "zscore", "get", "hget",
     "hgetall", "hmget", "exists", "time", "script_load", "connection_pool"}
)  # fmt: skip


Step = Callable[[], Awaitable[tuple[Any, Effects]]]
__all__ = ["Driver", "FencegateError"]
