"""Issue 13, "what it must show": a short hostile-load run (the CI version of `make hostile`).
Tenant A floods ~200 KB async calls against a slow receiver, holds 1,000 idle sockets and
30 bodies that never arrive; tenant B's synchronous calls all succeed within 3 s, nothing
answers 5xx, Redis stays bounded by A's payload quota, and every log line is JSON."""

from __future__ import annotations

import json
import subprocess
import sys


def test_tenant_b_is_served_while_tenant_a_attacks() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.hostile", "--seconds", "6", "--idle", "1000",
         "--slow-bodies", "30", "--payload-cap-mb", "8"],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    print(summary)
    assert summary["b_calls"] >= 10, summary
    assert summary["b_failures"] == 0, summary
    assert summary["five_xx"] == 0, summary
    assert summary["a_idle_sockets_peak"] >= 1000, summary
    assert summary["a_statuses"].get("429", 0) > 0, summary  # the payload quota held A back
    # A's payloads are capped at 8 MiB; the rest is Redis's own (16,384 slot markers, AOF
    # and client buffers with ~200 KB requests in flight), B's records and A's jobs
    assert summary["redis_peak_used_memory_mb"] < 8 + 24, summary
    assert summary["non_json_log_lines"] == 0, summary
    assert out.returncode == 0, out.stderr[-2000:]
