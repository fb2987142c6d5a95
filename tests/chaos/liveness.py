"""Liveness next to safety: every chaos run asks whether the gateways are still serving.

A probe stream per gateway URL (one `fencegate serve` process, or a `--workers N` supervisor's
port) registers ever higher generations on 32 jobs spread over the slots (each one a deciding
script: a marker check and a counter raised, as every verdict), on a new connection each time
(so the workers behind one port all take turns), 4 per second, while the harness injects its
faults and the periodic checks run with short intervals. The harness marks each fault's
window (:meth:`Liveness.begin` when it is injected, :meth:`Liveness.heal` when it is undone).
The checks:

L1 after each fault heals, every gateway answers ≥ 99 % of its probe calls with a verdict (not
   503, not a lost answer) from at most the fault kind's bound (:data:`BOUNDS`) after the heal
   until the next fault begins; and in a quiet spell at the end of the run, every gateway;
L2 no quarantine without real data loss: only the ``restore`` fault (a real AOF backup taken
   mid-run put back) loses acknowledged writes, so no gateway may log that Redis went back
   (``redis_slots_went_back``, ``redis_older_than_last_seen``, ``redis_slot_went_back``,
   ``redis_witness_went_back``) outside a restore's window, and every gateway's ``/readyz`` is
   ready at the end;
L3 every step ends in a final state (succeeded, failed, released) or is listed for a decision
   (``GET /v1/attention``).

Time to recover: from the heal to the first verdict after which ≥ 99 % of the window's calls
are verdicts.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

# the bound (seconds after the heal) within which every gateway must serve again, per fault
# kind: a restarted Redis or gateway is reconnected within the client's retry backoff and one
# `redis.timeout_seconds`; a failover needs the replicas' resync (the harness heals it when
# writes are acknowledged again) and one topology check; the wire phase's held bytes and the
# relay's retries drain within `DISPATCH_TIMEOUT` and a few seconds
BOUNDS: dict[str, float] = {
    "wire_phase": 10.0,
    "gateway_kill": 5.0,
    "proxy_fault": 5.0,
    "redis_kill": 5.0,
    "empty_restart": 5.0,
    "restore": 5.0,  # healed when the operator's init and the re-registration are done
    "replica_stop": 10.0,
    "primary_kill": 10.0,
    "lagging_failover": 10.0,
    "plain_failover": 10.0,
    "lagging_kill": 10.0,
}
SHARE = 0.99  # the share of verdicts required after recovery
FALSE_ALARMS = (
    "redis_slots_went_back",
    "redis_older_than_last_seen",
    "redis_slot_went_back",
    "redis_witness_went_back",
)
FINAL = ("succeeded", "failed", "released")
PERIOD = 0.25  # seconds between probe calls, per gateway URL


class Hop:
    """Stands where the harness has its one gateway: every ``url`` is one of them at random."""

    def __init__(self, gateways: list[Any], rng: Any) -> None:
        self.gateways, self.rng = gateways, rng
        self.picks = [0] * len(gateways)
        self.live = list(range(len(gateways)))  # the check leaves out one that stopped answering

    @property
    def url(self) -> str:
        i = self.rng.choice(self.live)
        self.picks[i] += 1
        return str(self.gateways[i].url)

    @property
    def proc(self) -> Any:
        """A dead gateway's process if there is one (C5 looks at it), else the first's."""
        procs = [g.proc for g in self.gateways]
        return next((p for p in procs if p is None or p.poll() is not None), procs[0])

    def close(self) -> None:
        for g in self.gateways:
            if g.proc is not None and g.proc.poll() is None:
                g.proc.kill()  # a wedged one does not act on SIGTERM: no waiting for it
            g.close()


@dataclass
class Probe:
    url: str
    invoked: float
    completed: float = 0.0
    status: int = 0  # 0: no answer

    @property
    def verdict(self) -> bool:
        return self.status not in (0, 500, 502, 503, 504)


@dataclass
class Window:
    kind: str
    start: float
    healed: float = 0.0
    # a fault that loses acknowledged writes on purpose (a restored backup): the quarantine
    # it causes is the right answer, not a false alarm (L2), if logged while it lasts
    loses_writes: bool = False
    wall_start: float = 0.0
    wall_healed: float = 0.0


@dataclass
class KindFigures:
    faults: int = 0
    during: list[Probe] = field(default_factory=list)
    after: list[Probe] = field(default_factory=list)
    recover_s: list[float] = field(default_factory=list)
    late: list[str] = field(default_factory=list)  # L1 problems


class Liveness:
    def __init__(self, urls: list[str], logs: list[Path]) -> None:
        self.urls, self.logs = urls, logs
        self.calls: list[Probe] = []
        self.windows: list[Window] = []
        self.final_from = 0.0
        self._generation = itertools.count(1)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.problems: list[str] = []
        self.kinds: dict[str, KindFigures] = {}
        self.true_quarantine_lines = 0  # went-back lines inside a restore's window

    # -- the harness marks its faults ---------------------------------------------

    def begin(self, kind: str, *, loses_writes: bool = False) -> Window:
        window = Window(kind, time.monotonic(), loses_writes=loses_writes, wall_start=time.time())
        self.windows.append(window)
        return window

    def heal(self, window: Window) -> None:
        window.healed = time.monotonic()
        window.wall_healed = time.time()

    def _expected(self, line: str) -> bool:
        """A went-back line logged while a fault that loses writes lasted."""
        try:
            stamp = datetime.fromisoformat(json.loads(line)["timestamp"].replace("Z", "+00:00"))
        except (ValueError, KeyError, TypeError):
            return False
        at = stamp.timestamp()
        return any(
            w.loses_writes and w.wall_start - 1 <= at <= (w.wall_healed or time.time()) + 1
            for w in self.windows
        )

    # -- the probe streams ---------------------------------------------------------

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._probe(n, url)) for n, url in enumerate(self.urls)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _probe(self, n: int, url: str) -> None:
        timeout = aiohttp.ClientTimeout(total=3)
        connector = aiohttp.TCPConnector(force_close=True)  # each call its own connection
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            for k in itertools.count():
                if self._stop.is_set():
                    return
                call = Probe(url, time.monotonic())
                self.calls.append(call)
                job = f"live{n}-{k % 32}"
                try:
                    body = {"generation": next(self._generation)}
                    async with http.post(f"{url}/v1/jobs/{job}/generations", json=body) as r:
                        await r.read()
                        call.status = r.status
                except (aiohttp.ClientError, TimeoutError):
                    call.status = 0
                call.completed = time.monotonic()
                await asyncio.sleep(max(0.0, PERIOD - (call.completed - call.invoked)))

    async def quiet_spell(self, seconds: float = 2.0) -> None:
        """No fault for ``seconds``: the calls of this spell must be verdicts (L1)."""
        self.final_from = time.monotonic()
        await asyncio.sleep(seconds)

    # -- the checks ----------------------------------------------------------------

    async def check(self, http: aiohttp.ClientSession, jobs: dict[str, str]) -> dict[str, bool]:
        """L1-L3 (``jobs``: job -> a gateway URL to read it through). Call after
        :meth:`quiet_spell` and :meth:`stop`."""
        problems: list[str] = []
        self._recovery(problems)
        for url in self.urls:
            spell = [c for c in self.calls if c.url == url and c.invoked >= self.final_from]
            bad = sum(not c.verdict for c in spell)
            if not spell or bad > (1 - SHARE) * len(spell):
                problems.append(f"L1 {url}: {bad} of {len(spell)} calls of the quiet spell refused")
        # L2: nothing went back, every gateway ready
        for path in self.logs:
            text = path.read_text(errors="replace") if path.exists() else ""
            for line in text.splitlines():
                event = next((e for e in FALSE_ALARMS if f'"{e}"' in line), None)
                if event is None:
                    continue
                if self._expected(line):
                    self.true_quarantine_lines += 1
                else:
                    problems.append(f"L2 {path.parent.name}/{path.name}: {event} (false alarm)")
        for url in self.urls:
            try:
                async with http.get(url + "/readyz") as r:
                    ready = await r.json(content_type=None)
                    if r.status != 200:
                        why = " ".join(str(ready.get(k)) for k in ("cause", "marker", "detail"))
                        problems.append(f"L2 {url}/readyz {r.status}: {why}")
            except (aiohttp.ClientError, TimeoutError) as exc:
                problems.append(f"L2 {url}/readyz: no answer ({type(exc).__name__})")
        # L3: every step final or listed for a decision
        listed: set[tuple[str, str]] = set()
        for url in self.urls[:1]:
            cursor = ""
            for _ in range(100):
                q = f"{url}/v1/attention?limit=1000" + (f"&cursor={cursor}" if cursor else "")
                async with http.get(q) as r:
                    page = await r.json(content_type=None)
                listed |= {(i["job_id"], i["step"]) for i in page.get("items", [])}
                if not (cursor := page.get("next_cursor") or ""):
                    break
        for job, url in sorted(jobs.items()):
            try:
                async with http.get(f"{url}/v1/jobs/{job}") as r:
                    view = await r.json(content_type=None) if r.status == 200 else {}
            except (aiohttp.ClientError, TimeoutError):
                view = {}
            for step, rec in (view.get("effects") or {}).items():
                state = rec.get("state")
                if state not in FINAL and (job, step) not in listed:
                    problems.append(f"L3 {job}:{step}: {state}, not listed for a decision")
        self.problems = problems
        c = {p.split()[0] for p in problems}
        return {
            "L1 after each fault heals, every gateway gives >= 99 % verdicts within the bound": (
                "L1" not in c
            ),
            "L2 no quarantine and no slot gone back without a real data loss": "L2" not in c,
            "L3 every step final or listed for a decision": "L3" not in c,
        }

    def _recovery(self, problems: list[str]) -> None:
        windows = sorted(self.windows, key=lambda w: w.start)
        ends = [w.start for w in windows[1:]] + [self.final_from or time.monotonic()]
        for w, end in zip(windows, ends, strict=True):
            fig = self.kinds.setdefault(w.kind, KindFigures())
            fig.faults += 1
            healed = w.healed or end
            fig.during += [c for c in self.calls if w.start <= c.invoked < healed]
            bound = BOUNDS.get(w.kind, 10.0)
            for url in self.urls:
                after = sorted(
                    (c for c in self.calls if c.url == url and healed <= c.invoked < end),
                    key=lambda c: c.invoked,
                )
                fig.after += after
                if not after:
                    continue  # the next fault began at once: its window judges
                recovered = _recovered_at(after)
                if recovered is None:
                    if after[-1].invoked - healed > bound:
                        fig.late.append(f"L1 {w.kind} {url}: not serving again within {bound} s")
                    continue
                took = max(0.0, recovered - healed)
                fig.recover_s.append(took)
                if took > bound:
                    fig.late.append(f"L1 {w.kind} {url}: serving again {took:.2f} s after the "
                                    f"heal (bound {bound} s)")  # fmt: skip
            problems += fig.late

    def rows(self) -> list[tuple[str, str]]:
        """Per fault kind: faults, probe calls during / after, the 503 share of each, time to
        recover p50 / max (its bound)."""
        out = []
        for kind, f in self.kinds.items():
            rec = sorted(f.recover_s)
            took = f"{statistics.median(rec):.2f} s / {rec[-1]:.2f} s" if rec else "- / -"
            out.append((
                f"liveness {kind}: faults; calls during / after; refused during / after; "
                "recover p50 / max (bound)",
                f"{f.faults}; {len(f.during)} / {len(f.after)}; {_share(f.during)} / "
                f"{_share(f.after)}; {took} ({BOUNDS.get(kind, 10.0):.0f} s)",
            ))  # fmt: skip
        spell = [c for c in self.calls if c.invoked >= self.final_from]
        alarms = sum(p.startswith("L2") for p in self.problems)
        out += [
            ("liveness: probe calls / refused in the quiet spell at the end",
             f"{len(self.calls)} / {sum(not c.verdict for c in spell)}"),
            ("false quarantines or slots gone back (must be 0)", str(alarms)),
            ("went-back lines inside a restore's window (true quarantines)",
             str(self.true_quarantine_lines)),
        ]  # fmt: skip
        return out


def _share(calls: list[Probe]) -> str:
    if not calls:
        return "-"
    return f"{100 * sum(not c.verdict for c in calls) / len(calls):.1f} %"


def _recovered_at(calls: list[Probe]) -> float | None:
    """The completion of the first verdict from which ≥ 99 % of the calls are verdicts."""
    bad_after = sum(not c.verdict for c in calls)  # refusals from index i on
    for i, c in enumerate(calls):
        if c.verdict and bad_after <= (1 - SHARE) * (len(calls) - i):
            return c.completed
        bad_after -= not c.verdict
    return None
