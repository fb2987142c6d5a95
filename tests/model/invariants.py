"""The invariants the explorer checks after every step (docs/contract.md#invariants).

Each check is a named function of one transition: it returns ``None``, or a
message saying what broke and a short signature of the kind of breakage (the
explorer keeps the shortest trace of every distinct signature: e.g. a relay
claim of a ``pending`` step and of an operator-resolved ``released`` step
below the fence are two distinct counterexamples).
``ON_STEP`` run after every step, ``AT_QUIESCENCE`` only in states where no
actor can move any more (time aside).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.model.driver import Driver, Resend, Send, verdict


@dataclass
class Ctx:
    """One transition, as the checks see it."""

    driver: Driver
    sends: list[Send]  # sends made by this step
    all_sends: tuple[Send, ...]  # every send so far, this step's included
    acks: frozenset[tuple[Any, ...]]  # every verdict a caller saw and may rely on
    audit_expected: int  # distinct calls whose script wrote an audit entry
    raw: dict[str, Any]  # Redis after the step (Driver.raw_state)
    resends: list[Resend]
    payloads: dict[tuple[int, str], frozenset[str]]  # (gen, step) -> the payloads of its calls
    dedupes: bool
    restored: bool = False  # Redis went back to a backup
    lost: bool = False  # ... and the restore lost writes
    lost_acks: frozenset[tuple[Any, ...]] = frozenset()  # acknowledged, gone with the restore
    before: dict[str, Any] | None = None  # Redis before the step (Driver.raw_state)
    # the step's scripts: (script, request id, reply, ARGV without the trailer)
    replies: list[tuple[str, str, list[Any], Any]] = field(default_factory=list)


def i_stale(c: Ctx) -> str | None:
    """No send below the fence: the admit/claim that authorised a send ran while its
    generation was the fence, on a job not cancelled, and the send carries that generation."""
    for s in c.sends:
        a = s.auth
        if a.gen != a.fence:
            return (
                f"{s.by} sent {s.step} under generation {s.gen}, authorised by a {a.what} that "
                f"ran when the fence was {a.fence}"
            ), "below the fence: " + a.what
        if a.cancelled:
            return f"{s.by} sent {s.step}, authorised by a {a.what} on a cancelled job", (
                "cancelled: " + a.what
            )
        if s.gen != a.gen:
            msg = f"{s.by} sent {s.step} under generation {s.gen}, its {a.by} was for {a.gen}"
            return msg, "wrong generation: " + a.what
    return None


def i_intent(c: Ctx) -> str | None:
    """A send carries the step's pinned intent (as it was at the claim that authorised it),
    and under generation g the payload of generation g's call."""
    for s in c.sends:
        if s.digest != s.auth.pinned:
            return (
                f"{s.by} sent {s.step} payload {s.payload} (intent {s.digest[:8]}) while the "
                f"step was pinned to intent {s.auth.pinned[:8]} at its {s.auth.what}"
            ), "not the pinned intent: " + s.auth.what
        if s.payload not in c.payloads.get((s.gen, s.step), frozenset()):
            theirs = sorted(c.payloads.get((s.gen, s.step), frozenset()))
            return (
                f"{s.by} sent {s.step} payload {s.payload} under generation {s.gen}, whose "
                f"calls carried {theirs}"
            ), "another generation's payload: " + s.auth.what
    return None


def i_once(c: Ctx) -> str | None:
    """At most one delivered send per step to a downstream that does not deduplicate.
    (Sends the downstream did not deliver -- refused, lost -- do not count; the operator in
    the model is truthful, so a not_delivered resolution never hides a delivery.)"""
    if c.dedupes:
        return None
    n = Counter(s.step for s in c.all_sends if s.delivered)
    for step, k in n.items():
        if k > 1:
            gens = [s.gen for s in c.all_sends if s.delivered and s.step == step]
            return f"{step} was delivered {k} times (generations {gens})"
    return None


def i_fence(c: Ctx) -> str | None:
    """No send below the acknowledged fence: the admit/claim that authorised a send ran
    under a generation at or above every generation whose register had been acknowledged.
    Without a restore this follows from I-stale and I-durable; after a restore (Redis's
    fence went back with it) it is the guarantee the slot marks and the witness give."""
    for s in c.sends:
        a = s.auth
        if a.gen < a.acked:
            return (
                f"{s.by} sent {s.step} under generation {s.gen}, authorised by a {a.what} that "
                f"ran{a.phase} after register({a.acked}) was acknowledged"
            ), f"below the acknowledged fence: {a.what}{a.phase}"
    return None


