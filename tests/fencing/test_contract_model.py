"""Property: random call sequences against the real gateway agree with a model of the contract."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import Gateway, Upstream

JOBS = ("a", "b")
STEPS = ("s1", "s2")
_examples = itertools.count()


@dataclass
class Step:
    state: str  # succeeded | released
    intent: tuple[str, int]


@dataclass
class Job:
    fence: int = 0
    cancelled: bool = False
    steps: dict[str, Step] = field(default_factory=dict)


class Model:
    """docs/contract.md in a few lines (registration required, no lease, instant downstream)."""

    def __init__(self) -> None:
        self.jobs: dict[str, Job] = {}
        self.sent = 0
        self.audited = 0

    def job(self, j: str) -> Job:
        return self.jobs.setdefault(j, Job())

    def _fenced(self, job: Job, gen: int) -> tuple[int, str] | None:
        if job.cancelled:
            self.audited += 1
            return 409, "job_cancelled"
        if gen < job.fence:
            self.audited += 1
            return 409, "stale_generation"
        if gen > job.fence:
            self.audited += 1
            return 409, "unregistered_generation"
        return None

    def register(self, j: str, gen: int | None) -> tuple[int, str]:
        job = self.job(j)
        if job.cancelled:
            self.audited += 1
            return 409, "job_cancelled"
        new = job.fence + 1 if gen is None else gen
        if new < job.fence:
            self.audited += 1
            return 409, "generation_regression"
        if new == job.fence:
            return 200, ""
        job.fence = new
        return 201, ""

    def effect(self, j: str, s: str, gen: int, adapter: str, variant: int) -> tuple[int, str]:
        job = self.job(j)
        refused = self._fenced(job, gen)
        if refused:
            return refused
        intent = (adapter, variant)
        step = job.steps.get(s)
        if step is None or step.state == "released":
            if adapter == "dead":
                job.steps[s] = Step("released", intent)
                return 502, "adapter_unavailable"
            self.sent += 1
            job.steps[s] = Step("succeeded", intent)
            return 200, "sent"
        if step.intent != intent:
            self.audited += 1
            return 422, "intent_mismatch"
        return 200, "replayed"

    def heartbeat(self, j: str, gen: int) -> tuple[int, str]:
        return self._fenced(self.job(j), gen) or (200, "")

    def cancel(self, j: str) -> tuple[int, str]:
        self.job(j).cancelled = True
        return 200, ""


# Generations are symbolic so programs reach deep states: "cur" is the job's fence
# (per the model) at the time of the call, "cur-1" a zombie, "cur+1" unregistered.
gens = st.sampled_from(["cur", "cur", "cur", "cur-1", "cur+1"]) | st.integers(1, 6)
_effect = st.tuples(
    st.just("effect"),
    st.sampled_from(JOBS),
    st.sampled_from(STEPS),
    gens,
    st.sampled_from(["hook", "hook", "dead"]),
    st.integers(0, 1),
)
# one_of picks a branch uniformly: effects three times as often, cancel rarely
ops = st.one_of(
    st.tuples(st.just("register"), st.sampled_from(JOBS), st.none() | gens),
    _effect,
    _effect,
    _effect,
    st.tuples(st.just("heartbeat"), st.sampled_from(JOBS), gens),
    st.tuples(st.just("cancel"), st.sampled_from(JOBS)),
)
programs = st.lists(ops, min_size=10, max_size=40).filter(
    lambda p: sum(op[0] == "cancel" for op in p) <= 1
)


async def outcome(resp: Any) -> tuple[int, str]:
    body = await resp.json(content_type=None)
    if resp.status >= 400:
        return resp.status, body["code"]
    if "replayed" in body:
        return resp.status, "replayed" if body["replayed"] else "sent"
    return resp.status, ""


def resolve(model: Model, job: str, gen: Any) -> int:
    if isinstance(gen, int):
        return gen
    fence = model.job(job).fence
    return max(1, {"cur": fence, "cur-1": fence - 1, "cur+1": fence + 1}[gen])


async def run_program(
    gw: Gateway, upstream: Upstream, program: list[tuple[Any, ...]]
) -> set[tuple[int, str]]:
    """Run ops against the gateway and the model; return the outcomes seen."""
    prefix = f"ex{next(_examples)}-"  # fresh jobs per run: no state leaks between examples
    model = Model()
    seen: set[tuple[int, str]] = set()
    sent_before = len(upstream.received)
    audit_before = len(await gw.audit(limit=1000))
    for op in program:
        kind, j = op[0], prefix + op[1]
        if kind == "register":
            gen = None if op[2] is None else resolve(model, j, op[2])
            expected = model.register(j, gen)
            got = await outcome(
                await gw.register(j, **({} if gen is None else {"generation": gen}))
            )
        elif kind == "effect":
            _, _, s, g, adapter, variant = op
            gen = resolve(model, j, g)
            expected = model.effect(j, s, gen, adapter, variant)
            got = await outcome(await gw.effect(j, s, gen, adapter=adapter, payload={"v": variant}))
        elif kind == "heartbeat":
            gen = resolve(model, j, op[2])
            expected = model.heartbeat(j, gen)
            got = await outcome(await gw.heartbeat(j, gen))
        else:
            expected = model.cancel(j)
            got = await outcome(await gw.client.post(f"/v1/jobs/{j}/cancel"))
        assert got == expected, f"{op}: gateway {got}, model {expected}"
        seen.add(got)
    assert len(upstream.received) - sent_before == model.sent
    assert len(await gw.audit(limit=1000)) - audit_before == model.audited
    for name, job in model.jobs.items():
        resp = await gw.client.get(f"/v1/jobs/{name}")
        if resp.status == 200:
            view = await resp.json()
            assert view["fence"] == job.fence and view["cancelled"] == job.cancelled
            states = {s: e["state"] for s, e in view["effects"].items()}
            assert states == {s: rec.state for s, rec in job.steps.items()}
    return seen


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(program=programs)
async def test_gateway_agrees_with_model(
    gw: Gateway, upstream: Upstream, program: list[tuple[Any, ...]]
) -> None:
    await run_program(gw, upstream, program)


async def test_model_program_covers_every_outcome(gw: Gateway, upstream: Upstream) -> None:
    program = [
        ("register", "a", None),
        ("effect", "a", "s1", "cur", "hook", 0),
        ("effect", "a", "s1", "cur", "hook", 0),
        ("effect", "a", "s1", "cur", "hook", 1),
        ("effect", "a", "s2", "cur", "dead", 0),
        ("effect", "a", "s2", "cur+1", "hook", 0),
        ("register", "a", 3),
        ("register", "a", 3),
        ("register", "a", 2),
        ("effect", "a", "s2", 1, "hook", 0),
        ("heartbeat", "a", "cur"),
        ("heartbeat", "a", 1),
        ("cancel", "a"),
        ("effect", "a", "s2", "cur", "hook", 0),
    ]
    seen = await run_program(gw, upstream, program)
    assert seen >= {
        (201, ""),
        (200, ""),
        (200, "sent"),
        (200, "replayed"),
        (422, "intent_mismatch"),
        (502, "adapter_unavailable"),
        (409, "unregistered_generation"),
        (409, "generation_regression"),
        (409, "stale_generation"),
        (409, "job_cancelled"),
    }
