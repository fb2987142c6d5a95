"""Exhaustive exploration of the protocol: every interleaving of the real scripts, small bounds.

    python -m tests.model.explore                      # the default bound (as in make test)
    python -m tests.model.explore --bound large        # the larger one (make chaos)
    python -m tests.model.explore --bound holes        # the scenarios of holes 1-3
    python -m tests.model.explore --scenario takeover  # one scenario of any bound
    python -m tests.model.explore --bound restore --marks own   # the restore scenarios with
                                                    # marks in memory only (no quarantine)

A state is (Redis, canonical: clock readings dropped, dispatch ids named by the
actor that holds them; every actor's program counter and memory; the
downstream's log; the verdicts callers saw; the budgets left). Breadth-first
from the initial state, each distinct state once (memoized by a hash), so the
first violation of each invariant comes with a shortest trace. Between
branches Redis is put back from a DUMP/RESTORE snapshot of every key a run
writes (``--restore replay`` replays the path from the initial state instead,
for comparison).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from structlog.testing import capture_logs

from gateway.store.embedded import EmbeddedRedis
from tests.model import invariants as inv
from tests.model.driver import (
    MARKS,
    Driver,
    Effects,
    JobLocal,
    JobWorkerSpec,
    RelayLocal,
    Send,
    WorkerLocal,
    WorkerSpec,
    counter_of,
    deadline_class,
    now_ms,
    payload_json,
    witness_of,
    writes_audit,
)


@dataclass(frozen=True)
class Scenario:
    name: str
    workers: tuple[WorkerSpec, ...]
    gens: int = 2  # generation 1 is registered at the start; the scheduler registers 2..gens
    steps: tuple[str, ...] = ("s1",)
    relays: int = 1
    resolves: int = 0  # operator resolutions (of an unknown / overdue step), truthful
    cancel: bool = False
    outcomes: tuple[str, ...] = ("ok", "refused", "timeout")
    faults: int = 0  # budget of wire faults (on script calls)
    fault_kinds: tuple[str, ...] = ("lost", "timeout")
    crashes: int = 0  # budget of gateway crashes (a worker's request dies; a relay restarts)
    advances: int = 2  # budget of "time passes beyond every timer"
    dedupes: bool = False  # the downstream deduplicates by key (the adapter can resolve)
    hole: str = ""  # what this scenario is about (README)
    # Two gateway processes: the actors named here run on P2, every other on P1.
    on_p2: tuple[str, ...] = ()
    marks: str = "shared"  # the processes' slot marks (tests.model.driver.MARKS)
    restores: int = 0  # budget of "Redis goes back to the backup"
    backup: str = "initial"  # the backup: the initial state, or "any" state of the path
    witness: bool = False  # each data dir's witness tick (RedisLink.witness) is an action
    # Workers on the job's own state: checkpoints, an output, the completion (after the
    # effect workers, before the relays, in the actors' order)
    jobs: tuple[JobWorkerSpec, ...] = ()
    # Violations this scenario shows on purpose (a documented window): (invariant, a part of
    # the signature, required). Not counted as failures; a required one that is no longer
    # found is (the docs describe it).
    expect: tuple[tuple[str, str, bool], ...] = ()

    @property
    def processes(self) -> int:
        return 2 if self.on_p2 or self.restores else 1


def w(
    name: str, gen: int, mode: str, amount: int, step: str = "s1", retries: int = 0
) -> WorkerSpec:
    return WorkerSpec(name, gen, step, mode, (("amount", amount),), retries)


@dataclass(frozen=True)
class World:
    """The model's side of a state (Redis is the other)."""

    locals: tuple[Any, ...]  # per actor, in Actors order
    sends: tuple[Send, ...] = ()
    acks: frozenset[tuple[Any, ...]] = frozenset()
    audit_expected: int = 0
    audited: frozenset[str] = frozenset()  # request ids whose script wrote an audit entry
    faults: int = 0
    crashes: int = 0
    advances: int = 0
    marks: tuple[Any, ...] = ()  # every process's slot marks (Driver.get_marks)
    backups: int = 0  # budget of "the backup is taken now" (backup "any")
    backup: tuple[dict[str, str], dict[str, Any]] | None = None  # its (DUMPs, raw state)
    restores: int = 0
    restored: bool = False
    lost: bool = False  # the restore lost writes (Redis at the restore != the backup)
    lost_acks: frozenset[tuple[Any, ...]] = frozenset()  # acknowledged, gone with the restore
    ticked: frozenset[int] = frozenset()  # data dirs whose witness ticked since the backup
    ticked_after: frozenset[int] = frozenset()  # ... since the restore


@dataclass(frozen=True)
class Move:
    actor: int
    kind: str
    arg: Any = None
    fault: str = "ok"

    @property
    def mid(self) -> tuple[Any, ...]:
        return (self.actor, self.kind, self.arg, self.fault)


@dataclass
class Violation:
    invariant: str
    signature: str  # the kind of breakage: the shortest trace of each kind is kept
    message: str
    trace: list[str]


