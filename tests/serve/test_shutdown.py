"""A gateway process's shutdown ends: a signal during the start-up is not lost, and a cleanup
that never ends is cut at ``shutdown_grace_seconds`` + the margin, with a log line that says
what was still pending (gateway.runtime.exitbound)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import redis

from gateway.runtime.exitbound import EXIT_SHUTDOWN_OVERRAN, MARGIN_SECONDS
from gateway.store.embedded import ORPHANED_AT_START, die_with_parent, free_port
from tests.support.processes import (
    Serve,
    children_of,
    wait_dead,
    wait_listening,
    write_config,
)

# `run_app` (what `fencegate serve` runs) on a small app whose start-up or cleanup misbehaves
APP = r"""
import asyncio, os, signal, sys, time
from aiohttp import web
from gateway.http.connections import run_app
from gateway.runtime.exitbound import MARGIN_SECONDS, ExitBound
from gateway.runtime.logging import configure_logging
from gateway.runtime.settings import ConnectionSettings

mode, port, grace = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
configure_logging(json=True)


async def ready(request):
    return web.json_response({"ok": True})


async def never_ending_cleanup():
    await asyncio.Event().wait()


def blocking_cleanup():
    time.sleep(3600)


async def lifetime(app):
    if mode == "swallows":
        # the shutdown's signal arrives while the app starts, and the start-up swallows the
        # cancellation: Python 3.11's asyncio.wait_for (redis-py sends every command under
        # it) returns the result of a future that finished as the cancellation landed
        os.kill(os.getpid(), signal.SIGTERM)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass
    yield
    print("cleaned up", flush=True)
    if mode == "awaits":
        await never_ending_cleanup()
    elif mode == "blocks":
        blocking_cleanup()


app = web.Application()
app.router.add_get("/ready", ready)
app.cleanup_ctx.append(lifetime)
run_app(app, loop=asyncio.new_event_loop(), host="127.0.0.1", port=port,
        settings=ConnectionSettings(), shutdown_timeout=grace,
        exit_bound=ExitBound(grace + MARGIN_SECONDS))
