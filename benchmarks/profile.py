"""Profile the gateway under load with py-spy and print where its time goes.

    python -m benchmarks.profile [--scenario accepted|replay|stale] [--requests N]   (make profile)

Starts the same pinned stack as ``make bench`` (durable redis-server, upstream,
``fencegate serve``), attaches ``py-spy record`` to the gateway process while
the load generator drives one scenario at 64 connections, and prints the
functions with the most samples: self time (where the CPU is spent) and
inclusive time (which call paths are expensive). The raw collapsed stacks are
kept in benchmarks/results/profile-<scenario>.txt, loadable into
speedscope.app or flamegraph.pl.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.loadgen import LeanClient
from benchmarks.run import LOAD_CORE, RESULTS, Stack, pin, run_loop


def summarize(collapsed: Path, top: int) -> str:
    """Self and inclusive sample counts per function from py-spy's collapsed stacks."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = [f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0].rsplit("/", 1)[-1] + ")"
                  for f in stack.split(";")]  # fmt: skip
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    lines = [f"{total} samples", "", "self time:"]
    lines += [f"  {n / total:6.1%}  {f}" for f, n in own.most_common(top)]
    lines += ["", "inclusive time:"]
    lines += [f"  {n / total:6.1%}  {f}" for f, n in inclusive.most_common(top * 2)]
    return "\n".join(lines)


async def drive(stack: Stack, scenario: str, n: int, concurrency: int, on_ready: object) -> None:
    run_id = secrets.token_hex(3)
    jobs = [f"prof-{run_id}-{i}" for i in range(n)]
    body = {"adapter": "hook", "operation": "send", "payload": {"to": ["a@example.com"]}}
    gw = LeanClient("127.0.0.1", stack.gw_port)

    async def each(raws: list[bytes], expect: int) -> None:
        it = iter(raws)

        async def worker() -> None:
            for raw in it:
                status, answer = await gw.send(raw)
                assert status == expect, (status, answer[:200])

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    def register(gen: int) -> list[bytes]:
        return [LeanClient.build("POST", f"/v1/jobs/{j}/generations", {"generation": gen})
                for j in jobs]  # fmt: skip

    effects = [
        LeanClient.build("POST", f"/v1/jobs/{j}/effects/notify", body, {"Fencing-Token": "1"})
        for j in jobs
    ]
    try:
        await each(register(1), 201)
        if scenario in ("replay", "stale"):
            await each(effects, 200)
        if scenario == "stale":
            await each(register(2), 201)
        on_ready()  # type: ignore[operator]
        await each(effects, 409 if scenario == "stale" else 200)
    finally:
        gw.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenario", choices=("accepted", "replay", "stale"), default="replay")
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--native", action="store_true", help="include C frames (py-spy --native)")
    args = parser.parse_args()
    # --native needs to stop the process for each sample (py-spy refuses --nonblocking with it)
    extra = ["--native"] if args.native else ["--nonblocking"]
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    pin(0, LOAD_CORE)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"profile-{args.scenario}.txt"
    out.unlink(missing_ok=True)  # never summarise an older run's stacks
    with tempfile.TemporaryDirectory(prefix="fencegate-prof-") as tmp:
        stack = Stack(Path(tmp), 1)
        stack.place("gateway")
        recorder: list[subprocess.Popen[bytes]] = []

        def start() -> None:
            cmd = [spy, "record", "--pid", str(stack.gateway.pid), "--rate", "500",
                   "--format", "raw", "--output", str(out), *extra]  # fmt: skip
            recorder.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=sys.stderr))
            time.sleep(0.5)  # let py-spy attach before the measured load starts

        try:
            run_loop(drive(stack, args.scenario, args.requests, args.concurrency, start))
        finally:
            for r in recorder:
                r.send_signal(2)  # SIGINT: py-spy writes its output and exits
                r.wait(30)
            stack.stop()
    if not out.exists():
        raise SystemExit(f"py-spy wrote no profile (exit status {recorder[0].returncode})")
    print(f"py-spy, scenario {args.scenario!r}, {args.requests} calls at {args.concurrency}")
    print(summarize(out, args.top))
    print(f"\ncollapsed stacks: {out}")


if __name__ == "__main__":
    main()
