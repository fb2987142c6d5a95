"""The exhaustive check of the protocol at the default bound (issue 12), in `make test`.

Runs :data:`tests.model.explore.DEFAULT` once (a real redis-server, every
interleaving of the real scripts, invariants after every step) and asserts that
no invariant is violated. Mutation tests then break one check of the scripts on
purpose (in memory, no old code kept) and assert that the explorer finds the
hole it re-opens. See tests/model/README.md for what it found on d36082e.
"""

from __future__ import annotations

import pytest

from tests.model.explore import DEFAULT, HOLES, Report, Scenario, explore, render, w


@pytest.fixture(scope="module")
def default_reports() -> list[Report]:
    reports = explore(DEFAULT)
    print("\n" + render(reports))
    return reports


@pytest.mark.timeout(1200)
def test_default_bound_explores_every_scenario(default_reports: list[Report]) -> None:
    assert [r.scenario for r in default_reports] == [s.name for s in DEFAULT]
    for r in default_reports:
        assert r.states > 100 and r.transitions > r.states and not r.truncated, r.summary()
        assert r.quiescent > 0, r.summary()


@pytest.mark.timeout(1200)
def test_default_bound_has_no_violations(default_reports: list[Report]) -> None:
    broken = [r for r in default_reports if r.violations]
    assert not broken, render(broken)


def found(rep: Report, invariant: str, prefix: str) -> bool:
    return any(i == invariant and s.startswith(prefix) for i, s in rep.violations)


ZOMBIE = Scenario("zombie-sync", (w("A", 1, "sync", 10000), w("B", 2, "sync", 2500)),
                  outcomes=("ok",), advances=0)  # fmt: skip
TAKEOVER = HOLES[0]  # A: generation 1 async; B: generation 2 sync; the downstream may refuse


@pytest.mark.timeout(600)
def test_mutation_admit_without_its_stale_check() -> None:
    """The stale check lives in the fence guard (includes/fence); admit-6's source has its own
    copy of the include, so the mutation removes it from the admit only."""
    line = "if gen < g.fence then return g.reject('stale_generation') end"
    (rep,) = explore([ZOMBIE], mutate=[("admit-6", line, "")])
    assert found(rep, "I-stale", "below the fence: admit"), render([rep])


@pytest.mark.timeout(600)
def test_mutation_relay_claim_without_the_fence_check_is_hole_2() -> None:
    (rep,) = explore([TAKEOVER], mutate=[("relay-5", "if gen < fence then", "if false then")])
    assert found(rep, "I-stale", "below the fence: relay_claim"), render([rep])


@pytest.mark.timeout(600)
def test_mutation_payload_not_bound_to_the_intent_is_hole_1() -> None:
    """A sync re-pin keeps the async payload and the queue entry, and the relay claim does
    not check that the payload belongs to the pinned intent: d36082e's hole 1."""
    keep = "  -- a synchronous dispatch owns the step now: no stored payload, no queue entry\n"
    drop = (
        keep
        + "  redis.call('HDEL', KEYS[2], 'payload', 'payload_sha', 'relay')\n"
        + "  redis.call('ZREM', KEYS[5], member)\n"
    )
    mutations = [
        ("admit-6", drop, keep),
        ("relay-5", "if not fx[6] or fx[7] ~= fx[8] then", "if not fx[6] then"),
    ]
    (rep,) = explore([TAKEOVER], mutate=mutations)
    assert found(rep, "I-intent", "not the pinned intent: relay_claim"), render([rep])


@pytest.mark.timeout(600)
def test_the_exploration_is_reproducible() -> None:
    a, b = explore([HOLES[1]]), explore([HOLES[1]])
    assert (a[0].states, a[0].transitions, a[0].checks) == (
        b[0].states,
        b[0].transitions,
        b[0].checks,
    )


@pytest.mark.timeout(600)
def test_mutation_record_without_the_index_update() -> None:
    """Issue 17: a recorded outcome that leaves the step in the "needs a decision" index is
    found (the index is checked after every step, I-index)."""
    line = "index(KEYS[3], ARGV[6], state, fmt(now))\n"
    (rep,) = explore([ZOMBIE], mutate=[("record-3", line, "")])
    assert found(rep, "I-index", "succeeded, indexed"), render([rep])


@pytest.mark.timeout(600)
def test_mutation_relay_claim_without_the_index_update() -> None:
    """A relay claim that does not index its dispatch: a relay that dies holding the step
    would never show up as "dispatching past its deadline" (I-index)."""
    line = "index(KEYS[5], member, 'dispatching', fmt(deadline))\n"
    (rep,) = explore([TAKEOVER], mutate=[("relay-5", line, "")])
    assert found(rep, "I-index", "dispatching, not indexed"), render([rep])