@dataclass
class Report:
    scenario: str
    states: int = 0
    transitions: int = 0
    checks: int = 0
    quiescent: int = 0
    depth: int = 0
    seconds: float = 0.0
    violations: dict[tuple[str, str], Violation] = field(default_factory=dict)
    truncated: bool = False
    quarantined: int = 0  # states in which Redis is quarantined (fg:quarantine)
    expect: tuple[tuple[str, str, bool], ...] = ()

    def unexpected(self) -> list[tuple[str, str]]:
        """Violations outside the scenario's documented window."""
        return [
            (i, sig) for i, sig in self.violations
            if not any(i == ei and part in sig for ei, part, _ in self.expect)
        ]  # fmt: skip

    def missing(self) -> list[tuple[str, str]]:
        """Required documented violations that were not found."""
        return [
            (ei, part) for ei, part, required in self.expect
            if required and not any(i == ei and part in sig for i, sig in self.violations)
        ]  # fmt: skip

    @property
    def failed(self) -> bool:
        return bool(self.unexpected() or self.missing())

    def summary(self) -> str:
        v = ", ".join(sorted({i for i, _ in self.violations})) or "none"
        cut = " (TRUNCATED)" if self.truncated else ""
        q = f", {self.quarantined} quarantined" if self.quarantined else ""
        return (
            f"{self.scenario}: {self.states} states, {self.transitions} transitions, "
            f"{self.checks} invariant checks, {self.quiescent} quiescent{q}, depth {self.depth}, "
            f"{self.seconds:.1f} s{cut}; violations: {v}"
        )