def i_closed(c: Ctx) -> str | None:
    """A quarantined Redis authorises nothing: no send comes from an admit or claim that ran
    while ``fg:quarantine`` was set (every script of every process fails closed)."""
    for s in c.sends:
        if s.auth.quarantined:
            return f"{s.by} sent {s.step}, authorised by a {s.auth.what} on a quarantined Redis"
    return None


def i_no_false_quarantine(c: Ctx) -> str | None:
    """A quarantine only after real data loss: never without a restore, never after a restore
    that lost nothing (Redis was put back to what it held). A false quarantine stops every
    gateway until an operator runs init: it is a failure, not "failing closed"."""
    if "fg:quarantine" not in c.raw["keys"] or c.lost:
        return None
    if c.restored:
        return "Redis was quarantined after a restore that lost nothing", "after a lossless restore"
    return "Redis was quarantined with no restore", "with no restore"


def ack_holds(ack: tuple[Any, ...], raw: dict[str, Any]) -> bool:
    """Whether Redis (a raw state) still holds an acknowledged verdict."""
    job = raw["job"]
    if ack[0] == "fx":
        return bool(raw["fx"][ack[1]].get("state", "(none)") == ack[2])
    if ack[0] == "fence":
        return int(job.get("fence") or 0) >= int(ack[1])
    if ack[0] == "cancelled":
        return bool(job.get("cancelled") == "1")
    if ack[0] == "completed":
        return bool(_completion(job).get("generation") == ack[1])
    return True


def i_durable(c: Ctx) -> str | None:
    """Every acknowledged verdict still holds: a succeeded/failed answer stays recorded,
    an acknowledged register(g) keeps the fence >= g, an acknowledged cancel stays. (A
    restore loses verdicts on purpose: those it lost are not held against Redis.)"""
    job = c.raw["job"]
    fence = int(job.get("fence") or 0)
    for ack in sorted(c.acks - c.lost_acks):
        if ack[0] == "fx":
            state = c.raw["fx"][ack[1]].get("state", "(none)")
            if state != ack[2]:
                msg = f"a caller was answered {ack[1]} {ack[2]}; the record now says {state}"
                return msg, f"{ack[2]} answered, now {state}"
        elif ack[0] == "fence" and fence < ack[1]:
            return f"register({ack[1]}) was acknowledged; the fence is now {fence}"
        elif ack[0] == "cancelled" and job.get("cancelled") != "1":
            return "cancel was acknowledged; the job is no longer cancelled"
        elif ack[0] == "completed" and _completion(job).get("generation") != ack[1]:
            return f"a completion by generation {ack[1]} was acknowledged; the job says {job}", (
                "completion answered, now another"
            )
    return None


def i_honest(c: Ctx) -> str | None:
    """A step recorded succeeded (not by an operator) had a delivered send of its pinned intent."""
    for step, h in c.raw["fx"].items():
        if h.get("state") != "succeeded" or h.get("resolved_by"):
            continue
        if not any(s.step == step and s.delivered and s.digest == h.get("intent_sha256")
                   for s in c.all_sends):  # fmt: skip
            return (
                f"{step} is recorded succeeded with intent {h.get('intent_sha256', '')[:8]} "
                f"(generation {h.get('generation')}); no send of that intent was delivered"
            )
    return None


def i_audit(c: Ctx) -> str | None:
    """Exactly one audit entry per rejecting call (and per operator resolution and new
    registration): a re-sent call counts once."""
    n = len(c.raw["audit"])
    if n != c.audit_expected:
        return f"the job's audit stream has {n} entries for {c.audit_expected} audited calls"
    return None


