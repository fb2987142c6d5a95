"""The exhaustive check of the protocol at the default bound, in `make test`.

Runs :data:`tests.model.explore.DEFAULT` once (a real redis-server, every
interleaving of the real scripts, invariants after every step) and asserts that
no invariant is violated. Mutation tests then break one check of the scripts on
purpose (in memory, no old code kept) and assert that the explorer finds the
hole it re-opens. See tests/model/README.md for what it found on d36082e.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.model.explore import (
    DEFAULT,
    HOLES,
    JOBS,
    RESTORE,
    RESTORE_SYNC,
    Report,
    Scenario,
    explore,
    render,
    w,
)

pytestmark = pytest.mark.slow


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
    """The stale check lives in the fence guard (includes/fence); admit-8's source has its own
    copy of the include, so the mutation removes it from the admit only."""
    line = "if gen < g.fence then return g.reject('stale_generation') end"
    wanted = ("I-stale", "below the fence: admit")
    (rep,) = explore(
        [ZOMBIE], mutate=[("admit-8", line, "")], stop_when=lambda r: found(r, *wanted)
    )
    assert found(rep, *wanted), render([rep])


@pytest.mark.timeout(600)
def test_mutation_relay_claim_without_the_fence_check_is_hole_2() -> None:
    wanted = ("I-stale", "below the fence: relay_claim")
    (rep,) = explore(
        [TAKEOVER],
        mutate=[("relay-6", "if gen < fence then", "if false then")],
        stop_when=lambda r: found(r, *wanted),
    )
    assert found(rep, *wanted), render([rep])


@pytest.mark.timeout(600)
def test_mutation_payload_not_bound_to_the_intent_is_hole_1() -> None:
    """A sync re-pin keeps the async payload and the queue entry, and the relay claim does
    not check that the payload belongs to the pinned intent: d36082e's hole 1."""
    keep = (
        "  -- a synchronous dispatch owns the step now: no stored payload, no queue entry (only"
        " a relay\n  -- step is queued)\n"
    )
    drop = (
        keep
        + "  present(gone, 'payload', 'payload_sha', 'relay')\n"
        + "  if h.relay then queue_remove(KEYS[5], KEYS[7], member) end\n"
    )
    mutations = [
        ("admit-8", drop, keep),
        ("relay-6", "if not fx[6] or fx[7] ~= fx[8] then", "if not fx[6] then"),
    ]
    wanted = ("I-intent", "not the pinned intent: relay_claim")
    (rep,) = explore([TAKEOVER], mutate=mutations, stop_when=lambda r: found(r, *wanted))
    assert found(rep, *wanted), render([rep])


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
    """A record that changes the step's state must update the attention index in the same
    script: a recorded outcome left in the index is found (I-index, after every step)."""
    line = "index(KEYS[3], ARGV[6], state, fmt(now))\n"
    wanted = ("I-index", "succeeded, indexed")
    (rep,) = explore(
        [ZOMBIE], mutate=[("record-4", line, "")], stop_when=lambda r: found(r, *wanted)
    )
    assert found(rep, *wanted), render([rep])


@pytest.mark.timeout(600)
def test_mutation_relay_claim_without_the_index_update() -> None:
    """A relay claim that does not index its dispatch: a relay that dies holding the step
    would never show up as "dispatching past its deadline" (I-index)."""
    line = "index(KEYS[5], member, 'dispatching', fmt(deadline))\n"
    wanted = ("I-index", "dispatching, not indexed")
    (rep,) = explore(
        [TAKEOVER], mutate=[("relay-6", line, "")], stop_when=lambda r: found(r, *wanted)
    )
    assert found(rep, *wanted), render([rep])


# -- the job's own state: checkpoints, outputs, the completion -------------------------
# JOBS: J (generation 1: heartbeat, checkpoint, stage, record, complete) and K (generation 2,
# after the takeover: the same without the heartbeat); then the same with one lost reply or
# timeout on any script.


@pytest.mark.timeout(600)
def test_the_job_state_bound_has_no_violations() -> None:
    reports = explore(JOBS)
    print("\n" + render(reports))
    assert [r.scenario for r in reports] == [s.name for s in JOBS]
    for r in reports:
        assert r.states > 50 and r.transitions > r.states and not r.truncated, r.summary()
        assert r.quiescent > 0, r.summary()
    assert not [r for r in reports if r.violations], render(reports)