class Explorer:
    def __init__(self, scn: Scenario, driver: Driver) -> None:
        self.scn = scn
        self.d = driver
        # actors: workers, job workers, relays, scheduler, canceller, operator
        self.names: list[str] = [x.name for x in scn.workers] + [x.name for x in scn.jobs]
        self.names += [f"relay{i + 1}" if scn.relays > 1 else "relay" for i in range(scn.relays)]
        self.names += ["scheduler", "canceller", "operator"]
        self.n_workers = len(scn.workers)
        self.n_jobs = self.n_workers + len(scn.jobs)  # the job workers' indices end here
        self.sched = self.n_jobs + scn.relays
        self.proc = [1 if n in scn.on_p2 else 0 for n in self.names]  # actor -> process
        unknown = set(scn.on_p2) - set(self.names)
        if unknown:
            raise ValueError(f"{scn.name}: no actor {sorted(unknown)}")
        self.payloads: dict[tuple[int, str], frozenset[str]] = {}
        for x in scn.workers:
            k = (x.gen, x.step)
            self.payloads[k] = self.payloads.get(k, frozenset()) | {payload_json(x.body)}

    def initial(self, dumps: dict[str, str], raw: dict[str, Any]) -> World:
        locals_: list[Any] = [WorkerLocal() for _ in self.scn.workers]
        locals_ += [JobLocal() for _ in self.scn.jobs]
        locals_ += [RelayLocal() for _ in range(self.scn.relays)]
        locals_ += [2, not self.scn.cancel, self.scn.resolves]
        initial_backup = self.scn.restores and self.scn.backup == "initial"
        return World(
            tuple(locals_),
            acks=frozenset({("fence", 1)}),
            audit_expected=1,  # the registration of generation 1 (Driver.setup)
            faults=self.scn.faults,
            crashes=self.scn.crashes,
            advances=self.scn.advances,
            marks=self.d.get_marks(),
            backups=1 if self.scn.restores and not initial_backup else 0,
            backup=(dumps, raw) if initial_backup else None,
            restores=self.scn.restores,
        )

    # -- state key --------------------------------------------------------------------

    def holders(self, world: World) -> dict[str, str]:
        """Dispatch and request ids an actor holds -> its name."""
        out = {}
        for i, loc in enumerate(world.locals):
            for attr in ("did", "rid", "upload"):
                if x := getattr(loc, attr, ""):
                    out[x] = f"{self.names[i]}.{attr}"
        return out

    def key(self, world: World, raw: dict[str, Any]) -> bytes:
        ids = self.holders(world)
        redis_part = self.d.canonical(raw, ids)
        t = now_ms()
        locals_ = []
        for loc in world.locals:
            if isinstance(loc, WorkerLocal):
                loc = replace(loc, did="mine" if loc.did else "", rid="mine" if loc.rid else "")
            elif isinstance(loc, JobLocal):
                loc = replace(
                    loc, upload="mine" if loc.upload else "", rid="mine" if loc.rid else ""
                )
            elif isinstance(loc, RelayLocal):
                due = 0 if not loc.due else (1 if loc.due <= t else 2)  # -, due, later
                loc = replace(loc, did="mine" if loc.did else "", rid="mine" if loc.rid else "",
                              due=due)  # fmt: skip
            locals_.append(loc)
        k = (
            redis_part,
            tuple(locals_),
            tuple(sorted(s.key for s in world.sends)),
            tuple(sorted(world.acks)),
            world.audit_expected,
            tuple(sorted(ids[r] for r in world.audited if r in ids)),
            world.faults,
            world.crashes,
            world.advances,
            self.marks_key(world, raw, ids),
        )
        return hashlib.blake2b(repr(k).encode(), digest_size=16).digest()

    def marks_key(self, world: World, raw: dict[str, Any], ids: dict[str, str]) -> Any:
        """The marks and the backup, as far as they decide what happens next.

        A call refuses ('behind') when the slot's counter is below the mark it presents, and
        every reply raises the marks to the counter. Before the restore the marks are at or
        below the counter; what matters is how far each is above the backup's counter (the
        counter after the restore), and nothing below it: so each mark enters as
        ``max(0, mark - backup counter)``. After the restore (one, at most) each enters as
        ``max(0, mark - counter)``: once at or below the counter it can never refuse again.
        The witness likewise: a tick quarantines when its data dir recorded more than Redis
        holds, by any amount; the counters themselves are dropped. Without a backup nothing
        of the marks matters (the state keys of one-process scenarios are as before)."""
        if not self.scn.restores:
            return ()
        counter = counter_of(raw)
        if world.backup is None and not world.restored:
            return ("no backup", world.backups, world.restores)
        if counter is None:  # quarantined: every script fails closed, marks or not
            base = "closed"
            rel: tuple[Any, ...] = ()
        else:
            braw = world.backup[1] if world.backup is not None else raw
            base_counter = counter if world.restored else counter_of(braw) or 0
            rel = tuple(
                (max(0, own - base_counter), max(0, shared - base_counter))
                for own, shared in self.d.presented(world.marks)
            )
            wit = []
            for i, rec in enumerate(self.d.witness_recorded(world.marks)):
                w = witness_of(raw if world.restored else braw, i)
                wit.append(min(1, max(0, rec - w)))
            rel += (tuple(wit),)
            base = "open"
        backup = (
            self.d.canonical(world.backup[1], ids)
            if world.backup is not None and not world.restored
            else ()
        )
        return (
            base,
            rel,
            backup,
            world.backups,
            world.restores,
            world.restored,
            world.lost,
            tuple(sorted(world.lost_acks)),
            tuple(sorted(world.ticked)),
            tuple(sorted(world.ticked_after)),
        )

    # -- moves --------------------------------------------------------------------------

    def moves(self, world: World, raw: dict[str, Any]) -> list[Move]:
        scn = self.scn
        out: list[Move] = []
        script: list[Move] = []  # moves that run one script: faults may hit them
        t = now_ms()
        for i, loc in enumerate(world.locals):
            if i < self.n_workers:
                spec = scn.workers[i]
                pc = loc.pc
                if pc == "start":
                    if ("fence", spec.gen) not in world.acks:
                        continue  # the worker has its token from an acknowledged register
                    script.append(Move(i, "admit"))
                elif pc == "resend":  # _admit re-sends until its grace is over, then gives up
                    script.append(Move(i, "give_up" if loc.late else "admit"))
                elif pc == "void":
                    script.append(Move(i, "give_up"))
                elif pc == "admitted":
                    out += [Move(i, "send", o) for o in self._outcomes(loc.late)]
                elif pc == "sent":
                    script.append(Move(i, "record"))
                elif pc == "hint":
                    out.append(Move(i, "hint"))
                if pc not in ("start", "done", "crashed") and world.crashes:
                    out.append(Move(i, "crash"))
            elif i < self.n_jobs:
                job = scn.jobs[i - self.n_workers]
                if loc.stopped or loc.at == len(job.program):
                    continue
                if loc.at == 0 and not loc.follow and ("fence", job.gen) not in world.acks:
                    continue  # the worker has its token from an acknowledged register
                script.append(Move(i, "job"))
                if world.crashes and (loc.at or loc.follow):
                    out.append(Move(i, "crash"))
            elif i < self.sched:
                pc = loc.pc
                if pc == "idle":
                    if loc.sweep:
                        out.append(Move(i, "sweep"))
                    elif any(sc <= t for _, sc in raw["hints"]):
                        out.append(Move(i, "poll"))
                elif pc in ("batch", "resend"):
                    script.append(Move(i, "claim"))
                elif pc == "void":
                    script.append(Move(i, "void"))
                elif pc == "claimed":
                    out += [Move(i, "send", o) for o in self._outcomes(loc.late)]
                elif pc == "sent":
                    script.append(Move(i, "record"))
                elif pc in ("hint", "requeued", "unhint"):
                    out.append(Move(i, pc))
                if pc != "idle" and world.crashes:
                    out.append(Move(i, "crash"))
            elif i == self.sched:
                if loc <= scn.gens:
                    script.append(Move(i, "register", loc))
            elif i == self.sched + 1:
                if not loc:
                    script.append(Move(i, "cancel"))
            elif loc > 0:
                for step, h in raw["fx"].items():
                    overdue = h.get("state") == "dispatching" and deadline_class(
                        h.get("deadline", "0")
                    ) in ("past", "0")
                    if h.get("state") == "unknown" or overdue:
                        script.append(Move(i, "resolve", step))
        out += script
        if world.faults:
            out += [replace(m, fault=f) for m in script for f in scn.fault_kinds]
        if world.advances and self._time_matters(world, raw, t):
            out.append(Move(-1, "advance"))
        if world.backups:
            out.append(Move(-1, "backup"))
        if world.restores and world.backup is not None:
            out.append(Move(-1, "restore"))
        taken = world.backup is not None or world.restored
        if self.scn.witness and taken and counter_of(raw) is not None:
            # a tick changes something only once per data dir before the restore (it has
            # ticked since the backup) and once after it (it detects, or it is level again)
            done = world.ticked_after if world.restored else world.ticked
            for p, dir_ in enumerate(self.d.dir_of):
                if dir_ not in done and dir_ not in self.d.dir_of[:p]:
                    out.append(Move(-1, "tick", p))
        return out

    def _outcomes(self, late: bool) -> Sequence[str]:
        return ("late",) if late else self.scn.outcomes

    def _time_matters(self, world: World, raw: dict[str, Any], t: int) -> bool:
        """Whether an advance would change anything (else it is not offered)."""
        if any(deadline_class(h.get("deadline", "0")) == "live" for h in raw["fx"].values()):
            return True
        if any(sc > t for _, sc in raw["queue"] + raw["hints"]):
            return True
        for x in world.locals:
            if isinstance(x, WorkerLocal) and x.pc in ("admitted", "resend") and not x.late:
                return True
            if isinstance(x, RelayLocal) and (not x.sweep or (x.pc == "claimed" and not x.late)):
                return True
        return False

    # -- one transition -----------------------------------------------------------------

    def phase(self, world: World) -> str:
        """Where a script runs, for the signature of a send it authorises."""
        if not world.restored:
            return ""
        if not self.scn.witness:
            return " on the restored Redis"
        if world.ticked_after & world.ticked:
            return " on the restored Redis, after a detecting witness tick"
        if world.ticked_after:
            return " on the restored Redis, after a witness tick that had nothing to detect"
        return " on the restored Redis, before any witness tick"

    async def apply(self, world: World, m: Move) -> tuple[World, Effects]:
        d = self.d
        d.set_marks(world.marks)
        d.use(self.proc[m.actor] if m.actor >= 0 else 0)
        d.wire.replies.clear()
        d.wire.resends.clear()
        d.wire.mode = m.fault
        acked = max(a[1] for a in world.acks if a[0] == "fence")
        d.wire.context = (acked, self.phase(world))
        locals_ = list(world.locals)
        if m.kind in ("backup", "restore", "tick"):
            return await self.environment(world, m)
        if m.kind == "advance":
            d.advance()
            for i, loc in enumerate(locals_):
                if isinstance(loc, WorkerLocal) and loc.pc in ("admitted", "resend"):
                    locals_[i] = replace(loc, late=True)  # its deadline / admit grace passed
                elif isinstance(loc, RelayLocal):  # its deadline passed; a sweep is due
                    locals_[i] = replace(loc, late=loc.pc == "claimed" or loc.late, sweep=True)
            world = replace(world, locals=tuple(locals_), advances=world.advances - 1)
            return world, Effects("time passes: every deadline and timer")
        loc = locals_[m.actor]
        fx: Effects
        if m.kind == "crash":
            if isinstance(loc, RelayLocal):
                locals_[m.actor] = RelayLocal()  # a new gateway process: it sweeps first
                fx = Effects("gateway crashes (its relay restarts)")
            elif isinstance(loc, JobLocal):
                locals_[m.actor] = JobLocal(stopped=True)
                fx = Effects("gateway crashes")
            else:
                locals_[m.actor] = replace(loc, pc="crashed", did="", rid="")
                fx = Effects("gateway crashes")
            world = replace(world, crashes=world.crashes - 1)
        elif m.actor < self.n_workers:
            spec = self.scn.workers[m.actor]
            if m.kind == "admit":
                loc, fx = await d.worker_admit(spec, loc)
            elif m.kind == "give_up":
                loc, fx = await d.worker_give_up(spec, loc)
            elif m.kind == "send":
                pj = payload_json(spec.body)
                fx = d.send(spec.name, spec.step, spec.gen, pj, loc.auth, m.arg)
                loc = replace(loc, pc="sent", outcome=m.arg)
            elif m.kind == "hint":
                loc, fx = await d.worker_hint(spec, loc)
            else:
                loc, fx = await d.worker_record(spec, loc)
            locals_[m.actor] = loc
        elif m.actor < self.n_jobs:
            loc, fx = await d.job_step(self.scn.jobs[m.actor - self.n_workers], loc)
            locals_[m.actor] = loc
        elif m.actor < self.sched:
            name = self.names[m.actor]
            if m.kind == "sweep":
                loc, fx = await d.relay_sweep(loc)
            elif m.kind == "poll":
                loc, fx = await d.relay_poll(loc)
            elif m.kind == "claim":
                loc, fx = await d.relay_claim(loc)
            elif m.kind == "void":
                loc, fx = await d.relay_void(loc)
            elif m.kind == "send":
                fx = d.send(name, loc.step, loc.gen, loc.payload, loc.auth, m.arg)
                loc = replace(loc, pc="sent", outcome=m.arg)
            elif m.kind == "record":
                loc, fx = await d.relay_record(loc)
            elif m.kind == "hint":
                loc, fx = await d.relay_hint(loc)
            elif m.kind == "requeued":
                loc, fx = await d.relay_requeued(loc)
            else:
                loc, fx = await d.relay_unhint(loc)
            locals_[m.actor] = loc
        elif m.kind == "register":
            nxt, fx = await d.register(m.arg)
            locals_[m.actor] = loc + 1 if nxt == "next" else loc
        elif m.kind == "cancel":
            nxt, fx = await d.cancel()
            locals_[m.actor] = nxt == "next"
        else:
            delivered = any(s.step == m.arg and s.delivered for s in world.sends)
            fx = await d.resolve(m.arg, delivered)
            locals_[m.actor] = loc - 1
        # one audited request counts once: re-sent (lost reply, or sent again after a
        # timeout with the same request id) it must not write a second entry
        audited = {rid for s, rid, r, _ in d.wire.replies if writes_audit(s, r)} - world.audited
        world = replace(
            world,
            locals=tuple(locals_),
            sends=world.sends + tuple(fx.sends),
            acks=world.acks | frozenset(fx.acks),
            audit_expected=world.audit_expected + len(audited),
            audited=world.audited | audited,
            faults=world.faults - (m.fault != "ok"),
            marks=d.get_marks(),
        )
        return world, fx

    async def environment(self, world: World, m: Move) -> tuple[World, Effects]:
        """The backup, the restore, a witness tick."""
        d = self.d
        if m.kind == "backup":
            raw, dumps = d.read()
            return replace(world, backups=0, backup=(dumps, raw)), Effects("backup taken")
        if m.kind == "tick":
            fx = await d.witness_tick(m.arg)
            dir_ = frozenset({d.dir_of[m.arg]})
            if world.restored:
                world = replace(world, ticked_after=world.ticked_after | dir_)
            else:
                world = replace(world, ticked=world.ticked | dir_)
            return replace(world, marks=d.get_marks()), Effects(f"P{m.arg + 1}: {fx.text}")
        assert world.backup is not None
        dumps, braw = world.backup
        now = d.read()[0]
        lost = now["keys"] != braw["keys"]
        d.restore(dumps)
        # acknowledged verdicts the backup does not hold are gone: I-durable no longer
        # holds Redis to them (the restore is the fault); every other one still holds
        lost_acks = frozenset(a for a in world.acks if not inv.ack_holds(a, braw))
        # one audited request counts once -- unless its remembered reply went with the
        # restore: sent again, it runs again
        audited = frozenset(r for r in world.audited if any(
            k.endswith(":req:" + r) for k in braw["keys"]))  # fmt: skip
        world = replace(
            world,
            restores=world.restores - 1,
            restored=True,
            backup=None,
            lost=lost,
            lost_acks=lost_acks,
            audit_expected=len(braw["audit"]),
            audited=audited,
        )
        what = "lost writes" if lost else "nothing lost"
        return world, Effects(f"Redis restored from the backup ({what})")

    def label(self, m: Move, fx: Effects) -> str:
        who = self.names[m.actor] if m.actor >= 0 else "clock"
        if m.actor < 0 and m.kind != "advance":
            who = "operator" if m.kind in ("backup", "restore") else "witness"
        elif self.scn.processes > 1:
            who = f"P{self.proc[m.actor] + 1} {who}"
        fault = {"ok": "", "lost": " [reply lost, re-sent]", "timeout": " [timed out]"}[m.fault]
        return f"{who}: {fx.text}{fault}"

    # -- the search ---------------------------------------------------------------------

    async def run(
        self, *, restore: str = "snapshot", max_states: int | None = None, keep_going: bool = False,
        stop_when: Callable[[Report], bool] | None = None,
    ) -> Report:  # fmt: skip
        """Breadth first over every interleaving; ``stop_when``: end the search as soon as it
        holds of the report (a mutation test's violation found: nothing else is asked)."""
        rep = Report(self.scn.name, expect=self.scn.expect)
        t0 = time.perf_counter()
        d = self.d
        await d.setup()
        raw0, init_dump = d.read()
        world0 = self.initial(init_dump, raw0)
        k0 = self.key(world0, raw0)
        seen = {k0}
        parent: dict[bytes, tuple[bytes | None, str]] = {k0: (None, "")}
        # node: (key, redis snapshot, world, raw, path of move ids)
        frontier: list[tuple[bytes, dict[str, str], World, dict[str, Any], tuple[Any, ...]]]
        frontier = [(k0, init_dump, world0, raw0, ())]
        depth = 0
        in_redis: bytes | None = None  # the state Redis holds now, when known
        while frontier:
            nxt: list[Any] = []
            for key, dumps, world, raw, path in frontier:
                moves = self.moves(world, raw)
                if not any(m.actor >= 0 for m in moves):
                    rep.quiescent += 1
                for m in moves:
                    base = world
                    if restore == "snapshot":
                        if in_redis != key:
                            d.restore(dumps)
                    else:  # replay the path (the ids it hands out are new: use its world)
                        d.restore(init_dump)
                        base = world0
                        for mid in path:
                            base, _ = await self.apply(base, Move(*mid))
                    w2, fx = await self.apply(base, m)
                    rep.transitions += 1
                    # Redis after the step: the parent's when the move does not touch it
                    quiet = m.kind in ("send", "crash", "backup")
                    raw2, snap = (raw, dumps) if quiet else d.read()
                    # a send or a crash does not touch Redis, nor does a step that wrote
                    # nothing (DUMPs equal): the next move from this state needs no restore
                    in_redis = key if quiet or snap == dumps else None
                    ctx = inv.Ctx(d, fx.sends, w2.sends, w2.acks, w2.audit_expected, raw2,
                                  list(d.wire.resends), self.payloads,
                                  self.scn.dedupes, w2.restored, w2.lost,
                                  w2.lost_acks, raw, list(d.wire.replies))  # fmt: skip
                    checks = dict(inv.ON_STEP)
                    moves2 = self.moves(w2, raw2)
                    if not any(x.actor >= 0 for x in moves2):
                        checks.update(inv.AT_QUIESCENCE)
                    broken = False
                    for name, check in checks.items():
                        rep.checks += 1
                        found = check(ctx)
                        if found is None:
                            continue
                        broken = True
                        msg, sig = (found, "") if isinstance(found, str) else found
                        if (name, sig) not in rep.violations:
                            trace = [*self.trace(parent, key), self.label(m, fx)]
                            rep.violations[name, sig] = Violation(name, sig, msg, trace)
                    k2 = self.key(w2, raw2)
                    if k2 in seen:
                        continue
                    seen.add(k2)
                    parent[k2] = (key, self.label(m, fx))
                    rep.quarantined += "fg:quarantine" in raw2["keys"]
                    if broken and not keep_going:
                        continue
                    nxt.append((k2, snap, w2, raw2, (*path, m.mid)))
                if max_states and len(seen) >= max_states:
                    rep.truncated = True
                    nxt = []
                    break
                if stop_when is not None and stop_when(rep):
                    nxt = []
                    break
            frontier = nxt
            if frontier:
                depth += 1
        rep.states = len(seen)
        rep.depth = depth
        rep.seconds = time.perf_counter() - t0
        return rep

    def trace(self, parent: dict[bytes, tuple[bytes | None, str]], key: bytes) -> list[str]:
        out = []
        k: bytes | None = key
        while k is not None:
            k, label = parent[k]
            if label:
                out.append(label)
        return out[::-1]


