"""The exhaustive check of the protocol at the default bound (issue 12), in `make test`.

Runs :data:`tests.model.explore.DEFAULT` once (a real redis-server, every
interleaving of the real scripts) and asserts on its reports. On the scripts
of d36082e (recognised by their digest) the protocol is known to be broken:
there the test asserts that the explorer finds holes 1, 2 and 3 of issue 12;
on any other scripts it asserts that no invariant is violated.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.model.explore import DEFAULT, HOLES, Report, Scenario, explore, render, w

# sha256 over gateway/lua/*.lua (name, NUL, content, NUL, sorted) at d36082e
OLD_SCRIPTS = "6fe514f695e4aa7f5f4bbee10491aa0bbc140bbf0db4137e273602c87eb118bd"


def scripts_digest() -> str:
    h = hashlib.sha256()
    for p in sorted((Path(__file__).parents[2] / "gateway" / "lua").glob("*.lua")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


OLD = scripts_digest() == OLD_SCRIPTS


@pytest.fixture(scope="module")
def default_reports() -> list[Report]:
    reports = explore(DEFAULT)
    print("\n" + render(reports))
    return reports


def signatures(reports: list[Report]) -> dict[str, set[tuple[str, str]]]:
    return {r.scenario: set(r.violations) for r in reports}


@pytest.mark.timeout(900)
def test_default_bound_explores_every_scenario(default_reports: list[Report]) -> None:
    assert [r.scenario for r in default_reports] == [s.name for s in DEFAULT]
    for r in default_reports:
        assert r.states > 100 and r.transitions > r.states and not r.truncated, r.summary()


@pytest.mark.timeout(900)
@pytest.mark.skipif(OLD, reason="the scripts of d36082e: holes 1-3 are asserted instead")
def test_default_bound_has_no_violations(default_reports: list[Report]) -> None:
    broken = [r for r in default_reports if r.violations]
    assert not broken, render(broken)


@pytest.mark.timeout(900)
@pytest.mark.skipif(not OLD, reason="only the scripts of d36082e have the known holes")
def test_finds_holes_1_2_3_on_d36082e(default_reports: list[Report]) -> None:
    sig = signatures(default_reports)
    takeover, resolved = (sig[s.name] for s in HOLES)
    # hole 1: the relay sends generation 1's payload under generation 2's pinned intent
    assert ("I-intent", "not the pinned intent: relay_claim of a released step") in takeover
    # hole 2: the relay retries a released step of generation 1 after register(2)
    assert ("I-stale", "below the fence: relay_claim of a released step") in takeover
    # hole 3: after an operator resolved it not_delivered, a stale async call's queue entry
    # makes the relay send the old payload
    assert (
        "I-stale",
        "below the fence: relay_claim of a released, operator-resolved step",
    ) in resolved


ZOMBIE = Scenario("zombie-sync", (w("A", 1, "sync", 10000), w("B", 2, "sync", 2500)),
                  outcomes=("ok",), advances=0)  # fmt: skip


@pytest.mark.timeout(300)
def test_a_broken_admit_is_caught() -> None:
    """Mutation: the admit without its stale check lets a zombie through; the explorer must
    say so (I-stale). If the admit script no longer has this line, update the mutation."""
    line = "if gen < fence then return reject('stale_generation') end"
    (rep,) = explore([ZOMBIE], mutate=("admit-5", line, ""))
    assert ("I-stale", "below the fence: admit of a - step") in rep.violations or any(
        i == "I-stale" and s.startswith("below the fence: admit") for i, s in rep.violations
    ), render([rep])


@pytest.mark.timeout(300)
def test_the_exploration_is_reproducible() -> None:
    a, b = explore([HOLES[1]]), explore([HOLES[1]])
    assert (a[0].states, a[0].transitions, a[0].checks) == (
        b[0].states,
        b[0].transitions,
        b[0].checks,
    )
    assert {k: v.trace for k, v in a[0].violations.items()} == {
        k: v.trace for k, v in b[0].violations.items()
    }