def i_index(c: Ctx) -> str | None:
    """The slot's "needs a decision" index holds exactly the steps whose outcome is unknown
    or that are dispatching, a dispatching one scored by its deadline (every
    script that changes a step's state keeps it, atomically, on every path)."""
    indexed = {_queue_step(m): sc for m, sc in c.raw["attention"]}
    for step, h in c.raw["fx"].items():
        state = h.get("state")
        if state in ("unknown", "dispatching") and step not in indexed:
            return f"{step} is {state} and not in the slot's index", f"{state}, not indexed"
        if state not in ("unknown", "dispatching") and step in indexed:
            return f"{step} is {state or '(gone)'} and still indexed", f"{state}, indexed"
        if state == "dispatching" and indexed[step] != float(h.get("deadline") or 0):
            msg = f"{step} is dispatching until {h.get('deadline')}, indexed at {indexed[step]}"
            return msg, "dispatching, indexed at another deadline"
    return None


def i_resend(c: Ctx) -> str | None:
    """A script re-sent after its reply was lost returns the same verdict and changes
    nothing more (one request id per call, the remembered reply)."""
    for r in c.resends:
        first, second = verdict(r.script, r.first), verdict(r.script, r.second)
        if first != second:
            msg = f"re-sent {r.script} answered {r.second}, its first run {r.first}"
            return msg, f"{r.script}: another verdict"
        before = c.driver.canonical(r.state_before)
        after = c.driver.canonical(r.state_after)
        if before != after:
            msg = f"re-sent {r.script} changed Redis again: {_diff(before, after)}"
            return msg, f"{r.script}: ran twice"
    return None


def i_live(c: Ctx) -> str | None:
    """At quiescence nothing is stranded: no step `pending` without a relay queue entry,
    and no 202-accepted async call whose intent is still pinned on a `released` step that
    nothing will perform (no queue entry; not cancelled, superseded or operator-resolved).
    Not after a restore: the accepted work it lost is lost (I-fence and I-no-false-quarantine
    say what must hold then)."""
    if c.restored:
        return None
    queued = {_queue_step(m) for m, _ in c.raw["queue"]}
    job = c.raw["job"]
    fence = int(job.get("fence") or 0)
    for step, h in c.raw["fx"].items():
        if h.get("state") == "pending" and step not in queued:
            msg = f"{step} is pending (generation {h.get('generation')}) with no relay queue entry"
            return msg, "pending, not queued"
    for ack in sorted(a for a in c.acks if a[0] == "async"):
        _, step, gen, dig = ack
        h = c.raw["fx"][step]
        if (
            h.get("state") == "released"
            and h.get("intent_sha256") == dig
            and step not in queued
            and job.get("cancelled") != "1"
            and fence == gen
            and not h.get("resolved_by")
        ):
            return (
                f"the async call of generation {gen} on {step} was accepted (202); the step is "
                "released with its intent and nothing will perform it"
            ), "accepted async call dropped"
    return None


# -- the job's own state: checkpoints, outputs, the completion --------------------------


def _completion(job: dict[str, str]) -> dict[str, Any]:
    raw = job.get("completed")
    return json.loads(raw) if raw else {}


def _landed(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, int]]:
    """The job-state writes of one step: (what, generation). A checkpoint written; an output
    staged (a new upload) or recorded; the completion. An abandon (a claim ended: the
    deadline only) is not a write of the generation's work."""
    out = []
    for name, v in after["ckpt"].items():
        if before["ckpt"].get(name) != v:
            out.append(("checkpoint", int(json.loads(v)["generation"])))
    for f, v in after["outputs"].items():
        e, p = json.loads(v), json.loads(before["outputs"].get(f) or "{}")
        gen = int(f.split("/", 1)[0])
        if e.get("upload") != p.get("upload"):
            out.append(("output stage", gen))
        elif e.get("state") == "recorded" and p.get("state") != "recorded":
            out.append(("output record", gen))
    c = _completion(after["job"])
    if c and not before["job"].get("completed"):
        out.append(("completion", int(c["generation"])))
    return out


def i_fenced_write(c: Ctx) -> str | None:
    """No write of a generation below the fence lands (a checkpoint, an output's stage or
    record, the completion): each is written by the generation that is the fence right after
    it, on a job not cancelled, and none after the job completed."""
    if c.before is None:
        return None
    job = c.raw["job"]
    fence = int(job.get("fence") or 0)
    for what, gen in _landed(c.before, c.raw):
        if gen < fence:
            return f"{what} of generation {gen} written under the fence {fence}", (
                f"below the fence: {what}"
            )
        if job.get("cancelled") == "1":
            msg = f"{what} of generation {gen} written on a cancelled job"
            return msg, f"cancelled: {what}"
        if what != "completion" and c.before["job"].get("completed"):
            msg = f"{what} of generation {gen} written after the job completed"
            return msg, f"after the completion: {what}"
    return None