# -- bounds ----------------------------------------------------------------------------

A1 = w("A", 1, "async", 10000)  # worker A, generation 1: an async refund of 10,000
B2 = w("B", 2, "sync", 2500)  # worker B took over as generation 2: a refund of 2,500

HOLES = (
    Scenario(
        "hole1-2-takeover",
        (A1, B2),
        outcomes=("ok", "refused"),
        advances=2,
        hole="1 (superseded payload under the new intent) and 2 (relay dispatch below the fence)",
    ),
    Scenario(
        "hole3-resolved",
        (A1, w("A'", 1, "async", 10000)),
        resolves=1,
        outcomes=("ok", "lost"),
        advances=0,
        hole="3 (a rejected stale async call re-arms the relay after a not_delivered resolution)",
    ),
)

DEFAULT = (
    *HOLES,
    Scenario(
        "crash-resolve",
        (A1, B2),
        outcomes=("ok",),
        crashes=1,
        resolves=1,
        advances=1,
    ),
    Scenario(
        "wire-faults",
        (w("Z", 1, "async", 10000), B2),
        outcomes=("ok",),
        faults=1,
        advances=1,
    ),
    Scenario(
        "cancel",
        (A1, w("C", 3, "sync", 500)),
        gens=3,
        cancel=True,
        outcomes=("ok", "refused"),
        advances=1,
    ),
)

