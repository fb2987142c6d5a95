"""The short, seeded chaos run (make test); `make chaos` runs the long one."""

from __future__ import annotations

import os

from tests.chaos.harness import run


def test_short_chaos_run_holds_every_invariant() -> None:
    seed = int(os.environ.get("FENCEGATE_CHAOS_SEED", "20261130"))
    ok, report = run(seed, long=False)
    print("\n" + report)
    assert ok, report
    kills = "before_admit 2, after_admit 2, after_dispatch 2, after_record 2"
    assert f"gateway SIGKILLs by crash point | {kills}" in report
    assert "empty-Redis restarts failing closed / dispatches during them | 2 / 0" in report
