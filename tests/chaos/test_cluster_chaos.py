"""The short chaos run on a Valkey Cluster (make test): 3 primaries + 3 replicas,
replicas_acked = 1, two gateways a worker's calls hop between; a primary kill -9 (automatic
failover), a replica stop, a plain CLUSTER FAILOVER and a lagging replica's promotion after kill -9
under zombie traffic. `make chaos`
runs the long one."""

from __future__ import annotations

import os

import pytest

from tests.chaos.cluster import run
from tests.chaos.test_replica_chaos import _figure

pytestmark = [pytest.mark.chaos, pytest.mark.cluster, pytest.mark.slow]


@pytest.mark.timeout(300)  # ~45 s alone; failovers and resyncs on a shared 2-core machine
def test_short_cluster_chaos_run_holds_every_invariant() -> None:
    seed = int(os.environ.get("FENCEGATE_CHAOS_SEED", "20261201"))
    ok, report = run(seed, long=False)
    print("\n" + report)
    assert ok, report
    # alive, not only safe: no false quarantine, and the gateways served after every fault
    assert _figure(report, "false quarantines or slots gone back (must be 0)") == "0"
    faults = "primary kills / replica stops / plain failovers / lagging kills"
    assert _figure(report, faults) == "1 / 1 / 1 / 1"
    assert _figure(report, "failovers (automatic after kill -9 + plain)") == "3"
    assert _figure(report, "stale effects applied") == "0"
    assert _figure(report, "superseded sends (must be 0)") == "0"
    applied, duplicates = _figure(report, "effects applied downstream / duplicates").split(" / ")
    assert int(applied) > 0 and duplicates == "0"
    # both gateways served calls, and the faults were felt (verdicts withheld meanwhile)
    assert all(
        int(n) > 0 for n in _figure(report, "calls through gateway 1 / gateway 2").split(" / ")
    )
    assert int(_figure(report, "calls answered 503 (withheld or refused during faults)")) > 0