# Workers on the job's own state: J, generation 1, and K, generation 2 after the
# takeover, each checkpoints, stages and records its output, and completes naming it.
J1 = JobWorkerSpec("J", 1)
K2 = JobWorkerSpec("K", 2)
J1_HEARTBEAT = JobWorkerSpec("J", 1, ("heartbeat", "checkpoint", "stage", "record", "complete"))
JOBS = (
    Scenario("job-takeover", (), jobs=(J1_HEARTBEAT, K2), relays=0, outcomes=("ok",), advances=0),
    Scenario("job-wire", (), jobs=(J1, K2), relays=0, outcomes=("ok",), advances=0, faults=1),
)
JOBS_LARGE = (
    Scenario(
        "job-wire-crash",
        (),
        jobs=(J1_HEARTBEAT, K2),
        relays=0,
        outcomes=("ok",),
        advances=0,
        faults=1,
        crashes=1,
    ),
    Scenario(
        "job-3-gens",
        (),
        jobs=(J1, K2, JobWorkerSpec("L", 3)),
        gens=3,
        relays=0,
        outcomes=("ok",),
        advances=0,
        faults=1,
    ),
    # an effect worker and a job worker of the next generation, a cancel between
    Scenario(
        "job-and-effect",
        (A1,),
        jobs=(JobWorkerSpec("K", 2, ("stage", "record", "complete")),),
        outcomes=("ok", "refused"),
        advances=1,
        cancel=True,
    ),
)

