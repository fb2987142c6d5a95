"""What the job-framework integration tests share: the gateway with a claim key, worker
processes of an example app with their logs, polling, and the job's audited refusals."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.http import appkeys as K
from gateway.store.keys import JobKeys
from tests.conftest import Gateway, key_digest

__all__ = [
    "ADMIN_KEY", "CLAIM_KEY", "CLAIM_NAME", "ROOT", "WorkerProcs", "claim_gateway", "fence",
    "gateway_env", "refusals", "registrations", "until",
]  # fmt: skip

ROOT = Path(__file__).resolve().parents[2]
CLAIM_KEY = "framework-claims-0123456789"
CLAIM_NAME = "framework-workers"  # the claim key's name: the registrant in the audit
ADMIN_KEY = "admin-0123456789abcd"


async def claim_gateway(make_gateway: Any) -> Gateway:
    """A gateway whose workers hold a claim key named ``CLAIM_NAME``; the test reads as admin."""
    keys = [
        {"role": "worker", "claims": True, "name": CLAIM_NAME, "sha256": key_digest(CLAIM_KEY)},
        {"role": "admin", "sha256": key_digest(ADMIN_KEY)},
    ]
    gw: Gateway = await make_gateway(
        headers={"Authorization": f"Bearer {ADMIN_KEY}"}, auth={"keys": keys}
    )
    return gw


def gateway_env(gw: Gateway, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "FENCEGATE_URL": str(gw.client.make_url("")).rstrip("/"),
        "FENCEGATE_KEY": CLAIM_KEY,
        **extra,
    }


class WorkerProcs:
    """Worker processes of one example app (``python example worker …``), each with a log."""

    def __init__(self, tmp: Path, python: str, example: str, env: dict[str, str]) -> None:
        self.tmp, self.python, self.example, self.env = tmp, python, example, env
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(
        self, name: str, *args: str, argv: list[str] | None = None
    ) -> subprocess.Popen[bytes]:
        """``python example worker *args``, or ``python *argv`` from ``cwd``."""
        log = self.tmp / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [self.python, *(argv or [self.example, "worker", *args])],
                cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.procs.append((proc, log))
        return proc

    def command(self, *args: str) -> str:
        """Run one of the example's other commands (enqueue, result); its stdout."""
        done = subprocess.run(
            [self.python, self.example, *args], cwd=ROOT, env=self.env, capture_output=True,
            text=True, timeout=60, check=True,
        )  # fmt: skip
        return done.stdout

    def log(self, proc: subprocess.Popen[bytes]) -> str:
        return next(log for p, log in self.procs if p is proc).read_text(errors="replace")

    def stop(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
        for proc, _ in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def until(what: str, check: Callable[[], Any], seconds: float = 40) -> Any:
    """Poll ``check`` (sync or async) until it answers something truthy."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while True:
        got = check()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        if loop.time() > deadline:
            raise AssertionError(f"never: {what}")
        await asyncio.sleep(0.02)


async def fence(gw: Gateway, job: str) -> int:
    resp = await gw.client.get(f"/v1/jobs/{job}", headers=gw.headers)
    return int((await resp.json())["fence"]) if resp.status == 200 else 0


async def refusals(gw: Gateway, job: str) -> set[tuple[str, int, int]]:
    """The job's audited refusals of generation 1 (A's). B, the current generation, has none:
    its completion waits for a heartbeat on its way (the SDK)."""
    audit = await gw.audit(job=job)
    of_b = {(e["reason"], e["presented"], e["current"]) for e in audit if e["presented"] != 1}
    assert of_b == set(), of_b
    return {(e["reason"], e["presented"], e["current"]) for e in audit if e["presented"] == 1}


async def registrations(gw: Gateway, job: str) -> list[tuple[str, str]]:
    """(generation, by) of every registration in the job's audit chain, oldest first."""
    history = await gw.app[K.STORE].history(JobKeys("default", job))
    return [(e["generation"], e["by"]) for e in history if e.get("event") == "registered"]