def i_complete(c: Ctx) -> str | None:
    """A completion is written once, by the current generation, and names only outputs of
    that generation, each as that generation recorded it (key and sha256)."""
    now = c.raw["job"].get("completed")
    was = c.before["job"].get("completed") if c.before is not None else None
    if was and now != was:
        return f"the completion changed: {was} -> {now}", "rewritten"
    if not now:
        return None
    done = json.loads(now)
    gen = int(done["generation"])
    fence = int(c.raw["job"].get("fence") or 0)
    if gen != fence:
        return f"the job completed by generation {gen} has the fence {fence}", "not the fence"
    for name, o in done["outputs"].items():
        rec = json.loads(c.raw["outputs"].get(f"{gen}/{name}") or "{}")
        if int(o["generation"]) != gen:
            msg = f"the completion by {gen} names output {name} of generation {o['generation']}"
            return msg, "another generation's output"
        if rec.get("state") != "recorded" or (rec["key"], rec["sha256"]) != (o["key"], o["sha256"]):
            return f"the completion names {name} as {o}; generation {gen} recorded {rec}", (
                "an output not recorded so"
            )
    return None


PRESENTED_AT = {"reject-2": 1}  # the generation's ARGV index (0: ARGV[1], as most scripts)


def i_stale_audited(c: Ctx) -> str | None:
    """A stale call is refused and audited with both generations: the entry its reply names
    holds the generation presented and the fence that refused it (presented < current)."""
    entries = dict(c.raw["audit"])
    for script, _, reply, args in c.replies:
        if int(reply[0]) != 9 or reply[1] != "stale_generation":
            continue
        presented, current, audit_id = reply[2], reply[3], reply[4]
        sent = args[PRESENTED_AT.get(script, 0)]  # the generation the call presented
        if presented != sent:
            msg = f"{script} refused generation {sent} as if {presented} was presented"
            return msg, f"{script}: another generation presented"
        entry = entries.get(audit_id)
        if entry is None:
            return f"{script} refused stale_generation; no audit entry {audit_id}", (
                f"{script}: not audited"
            )
        if (entry.get("presented"), entry.get("current")) != (presented, current) or not (
            int(presented) < int(current)
        ):
            return (
                f"{script} refused generation {presented} under {current}; its audit entry says "
                f"{entry.get('presented')} / {entry.get('current')}"
            ), f"{script}: audited without both generations"
    return None


# the calls that answer "you are current" ({0, fence, ...}) without writing a decision
ANSWERS_CURRENT = ("heartbeat-2", "check-2")


def i_current(c: Ctx) -> str | None:
    """A heartbeat or check answers "current" only to the fence's generation (a worker told
    it is current goes on working)."""
    for script, _, reply, args in c.replies:
        if script in ANSWERS_CURRENT and int(reply[0]) == 0 and reply[1] != args[0]:
            msg = f"{script} answered generation {args[0]} as current under the fence {reply[1]}"
            return msg, f"{script}: not the fence's generation"
    return None


def _queue_step(member: str) -> str:
    return str(json.loads(member)[2])


def _diff(a: Any, b: Any) -> str:
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        for x, y in zip(a, b, strict=True):
            if x != y:
                return _diff(x, y)
    return f"{a} -> {b}"


Check = Callable[[Ctx], "str | tuple[str, str] | None"]
ON_STEP: dict[str, Check] = {
    "I-stale": i_stale,
    "I-fence": i_fence,
    "I-closed": i_closed,
    "I-no-false-quarantine": i_no_false_quarantine,
    "I-intent": i_intent,
    "I-once": i_once,
    "I-durable": i_durable,
    "I-honest": i_honest,
    "I-audit": i_audit,
    "I-index": i_index,
    "I-resend": i_resend,
    "I-fenced-write": i_fenced_write,
    "I-complete": i_complete,
    "I-stale-audited": i_stale_audited,
    "I-current": i_current,
}
AT_QUIESCENCE: dict[str, Check] = {"I-live": i_live}