LARGE = (
    *DEFAULT,
    Scenario(
        "crash-resolve-refused",
        (A1, B2),
        outcomes=("ok", "refused"),
        crashes=1,
        resolves=1,
        advances=1,
    ),
    Scenario(
        "crash-resolve-timeout",
        (A1, B2),
        outcomes=("ok", "refused", "timeout"),
        crashes=1,
        resolves=1,
        advances=1,
    ),
    Scenario(
        "wire-faults-refused",
        (w("Z", 1, "async", 10000), B2),
        outcomes=("ok", "refused"),
        faults=1,
        advances=1,
    ),
    Scenario(
        "takeover-crash",
        (A1, B2),
        outcomes=("ok", "refused", "timeout"),
        crashes=1,
        resolves=1,
        advances=2,
    ),
    Scenario(
        "two-steps",
        (A1, w("B", 2, "async", 2500), w("C", 2, "sync", 700, step="s2")),
        steps=("s1", "s2"),
        outcomes=("ok", "refused"),
        advances=1,
    ),
    Scenario(
        "large-wire",
        (w("A", 1, "sync", 10000), w("Z", 1, "async", 10000), B2),
        outcomes=("ok", "refused", "timeout"),
        faults=2,
        resolves=1,
        advances=2,
    ),
    Scenario(
        "large-3-gens",
        (A1, w("B", 2, "sync", 2500, retries=1), w("C", 3, "async", 500)),
        gens=3,
        cancel=True,
        outcomes=("ok", "refused", "timeout", "lost"),
        crashes=1,
        resolves=1,
        advances=2,
    ),
    Scenario(
        "large-relays",
        (A1, B2),
        relays=2,
        outcomes=("ok", "refused", "timeout"),
        crashes=1,
        resolves=1,
        advances=2,
    ),
    Scenario(
        "large-dedupes",
        (A1, w("B", 2, "sync", 10000)),
        outcomes=("ok", "refused", "timeout"),
        crashes=1,
        faults=1,
        dedupes=True,
        advances=2,
    ),
    Scenario(
        "large-two-steps",
        (
            A1,
            w("B", 2, "async", 2500),
            w("C", 2, "sync", 700, step="s2"),
            w("D", 1, "sync", 9, step="s2"),
        ),
        steps=("s1", "s2"),
        outcomes=("ok", "refused", "timeout"),
        crashes=1,
        advances=2,
    ),
)

