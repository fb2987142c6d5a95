"""The one place where a model actor's step becomes a call of the real store.

Re-point this module when the store API, the scripts or the relay change; the
explorer (:mod:`tests.model.explore`) and the invariants
(:mod:`tests.model.invariants`) only see what the step functions below return.

Every step is ONE call of :class:`gateway.store.Store` against a real
redis-server (at most one Lua script per step: each script is atomic, so the
interleavings are over steps), or one gateway-side action (a downstream send).
Each step function names the service code it mirrors (``gateway/service.py``
as of d36082e).

Faults on the wire are injected by :class:`Wire`, which stands where
:class:`gateway.batching.Batcher` stands: ``lost`` runs the script, drops the
reply and runs the very same EVALSHA again (what the batcher does after a
connection error: the script already ran), ``timeout`` runs the script and
raises a timeout (the caller sees ``StoreUnavailable`` and does not re-send).

Time. The scripts read the Redis clock (``TIME``); they get a dispatch timeout
of one hour, so no deadline passes on its own during a run, and the explorer's
``advance`` action makes time pass by rewriting every stored dispatch deadline
into the past (:func:`Driver.expire_deadlines`) and marking the gateway-side
deadlines of the steps in flight as passed. The only other clocks are the
gateway's (relay queue scores, the relay's admit grace): they are logical
milliseconds owned by the explorer (``now``), so every run is exact and
reproducible.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

import gateway.store as store_module
from gateway.errors import (
    EffectNotUnknown,
    FencegateError,
    NotFound,
    Rejection,
    StoreUnavailable,
)
from gateway.intents import intent_digest
from gateway.keys import RELAY, JobKeys, audit_feed
from gateway.records import Admitted, InProgress, Queued, RelayClaim, Replay
from gateway.records import Unknown as UnknownVerdict
from gateway.store import Store

TENANT, JOB = "t", "j"
KEYS = JobKeys(TENANT, JOB)
ADAPTER, OPERATION = "hook", "refund"

REDIS_DISPATCH_MS = 3_600_000  # what the scripts get: deadlines never pass by themselves
DISPATCH_MS = 30_000  # fencing.dispatch_timeout_seconds, on the logical clock
ADMIT_GRACE_MS = 1_000  # EffectService(admit_grace_seconds=1): the smallest the app allows
RELAY_RETRY_MS = 1_000  # _relay_one: a released step is queued again 1 s later
IN_PROGRESS_SLACK_MS = 50  # _relay_one: "look again after its deadline" + 50 ms
RECORD_TRIES = 6  # _record: one try and len(_RECORD_BACKOFF) retries
RELAY_BATCH = 32  # relay_forever(batch=32)
RETENTION_S = 7 * 86_400

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
    # sync:  start -> admitted -> sent -> done        async: start -> enqueued -> done
    pc: str = "start"
    did: str = ""
    auth: Auth | None = None
    late: bool = False  # its gateway-side (monotonic) deadline has passed
    outcome: str = ""
    tries: int = 0
    retries: int = 0


@dataclass(frozen=True)
class RelayLocal:
    # idle -> batch -> (claimed -> sent ->) drop | reenq -> batch | idle
    pc: str = "idle"
    batch: tuple[tuple[str, int], ...] = ()  # (step, queued_ms) as relay_due returned them
    idx: int = 0
    did: str = ""
    gen: int = 0
    payload: str = ""
    auth: Auth | None = None
    late: bool = False
    outcome: str = ""
    tries: int = 0
    due: int = 0

    @property
    def step(self) -> str:
        return self.batch[self.idx][0]


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
    """Where :class:`gateway.batching.Batcher` stands: every script of the store comes here."""

    def __init__(self, client: redis.Redis, names: dict[str, str], snapshot: Callable[[], Any]):
        self.r = client
        self.names = names  # sha -> script name
        self.snapshot = snapshot
        self.mode = "ok"
        self.replies: list[tuple[str, list[Any]]] = []  # every reply Redis gave, in order
        self.resends: list[Resend] = []

    def _eval(self, sha: str, source: str | None, keys: Sequence[str], args: Sequence[str]) -> Any:
        try:
            reply = self.r.evalsha(sha, len(keys), *keys, *args)
        except NoScriptError:
            assert source is not None
            reply = self.r.eval(source, len(keys), *keys, *args)
        self.replies.append((self.names.get(sha, sha), reply))
        return reply

    async def evalsha(
        self, sha: str, source: str | None, keys: Sequence[str], args: Sequence[str]
    ) -> Any:
        mode, self.mode = self.mode, "ok"  # a fault hits one script call
        reply = self._eval(sha, source, keys, args)
        if mode == "lost":  # the connection dropped after the script ran: the batcher re-sends
            before = self.snapshot()
            second = self._eval(sha, source, keys, args)
            self.resends.append(Resend(self.names[sha], reply, second, before, self.snapshot()))
            return second
        if mode == "timeout":  # the script ran; the caller gives up and never re-sends
            raise RedisTimeoutError("model: no reply within redis.timeout_seconds")
        return reply

    async def execute(self, *args: Any) -> Any:  # Batcher.execute: the audit feed copy
        return self.r.execute_command(*args)

    async def aclose(self) -> None:
        pass


# Which replies of which script mean "an audit entry was written" (I-audit counts them).
def writes_audit(script: str, reply: list[Any]) -> bool:
    code = int(reply[0])
    if code == 9:  # every rejection is audited by the script that decided it
        return True
    return script == "resolve-4" and code == 0  # operator_resolved_<outcome>


def verdict(script: str, reply: list[Any]) -> tuple[Any, ...]:
    """What a caller concludes from a script's reply (Store's conversion, in short): a
    re-sent call must conclude the same (I-resend). Clock readings and audit ids are left
    out (a second audit entry is I-audit's business)."""
    code = int(reply[0])
    if code == 9:  # rejected: reason, presented, current
        return (9, *reply[1:4])
    if script == "admit-5":
        if code == 0:  # Admitted(dispatch_id, fence, deadline, resolving)
            return (0, *reply[1:])
        if code in (4, 5):  # Queued: 202 either way ({4} new, {5} accepted again)
            return ("queued",)
        if code == 2:  # InProgress(retry_after_ms = deadline - now)
            return (2,)
        rec = dict(zip(reply[1::2], reply[2::2], strict=True))  # Replay / Unknown
        return (code, rec.get("state"), rec.get("generation"), rec.get("intent_sha256"))
    if script in ("register-3", "cancel-2"):  # 201 / 200 "already": the documented retry
        return ("ok", *reply[1:])
    return tuple(reply)


# -- the driver -------------------------------------------------------------------------


class Driver:
    """A real Store on a real Redis, and the step functions of every actor."""

    def __init__(self, url: str, *, dedupes: bool, steps: Sequence[str]) -> None:
        self.r = redis.Redis.from_url(url, decode_responses=True)
        # DUMP payloads are bytes: decoded with surrogateescape they survive the round trip
        # as str (and hiredis does the decoding)
        self.rb = redis.Redis.from_url(
            url, decode_responses=True, encoding_errors="surrogateescape"
        )
        self._read_sha = self.rb.script_load(_READ_LUA)
        self._restore_sha = self.rb.script_load(_RESTORE_LUA)
        self.prior: dict[str, Any] = {}  # Redis before the step (set by the explorer)
        self.aclient = aioredis.Redis.from_url(url, decode_responses=True)
        self.store = Store(
            self.aclient,
            registration="required",
            dispatch_timeout_ms=REDIS_DISPATCH_MS,
            retention_seconds=RETENTION_S,
        )
        self.steps = tuple(steps)
        self.dedupes = dedupes  # the adapter's capabilities: dedupes_by_key, no lookup
        names = {sha: name for name, sha in self.store._shas.items()}
        self.wire = Wire(self.r, names, self.raw_state)
        self.store._batcher = self.wire  # type: ignore[assignment]
        # Dispatch ids: unique per run and recognisable (the explorer maps them to holders).
        self._ids = itertools.count(1)
        self._saved_id = store_module._dispatch_id
        store_module._dispatch_id = lambda: f"d-{next(self._ids)}"
        # every key a run can write (the slot marker is written once and never restored)
        self.keys = (
            KEYS.job,
            KEYS.steps,
            KEYS.audit,
            RELAY,
            audit_feed(TENANT),
            *(KEYS.effect(s) for s in self.steps),
        )

    def mutate(self, script: str, old: str, new: str) -> None:
        """Load a deliberately broken variant of one script (mutation test of the explorer)."""
        src = self.store._sources[script]
        if old not in src:
            raise LookupError(f"{old!r} is not in {script}")
        import hashlib

        src = src.replace(old, new)
        sha = hashlib.sha1(src.encode(), usedforsecurity=False).hexdigest()
        self.store._sources[script] = src
        self.store._shas[script] = sha
        self.wire.names[sha] = script

    async def setup(self) -> None:
        """The initial state: the slot's durability marker, generation 1 registered."""
        self.r.delete(*self.keys)
        self.r.set(KEYS.marker, "1")
        await self.store.register(KEYS, 1, None)

    async def aclose(self) -> None:
        store_module._dispatch_id = self._saved_id
        await self.aclient.aclose()
        self.r.close()
        self.rb.close()

    # -- state of Redis: snapshot, restore, canonical view -------------------------------

    def read(self) -> tuple[dict[str, Any], dict[str, str]]:
        """Redis as data (as :meth:`raw_state`) and a DUMP of every key: one command."""
        n = len(self.keys)
        reply = self.rb.evalsha(self._read_sha, n, *self.keys)
        dumps = {k: v for k, v in zip(self.keys, reply[:n], strict=True) if v is not None}
        job, steps, audit, relay, feed, *fx = reply[n:]
        raw = {
            "job": _pairs(job),
            "steps": set(steps),
            "audit": [(i, _pairs(f)) for i, f in audit],
            "relay": [(m, float(sc)) for m, sc in zip(relay[::2], relay[1::2], strict=True)],
            "feed": [(i, _pairs(f)) for i, f in feed],
            "fx": {st: _pairs(h) for st, h in zip(self.steps, fx, strict=True)},
        }
        return raw, dumps

    def restore(self, dumps: dict[str, str]) -> None:
        """Put back a snapshot taken by :meth:`read`: one command."""
        args = [dumps.get(k, "").encode("utf-8", "surrogateescape") for k in self.keys]
        self.rb.evalsha(self._restore_sha, len(self.keys), *self.keys, *args)

    def _queue_raw(self, pipe: Any) -> None:
        pipe.hgetall(KEYS.job)
        pipe.smembers(KEYS.steps)
        pipe.xrange(KEYS.audit)
        pipe.zrange(RELAY, 0, -1, withscores=True)
        pipe.xrange(audit_feed(TENANT))
        for s in self.steps:
            pipe.hgetall(KEYS.effect(s))

    def _raw(self, replies: list[Any]) -> dict[str, Any]:
        job, steps, audit, relay, feed, *fx = replies
        return {
            "job": job,
            "steps": steps,
            "audit": audit,
            "relay": relay,
            "feed": feed,
            "fx": dict(zip(self.steps, fx, strict=True)),
        }

    def raw_state(self) -> dict[str, Any]:
        """Every key the protocol writes, as data (timestamps still in)."""
        pipe = self.r.pipeline(transaction=False)
        self._queue_raw(pipe)
        return self._raw(pipe.execute())

    # fields whose value is a clock reading or a hash over one: ignored in the state
    TIME_FIELDS = frozenset(
        {"updated_at", "created_at", "registered_at", "cancelled_at", "audit_head", "at", "prev"}
        | {"hash", "job_audit_id", "attempts"}
    )

    ID_FIELDS = frozenset({"dispatch_id"})  # values: ids the actors hold

    def canonical(
        self, raw: dict[str, Any], now: int, ids: dict[str, str] | None = None
    ) -> tuple[Any, ...]:
        """The Redis part of the explored state: clock readings dropped, deadlines as
        live/past, queue scores relative to the logical now, dispatch ids named by the actor
        that holds them (``ids``; any other id is an orphan). (``attempts`` is dropped too: no
        script reads it, and relay retries would otherwise count without bound.)"""

        def fields(h: dict[str, str]) -> tuple[tuple[str, str], ...]:
            out = []
            for k, v in sorted(h.items()):
                if k in self.TIME_FIELDS:
                    continue
                if k == "deadline":
                    v = deadline_class(v)
                elif ids is not None and k in self.ID_FIELDS and v:
                    v = "held:" + ids[v] if v in ids else "orphan"
                out.append((k, v))
            return tuple(out)

        return (
            fields(raw["job"]),
            tuple(sorted(raw["steps"])),
            tuple(fields(e) for _, e in raw["audit"]),
            tuple(sorted((json.loads(m)[2], int(s) - now) for m, s in raw["relay"])),
            tuple(fields(e) for _, e in raw["feed"]),
            tuple((s, fields(h)) for s, h in raw["fx"].items()),
        )

    def expire_deadlines(self) -> None:
        """Time passes beyond every dispatch deadline stored so far (see the module doc)."""
        for s in self.steps:
            d = self.r.hget(KEYS.effect(s), "deadline")
            if d is not None and deadline_class(d) == "live":
                self.r.hset(KEYS.effect(s), "deadline", "1")

    def before(self, step: str) -> tuple[str, bool]:
        """The step's state (and whether an operator resolved it) before a script runs."""
        h = self.prior["fx"][step]
        return h.get("state") or "-", bool(h.get("resolved_by"))

    def authority(self, by: str, gen: int, step: str, before: tuple[str, bool]) -> Auth:
        """Fence, cancellation and pinned intent right after an authorising script ran."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hmget(KEYS.job, "fence", "cancelled")
        pipe.hget(KEYS.effect(step), "intent_sha256")
        (fence, cancelled), pinned = pipe.execute()
        return Auth(by, gen, int(fence or 0), cancelled == "1", pinned or "", *before)

    # -- worker: EffectService.perform -> _dispatch -> _send -> _record -> _respond ---------

    async def worker_admit(self, w: WorkerSpec, local: WorkerLocal) -> tuple[WorkerLocal, Effects]:
        """perform(): the admit (async: with the payload, after relay_enqueue)."""
        pj = payload_json(w.body) if w.mode == "async" else ""
        before = self.before(w.step)
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
            )
        except StoreUnavailable:
            return self._finish(w, local, "503 store_unavailable", retry=True)
        except Rejection as exc:
            fx = self._finish(w, local, f"409 {exc.code}")
            fx[1].rejections_seen.append(exc.code)
            return fx
        if isinstance(v, Admitted):
            auth = self.authority("admit", w.gen, w.step, before)
            res = " resolving" if v.resolving else ""
            return replace(local, pc="admitted", did=v.dispatch_id, auth=auth), Effects(
                f"admitted{res}"
            )
        if isinstance(v, Queued):
            acks = [("async", w.step, w.gen, digest(w.body))]
            return replace(local, pc="done"), Effects(f"202 {v.state}", acks=acks)
        if isinstance(v, Replay):
            st = v.record.state
            code = "200 replayed" if st == "succeeded" else f"424 replayed {st}"
            done, fx = self._finish(w, local, code)
            fx.acks.append(("fx", w.step, st))
            return done, fx
        if isinstance(v, InProgress):
            return self._finish(w, local, "409 effect_in_progress", retry=True)
        assert isinstance(v, UnknownVerdict)
        return self._finish(w, local, "409 outcome_unknown")

    def _finish(
        self, w: WorkerSpec, local: WorkerLocal, text: str, *, retry: bool = False
    ) -> tuple[WorkerLocal, Effects]:
        # gateway.client: the SDK retries effect_in_progress and adapter_unavailable (and a
        # caller may retry a 503) with the same intent: a new call from the start.
        if retry and local.retries < w.retries:
            return WorkerLocal(retries=local.retries + 1), Effects(text + " (will retry)")
        return replace(local, pc="done"), Effects(text)

    async def worker_enqueue(self, w: WorkerSpec, now: int) -> Effects:
        """perform(respond_async=True) on d36082e: relay_enqueue BEFORE the admit."""
        await self.store.relay_enqueue(KEYS, w.step, now)
        return Effects("relay_enqueue")

    # -- the send, shared by the worker and the relay (_dispatch -> _send) -------------

    def send(self, by: str, step: str, gen: int, pj: str, auth: Auth, outcome: str) -> Effects:
        """_send: re-check the own deadline (late: nothing is sent), then the adapter."""
        if outcome == "late":
            return Effects("deadline passed: not sent")
        delivered = DELIVERS[outcome]
        s = Send(step, gen, pj, digest(json.loads(pj)), delivered, by, auth)
        return Effects(f"send gen={gen} {pj} -> {outcome}", sends=[s])

    async def record(
        self, step: str, did: str, outcome: str
    ) -> tuple[bool | None, str]:  # held (None: store unavailable), state
        """_record: one try of record-1 (the caller retries StoreUnavailable)."""
        state = RECORDS[outcome]
        result = {"n": 1} if state == "succeeded" else None
        error = None if state == "succeeded" else {"reason": outcome}
        try:
            held = await self.store.record(KEYS, step, did, state, result=result, error=error)  # type: ignore[arg-type]
        except StoreUnavailable:
            return None, state
        return held, state

    async def worker_record(self, w: WorkerSpec, local: WorkerLocal) -> tuple[WorkerLocal, Effects]:
        """_dispatch: record the outcome, then _respond."""
        held, state = await self.record(w.step, local.did, local.outcome)
        if held is None:
            if local.tries + 1 < RECORD_TRIES:
                return replace(local, tries=local.tries + 1), Effects("record: 503, retrying")
            return replace(local, pc="done"), Effects("record gave up: 504 unrecorded")
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

    # -- relay: EffectService.relay_forever / _relay_one ------------------------------

    async def relay_poll(self, local: RelayLocal, now: int) -> tuple[RelayLocal, Effects]:
        """relay_forever: relay_due(now, batch)."""
        try:
            due = await self.store.relay_due(now, RELAY_BATCH)
        except StoreUnavailable:
            return local, Effects("relay_due: 503")
        batch = tuple((step, queued) for _, step, queued in due)
        if not batch:
            return local, Effects("relay_due: nothing")
        steps = ",".join(s for s, _ in batch)
        return replace(local, pc="batch", batch=batch, idx=0), Effects(f"relay_due: {steps}")

    def relay_next(self, local: RelayLocal) -> RelayLocal:
        if local.idx + 1 < len(local.batch):
            return replace(RelayLocal(), pc="batch", batch=local.batch, idx=local.idx + 1)
        return RelayLocal()

    async def relay_claim(self, local: RelayLocal, now: int) -> tuple[RelayLocal, Effects]:
        """_relay_one: relay_claim, then what its answer means."""
        step, queued = local.batch[local.idx]
        before = self.before(step)
        try:
            c = await self.store.relay_claim(KEYS, step)
        except StoreUnavailable:  # relay_forever: `except StoreUnavailable: due = []`
            return RelayLocal(), Effects(f"relay_claim {step}: 503")
        if isinstance(c, str):
            if c == "" and now - queued < ADMIT_GRACE_MS:  # a young entry: its admit may land
                return self.relay_next(local), Effects(f"relay_claim {step}: no record, young")
            return replace(local, pc="drop"), Effects(f"relay_claim {step}: nothing ({c!r})")
        if isinstance(c, int):  # someone dispatches it: look again after its deadline
            due = now + DISPATCH_MS + IN_PROGRESS_SLACK_MS
            return replace(local, pc="reenq", due=due), Effects(f"relay_claim {step}: in progress")
        assert isinstance(c, RelayClaim)
        auth = self.authority("relay_claim", c.generation, step, before)
        pj = payload_json(c.payload)
        return replace(
            local, pc="claimed", did=c.dispatch_id, gen=c.generation, payload=pj, auth=auth
        ), Effects(f"relay_claim {step}: claimed gen={c.generation} {pj}")

    async def relay_record(self, local: RelayLocal) -> tuple[RelayLocal, Effects]:
        """_relay_one -> _spawn -> _dispatch -> _record; released -> queued again 1 s later."""
        held, state = await self.record(local.step, local.did, local.outcome)
        if held is None:
            if local.tries + 1 < RECORD_TRIES:
                return replace(local, tries=local.tries + 1), Effects("record: 503, retrying")
            return replace(local, pc="drop"), Effects("record gave up (unrecorded)")
        lost = "" if held else " (lost the step)"
        if state == "released":  # AdapterUnavailable: relay_enqueue(now + 1000)
            return replace(local, pc="reenq", due=-1), Effects(f"record {state}{lost}")
        return replace(local, pc="drop"), Effects(f"record {state}{lost}")

    async def relay_drop(self, local: RelayLocal) -> tuple[RelayLocal, Effects]:
        await self.store.relay_drop(KEYS, local.step)
        return self.relay_next(local), Effects(f"relay_drop {local.step}")

    async def relay_reenqueue(self, local: RelayLocal, now: int) -> tuple[RelayLocal, Effects]:
        due = now + RELAY_RETRY_MS if local.due == -1 else local.due
        await self.store.relay_enqueue(KEYS, local.step, due)
        return self.relay_next(local), Effects(f"relay_enqueue {local.step} +{due - now}ms")

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
        return "next", Effects("cancel: 200", acks=[("cancelled",)])

    async def resolve(self, step: str, delivered: bool) -> Effects:
        """POST .../resolve: the operator says what the downstream shows (truthfully)."""
        outcome = "delivered" if delivered else "not_delivered"
        try:
            rec = await self.store.resolve(
                KEYS,
                step,
                delivered=delivered,
                result={"n": 1} if delivered else None,
                operator="op",
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
for i, k in ipairs(KEYS) do out[i] = redis.call('DUMP', k) or false end
local n = #KEYS
out[n + 1] = redis.call('HGETALL', KEYS[1])
out[n + 2] = redis.call('SMEMBERS', KEYS[2])
out[n + 3] = redis.call('XRANGE', KEYS[3], '-', '+')
out[n + 4] = redis.call('ZRANGE', KEYS[4], 0, -1, 'WITHSCORES')
out[n + 5] = redis.call('XRANGE', KEYS[5], '-', '+')
for i = 6, n do out[n + i] = redis.call('HGETALL', KEYS[i]) end
return out
"""
_RESTORE_LUA = """
redis.call('DEL', unpack(KEYS))
for i, k in ipairs(KEYS) do
  if ARGV[i] ~= '' then redis.call('RESTORE', k, 0, ARGV[i]) end
end
return 1
"""


def _pairs(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def deadline_class(v: str) -> str:
    n = int(v or 0)
    return "0" if n == 0 else ("past" if n < 10**12 else "live")


Step = Callable[[], Awaitable[tuple[Any, Effects]]]
__all__ = ["Driver", "FencegateError"]