"""


def _launch(tmp_path: Path, mode: str, grace: float) -> tuple[subprocess.Popen[str], int]:
    script = tmp_path / "app.py"
    script.write_text(APP)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(script), mode, str(port), str(grace)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    return proc, port


def _start(tmp_path: Path, mode: str, grace: float) -> tuple[subprocess.Popen[str], int]:
    proc, port = _launch(tmp_path, mode, grace)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1):
                return proc, port
        except (urllib.error.URLError, OSError):
            time.sleep(0.05)
    proc.kill()
    raise AssertionError("not serving: " + proc.communicate()[0])


def test_signal_during_the_start_up_stops_the_app_even_when_the_start_up_swallows_it(
    tmp_path: Path,
) -> None:
    grace = 0.5
    proc, _ = _launch(tmp_path, "swallows", grace)
    try:
        code = proc.wait(grace + MARGIN_SECONDS + 10)
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0]
    assert code == 0, output  # stopped by itself, not cut at the bound (4)
    assert "cleaned up" in output.splitlines(), output  # the app's cleanup ran
    assert "shutdown_overran" not in output


@pytest.mark.parametrize(
    ("mode", "field", "names"),
    [("awaits", "tasks", "never_ending_cleanup"), ("blocks", "main_thread", "blocking_cleanup")],
)
def test_cleanup_that_never_ends_is_cut_at_the_bound_and_says_why(
    tmp_path: Path, mode: str, field: str, names: str
) -> None:
    grace = 0.5
    proc, _ = _start(tmp_path, mode, grace)
    try:
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        code = proc.wait(grace + MARGIN_SECONDS + 10)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0]
    assert code == EXIT_SHUTDOWN_OVERRAN, output
    assert grace + MARGIN_SECONDS <= took < grace + MARGIN_SECONDS + 2, output
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    (begun,) = [e for e in events if e["event"] == "shutting_down"]
    assert begun["why"] == "SIGTERM or SIGINT"
    (overran,) = [e for e in events if e["event"] == "shutdown_overran"]
    assert overran["exit_code"] == EXIT_SHUTDOWN_OVERRAN
    assert any(names in line for line in overran[field]), overran


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_workers_of_a_sigkilled_supervisor_exit_within_the_bound_while_redis_is_stalled(
    tmp_path: Path, serves: list[Serve]
) -> None:
    """The supervisor is SIGKILLed while dispatches are in flight and the embedded Redis is
    stopped (SIGSTOP: every command waits for its timeout): each worker's drain records the
    cut dispatches one Redis timeout at a time, longer than the bound; the workers end at
    the bound anyway, and say so."""
    hang = socket.socket()  # a downstream that accepts the requests and never answers
    hang.bind(("127.0.0.1", 0))
    hang.listen(16)
    grace = 1.0
    extra = (
        f"[server]\nshutdown_grace_seconds = {grace}\n"
        f'[adapters.slow]\ntype = "webhook"\nurl = "http://127.0.0.1:{hang.getsockname()[1]}/x"\n'
        "timeout_seconds = 120\n"
    )
    s = Serve(tmp_path, write_config(tmp_path, extra), "--workers", "2")
    serves.append(s)
    s.wait_ready()
    redis_pid = s.redis_pid()
    workers = [p for p in children_of(s.proc.pid) if p != redis_pid]
    assert len(workers) == 2
    wait_listening(workers, s.port)  # /readyz said one is ready; both must be serving
    assert s.call("POST", "/v1/jobs/r/generations", {"generation": 1})[0] == 201
    headers = {"Fencing-Token": "1", "Content-Type": "application/json"}

    def call(step: str) -> None:
        with contextlib.suppress(OSError):  # cut short: the caller gets no answer
            s.call("POST", f"/v1/jobs/r/effects/{step}", {"adapter": "slow", "operation": "x",
                                                          "payload": {}}, headers)  # fmt: skip

    calls = 8
    for n in range(calls):
        threading.Thread(target=call, args=(f"s{n}",), daemon=True).start()
    accepted = [hang.accept()[0] for _ in range(calls)]  # every dispatch is in flight
    os.kill(redis_pid, signal.SIGSTOP)
    try:
        s.proc.kill()
        killed = time.monotonic()
        bound = grace + MARGIN_SECONDS
        survivors = [
            p for p in workers if not wait_dead(p, bound + 2 - (time.monotonic() - killed))
        ]
        took = time.monotonic() - killed
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.kill(redis_pid, signal.SIGCONT)
        for conn in accepted:
            conn.close()
        hang.close()
    assert not survivors, (
        f"alive {took:.1f} s after the supervisor's SIGKILL:\n{s.output()[-4000:]}"
    )
    events = [json.loads(line) for line in s.output().splitlines() if line.startswith("{")]
    assert [e["why"] for e in events if e["event"] == "shutting_down"] == ["SIGTERM or SIGINT"] * 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_workers_of_a_supervisor_sigkilled_during_their_start_up_stop_cleanly(
    tmp_path: Path, serves: list[Serve]
) -> None:
    """The death signal reaches a worker while its app starts (it loads the scripts into the
    embedded Redis, seen with MONITOR): the worker stops by itself, cleanly, instead of
    serving on with its shutdown lost until the bound ends it. The workers are held
    (SIGSTOP) across the supervisor's SIGKILL, as a loaded host deschedules them: the signal
    is then seen between two steps of the start-up's loop, where Python 3.11's wait_for can
    swallow the cancellation, rather than while the loop waits for a reply."""
    grace = 1.0
    s = Serve(tmp_path, write_config(tmp_path, f"[server]\nshutdown_grace_seconds = {grace}"),
              "--workers", "2")  # fmt: skip
    serves.append(s)
    deadline = time.monotonic() + 60
    while "workers_starting" not in s.output():  # the supervisor's own Redis calls are done
        assert s.proc.poll() is None and time.monotonic() < deadline, s.output()
        time.sleep(0.02)
    redis_pid = s.redis_pid()
    (url,) = [json.loads(line)["url"] for line in s.output().splitlines()
              if "embedded_redis_started" in line]  # fmt: skip
    workers: list[int] = []
    try:
        with redis.Redis.from_url(url).monitor() as monitor:
            while "SCRIPT" not in str(monitor.next_command()["command"]).upper():
                pass  # a worker's app is starting: its signal handlers are installed
            workers = [p for p in children_of(s.proc.pid) if p != redis_pid]
            for pid in workers:
                os.kill(pid, signal.SIGSTOP)
            s.proc.kill()
            s.proc.wait()  # dead: the death signals are pending in the held workers
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
        killed = time.monotonic()
        survivors = [p for p in workers if not wait_dead(p, grace + MARGIN_SECONDS + 2)]
        took = time.monotonic() - killed
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert len(workers) == 2
    assert not survivors, (
        f"alive {took:.1f} s after the supervisor's SIGKILL:\n{s.output()[-4000:]}"
    )
    assert "shutdown_overran" not in s.output(), s.output()[-4000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_a_child_whose_parent_died_before_its_death_signal_was_set_never_runs() -> None:
    """A supervisor SIGKILLed between a worker's fork and its prctl never signals it: the
    worker finds another parent there and exits before it runs (the parent given here is not
    this process, as if it had died and the child been adopted)."""
    another = os.getpid() + 1_000_000
    adopted = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                               preexec_fn=die_with_parent(parent=another))  # fmt: skip
    assert adopted.wait(timeout=10) == ORPHANED_AT_START
    kept = subprocess.Popen([sys.executable, "-c", "print('ran')"], stdout=subprocess.PIPE,
                            preexec_fn=die_with_parent())  # fmt: skip
    assert kept.communicate(timeout=10)[0].strip() == b"ran" and kept.returncode == 0


def test_every_child_is_started_with_its_death_signal_set() -> None:
    """``die_with_parent`` makes the ``preexec_fn``: passed uncalled, the child runs the
    factory, which sets nothing, and outlives whoever started it."""
    root = Path(__file__).resolve().parents[2]
    sources = [*(root / "gateway").rglob("*.py"), *(root / "tests").rglob("*.py")]
    uncalled = [
        f"{path.relative_to(root)}:{n}"
        for path in sources
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search("preexec_fn=" + r"die_with_parent\b(?!\()", line)  # not this line
    ]
    assert len(sources) > 100 and uncalled == []