# Two gateway processes and a restore: A, generation 1, on P2; B, generation 2,
# and the scheduler on P1. The backup is any state of the path; Redis goes back to it once.
# The witness's window (docs/reliability.md): a process that never saw the lost writes admits
# before the first tick that can detect the restore; what follows from that admit (a second
# delivery, an answer the restored Redis does not hold) comes with it.
WITNESS_WINDOW = (
    ("I-fence", "before any witness tick", True),
    ("I-fence", "after a witness tick that had nothing to detect", True),
    ("I-durable", "", False),
    ("I-once", "", False),
)
A1_SYNC = w("A", 1, "sync", 10000)
RESTORE_SYNC = Scenario(
    "restore-sync",
    (A1_SYNC, B2),
    relays=0,
    outcomes=("ok",),
    advances=0,
    on_p2=("A",),
    restores=1,
    backup="any",
    hole="a restored backup must be refused by every gateway process, not only the first",
)
RESTORE = (
    replace(RESTORE_SYNC, name="restore-sync-shared", marks="shared"),
    # the smallest form of hole 2: A alone on P2, the witness of each data dir ticking
    replace(
        RESTORE_SYNC,
        name="restore-min-hosts-witness",
        workers=(A1_SYNC,),
        marks="hosts",
        witness=True,
        expect=WITNESS_WINDOW,
    ),
)
# the relay of P2 sends A's async call; the downstream may refuse (a retry after the restore)
RESTORE_ASYNC = Scenario(
    "restore-async",
    (A1, B2),
    outcomes=("ok", "refused"),
    advances=1,
    on_p2=("A", "relay"),
    restores=1,
    backup="any",
)
RESTORE_LARGE = (
    *RESTORE,
    replace(
        RESTORE_SYNC,
        name="restore-sync-hosts-witness",
        marks="hosts",
        witness=True,
        expect=WITNESS_WINDOW,
    ),
    replace(RESTORE_ASYNC, name="restore-async-shared", marks="shared"),
    replace(
        RESTORE_ASYNC,
        name="restore-async-hosts-witness",
        marks="hosts",
        witness=True,
        expect=WITNESS_WINDOW,
    ),
    replace(
        RESTORE_SYNC,
        name="restore-sync-shared-operator",
        marks="shared",
        resolves=1,
        outcomes=("ok", "timeout"),
        on_p2=("A", "operator"),
    ),
)