GUARD_STALE = "if gen < g.fence then return g.reject('stale_generation') end"  # includes/fence
JOB_TAKEOVER = JOBS[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("script", "line", "wanted"),
    [
        ("checkpoint-3", GUARD_STALE, ("I-fenced-write", "below the fence: checkpoint")),
        ("output-stage-3", GUARD_STALE, ("I-fenced-write", "below the fence: output stage")),
        ("output-record-3", GUARD_STALE, ("I-fenced-write", "below the fence: output record")),
        ("complete-3", GUARD_STALE, ("I-fenced-write", "below the fence: completion")),
        ("heartbeat-2", GUARD_STALE, ("I-current", "heartbeat-2: not the fence's generation")),
    ],
)
def test_mutation_a_job_state_script_without_its_stale_check(
    script: str, line: str, wanted: tuple[str, str]
) -> None:
    """Each job-state script with its own copy of the stale check removed (the include is
    inlined per script): the zombie of generation 1, after register(2), lands its write (or,
    the heartbeat, is told it is current)."""
    (rep,) = explore(
        [JOB_TAKEOVER], mutate=[(script, line, "")], stop_when=lambda r: found(r, *wanted)
    )
    assert found(rep, *wanted), render([rep])
    trace = rep.violations[wanted[0], next(s for i, s in rep.violations if i == wanted[0])].trace
    assert "scheduler: register(2): 201" in trace, trace


# -- two gateway processes and a restore -------------------------------------------------
# RESTORE_SYNC: A (generation 1, sync) on P2; B (generation 2) and the scheduler on P1; the
# backup is any state of the path, and Redis goes back to it once.


def restore_found(rep: Report, phase: str = "") -> list[str]:
    """Signatures of sends below the acknowledged fence on the restored Redis."""
    return [
        s
        for i, s in rep.violations
        if i == "I-fence" and s.startswith("below the acknowledged fence: admit") and phase in s
    ]


@pytest.fixture(scope="module")
def restore_reports() -> dict[str, Report]:
    scns = [*RESTORE, replace(RESTORE_SYNC, name="restore-sync-own", marks="own"),
            replace(RESTORE_SYNC, name="restore-sync-hosts", marks="hosts")]  # fmt: skip
    reports = explore(scns)
    print("\n" + render(reports))
    return {r.scenario: r for r in reports}


@pytest.mark.timeout(600)
def test_restore_with_marks_shared_by_the_data_dir_sends_nothing_below_the_fence(
    restore_reports: dict[str, Report],
) -> None:
    """Both processes on one data dir (SlotMarks on one file): after a restore that lost an
    acknowledged register(2), no process admits generation 1 -- the first call meets the
    slot behind the shared mark and quarantines Redis -- and a restore that lost nothing
    never quarantines."""
    rep = restore_reports["restore-sync-shared"]
    assert rep.states > 100 and not rep.truncated, rep.summary()
    assert rep.quarantined > 0, rep.summary()  # the restores that lost writes were caught
    assert not rep.violations, render([rep])


@pytest.mark.timeout(600)
def test_restore_with_each_process_s_own_marks_is_hole_2(
    restore_reports: dict[str, Report],
) -> None:
    """The store of 4a7c224 (each process's marks in its memory, no quarantine): P1 had
    register(2) acknowledged, Redis goes back, and P2 -- which never saw the lost write --
    admits generation 1 and sends."""
    rep = restore_reports["restore-sync-own"]
    assert restore_found(rep), render([rep])
    trace = rep.violations["I-fence", restore_found(rep)[0]].trace
    assert any("P1 scheduler: register(2): 201" in t for t in trace), trace
    assert any("restored from the backup (lost writes)" in t for t in trace), trace
    assert trace[-1] == 'P2 A: send gen=1 {"amount":10000} -> ok', trace


@pytest.mark.timeout(600)
def test_restore_with_marks_per_host_and_no_witness_is_hole_2(
    restore_reports: dict[str, Report],
) -> None:
    """One data dir per process and no witness: the slot marks alone cannot protect a
    process that never saw the lost writes (what the witness is for)."""
    rep = restore_reports["restore-sync-hosts"]
    assert restore_found(rep), render([rep])


@pytest.mark.timeout(600)
def test_restore_with_the_witness_leaves_only_the_window_before_a_detecting_tick(
    restore_reports: dict[str, Report],
) -> None:
    """One data dir per process, each with its witness tick (RedisLink.witness) as an action.
    A send below the acknowledged fence remains possible only before a tick that can detect
    the restore: before any tick since the restore, or when the data dir that saw the lost
    writes had not ticked between the backup and the restore (a backup younger than one
    marks interval). After a detecting tick Redis is quarantined and nothing is authorised
    (docs/reliability.md, "What remains")."""
    rep = restore_reports["restore-min-hosts-witness"]
    assert restore_found(rep, "before any witness tick"), render([rep])
    assert not restore_found(rep, "after a detecting witness tick"), render([rep])
    assert rep.quarantined > 0, rep.summary()
    assert not rep.unexpected() and not rep.missing(), render([rep])
