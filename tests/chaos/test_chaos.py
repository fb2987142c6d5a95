"""The short, seeded chaos run (make test); `make chaos` runs the long one."""

from __future__ import annotations

import os
import re

import pytest

from tests.chaos.harness import run

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


def _figure(report: str, name: str) -> str:
    match = re.search(rf"^\| {re.escape(name)} \| (.*) \|$", report, re.M)
    assert match, f"no row {name!r} in the report"
    return match.group(1)


@pytest.mark.timeout(300)  # two gateways (one of them serve --workers 2) on a shared 2-core machine
def test_short_chaos_run_holds_every_invariant() -> None:
    seed = int(os.environ.get("FENCEGATE_CHAOS_SEED", "20261130"))
    ok, report = run(seed, long=False)
    print("\n" + report)
    assert ok, report
    # alive, not only safe: no false quarantine, and the gateways served after every fault
    assert _figure(report, "false quarantines or slots gone back (must be 0)") == "0"
    kills = "before_admit 2, after_admit 2, after_dispatch 2, after_record 2"
    assert f"gateway SIGKILLs by crash point | {kills}" in report
    assert "empty-Redis restarts failing closed / dispatches during them | 2 / 0" in report
    # a real AOF backup put back mid-run: refused by both gateways, 0 sent, quarantined (the
    # one true quarantine), and both serve again after the operator's init
    restored = "restored AOF backups / calls of the old generation refused / sent / quarantined"
    assert _figure(report, restored) == "1 / 6 of 6 / 0 / 1"
    assert int(_figure(report, "went-back lines inside a restore's window (true quarantines)")) > 0
    # the wire phase really ran: faults on both wires, the relay and takeovers in its retries
    assert _figure(report, "wire faults hit, gateway-Redis") != "none"
    assert _figure(report, "wire faults hit, gateway-downstream") != "none"
    _, accepted, _ = _figure(report, "async calls sent / accepted (202) / async steps").split(" / ")
    assert int(accepted) > 0
    # takeovers during relay retries are reported, not asserted: how many there are depends
    # on how soon the relay makes its first attempt (see the relay latency row)
    assert _figure(report, "superseded sends (must be 0)") == "0"
    assert _figure(report, "unknown steps left (reported)").startswith("0")