BOUNDS: dict[str, tuple[Scenario, ...]] = {
    "default": DEFAULT,
    "jobs": JOBS,
    "large": (*LARGE, *RESTORE_LARGE, *JOBS, *JOBS_LARGE),
    "holes": HOLES,
    "restore": RESTORE,
}


# -- running --------------------------------------------------------------------------


class RedisForModel:
    """A real redis-server (gateway.store.embedded) on a free loopback port, for one exploration."""

    def __enter__(self) -> str:
        self._tmp = tempfile.TemporaryDirectory(prefix="fencegate-model-")
        self.server = EmbeddedRedis(self._tmp.name, use_socket=False)
        url = self.server.start()
        import redis

        r = redis.Redis.from_url(url)
        # Durability is not what is explored here: no fsync per write (the scripts are the same).
        r.config_set("appendonly", "no")
        r.close()
        return url

    def __exit__(self, *exc: object) -> None:
        self.server.stop()
        self._tmp.cleanup()


async def explore_async(
    url: str,
    scenarios: Sequence[Scenario],
    *,
    restore: str = "snapshot",
    max_states: int | None = None,
    keep_going: bool = False,
    mutate: Sequence[tuple[str, str, str]] = (),
    out: Any = None,
    stop_when: Callable[[Report], bool] | None = None,
) -> list[Report]:
    reports = []
    for scn in scenarios:
        d = Driver(
            url, dedupes=scn.dedupes, steps=scn.steps, processes=scn.processes, marks=scn.marks
        )
        try:
            for script, old, new in mutate:
                d.mutate(script, old, new)
            await d.store.load_scripts()
            rep = await Explorer(scn, d).run(
                restore=restore, max_states=max_states, keep_going=keep_going, stop_when=stop_when
            )
        finally:
            await d.aclose()
        reports.append(rep)
        if out is not None:
            print(rep.summary(), file=out, flush=True)
    return reports


def explore(scenarios: Sequence[Scenario], **kw: Any) -> list[Report]:
    """Explore on a fresh redis-server; the event loop runs in a thread of its own, so a
    caller's loop (pytest-asyncio's session loop) is left alone."""
    # the store's error logs of every quarantine the search meets are kept, not printed
    with RedisForModel() as url, ThreadPoolExecutor(1) as pool, capture_logs():
        return pool.submit(asyncio.run, explore_async(url, scenarios, **kw)).result()


def render(reports: Sequence[Report]) -> str:
    lines = []
    for rep in reports:
        lines.append(rep.summary())
        if rep.expect and rep.violations:
            lines.append("  (expected here, the documented window: " + "; ".join(
                f"{i} {part!r}" for i, part, _ in rep.expect) + ")")  # fmt: skip
        for i, part in rep.missing():
            lines.append(f"  MISSING: the documented {i} [{part}] was not found")
        for v in sorted(rep.violations.values(), key=lambda v: (v.invariant, len(v.trace))):
            lines.append(f"  {v.invariant} [{v.signature}]: {v.message}")
            lines += [f"    {i + 1:2}. {t}" for i, t in enumerate(v.trace)]
    tot = [sum(getattr(r, f) for r in reports) for f in ("states", "transitions", "checks")]
    secs = sum(r.seconds for r in reports)
    n = len({i for r in reports for i, _ in r.violations})
    lines.append(
        f"total: {tot[0]} states, {tot[1]} transitions, {tot[2]} invariant checks, "
        f"{secs:.1f} s; {n} invariant(s) violated"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.model.explore", description=__doc__.split("\n")[0]
    )
    p.add_argument("--bound", choices=sorted(BOUNDS), default="default")
    p.add_argument("--scenario", action="append", help="only these scenarios (of any bound)")
    p.add_argument("--restore", choices=("snapshot", "replay"), default="snapshot")
    p.add_argument("--max-states", type=int, default=None)
    p.add_argument("--keep-going", action="store_true", help="expand states past a violation")
    p.add_argument(
        "--marks",
        choices=MARKS,
        help="the slot marks of every process in every scenario (own: in memory only)",
    )
    p.add_argument("--witness", choices=("on", "off"), help="the witness tick as an action")
    args = p.parse_args(argv)
    scns = BOUNDS[args.bound]
    if args.scenario:
        every = {s.name: s for b in (*BOUNDS.values(), (RESTORE_SYNC, RESTORE_ASYNC)) for s in b}
        scns = tuple(every[n] for n in args.scenario)
    if args.marks or args.witness:
        scns = tuple(
            replace(
                s,
                name=f"{s.name}/marks={args.marks or s.marks}/witness={args.witness or 'as is'}",
                marks=args.marks or s.marks,
                witness=s.witness if args.witness is None else args.witness == "on",
            )
            for s in scns
        )
    reports = explore(
        scns, restore=args.restore, max_states=args.max_states, keep_going=args.keep_going,
        out=sys.stderr,
    )  # fmt: skip
    print(render(reports))
    return 1 if any(r.failed for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
