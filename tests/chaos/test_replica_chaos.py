"""The short chaos run with replicas (make test): a Valkey primary and replica,
replicas_acked = 1, a replica stop, a primary kill and a lagging failover under zombie
traffic; `make chaos` runs the long one."""

from __future__ import annotations

import os
import re

import pytest

from tests.chaos.replicas import run

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


def _figure(report: str, name: str) -> str:
    match = re.search(rf"^\| {re.escape(name)} \| (.*) \|$", report, re.M)
    assert match, f"no row {name!r} in the report"
    return match.group(1)


@pytest.mark.timeout(300)  # three failovers with full resyncs on a shared 2-core machine
def test_short_replica_chaos_run_holds_every_invariant() -> None:
    seed = int(os.environ.get("FENCEGATE_CHAOS_SEED", "20261201"))
    ok, report = run(seed, long=False)
    print("\n" + report)
    assert ok, report
    # alive, not only safe: no false quarantine, and the gateways served after every fault
    assert _figure(report, "false quarantines or slots gone back (must be 0)") == "0"
    assert _figure(report, "replica stops / primary kills / lagging failovers") == "1 / 1 / 1"
    assert _figure(report, "stale effects applied") == "0"
    assert _figure(report, "superseded sends (must be 0)") == "0"
    # the faults were felt: some verdicts were withheld while the replica lagged or was gone
    assert int(_figure(report, "calls answered 503 (withheld or refused during faults)")) > 0
