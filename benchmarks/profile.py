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

import aiohttp

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
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(f"http://127.0.0.1:{stack.gw_port}", connector=conn) as gw:

        async def each(call: object) -> None:
            it = iter(range(n))

            async def worker() -> None:
                for i in it:
                    await call(i)  # type: ignore[operator]

            await asyncio.gather(*(worker() for _ in range(concurrency)))

        async def register(i: int, gen: int = 1) -> None:
            async with gw.post(f"/v1/jobs/{jobs[i]}/generations", json={"generation": gen}) as r:
                assert r.status == 201, await r.text()

        async def effect(i: int, token: str = "1", expect: int = 200) -> None:
            async with gw.post(
                f"/v1/jobs/{jobs[i]}/effects/notify", json=body, headers={"Fencing-Token": token}
            ) as r:
                await r.read()
                assert r.status == expect, r.status

        await each(register)
        if scenario in ("replay", "stale"):
            await each(effect)
        if scenario == "stale":
            await each(lambda i: register(i, 2))
        on_ready()  # type: ignore[operator]
        expect = 409 if scenario == "stale" else 200
        await each(lambda i: effect(i, "1", expect))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenario", choices=("accepted", "replay", "stale"), default="replay")
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    pin(0, LOAD_CORE)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"profile-{args.scenario}.txt"
    with tempfile.TemporaryDirectory(prefix="fencegate-prof-") as tmp:
        stack = Stack(Path(tmp), 1)
        recorder: list[subprocess.Popen[bytes]] = []

        def start() -> None:
            cmd = [spy, "record", "--pid", str(stack.gateway.pid), "--rate", "500",
                   "--format", "raw", "--output", str(out), "--nonblocking"]  # fmt: skip
            recorder.append(
                subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
            time.sleep(0.5)  # let py-spy attach before the measured load starts

        try:
            run_loop(drive(stack, args.scenario, args.requests, args.concurrency, start))
        finally:
            for r in recorder:
                r.send_signal(2)  # SIGINT: py-spy writes its output and exits
                r.wait(30)
            stack.stop()
    print(f"py-spy, scenario {args.scenario!r}, {args.requests} calls at {args.concurrency}")
    print(summarize(out, args.top))
    print(f"\ncollapsed stacks: {out}")


if __name__ == "__main__":
    main()
