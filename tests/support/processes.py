"""Gateways and Redis servers as real processes, for the tests that need them.

:class:`Serve` runs ``fencegate serve`` (the ``serves`` fixture in ``tests/conftest.py`` kills
whatever a test left running); :class:`DurableRedis` is a redis-server of a test's own whose
AOF can be backed up and restored (the ``durable`` fixture).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import redis

from gateway.store.embedded import EmbeddedRedis, free_port

__all__ = ["DurableRedis", "Serve", "alive", "children_of", "init", "wait_dead", "write_config"]


def write_config(tmp: Path, extra: str = "") -> Path:
    cfg = tmp / "fencegate.toml"
    cfg.write_text(
        f"""
[redis]
data_dir = "{tmp / "data"}"
[adapters.hook]
type = "webhook"
url = "http://127.0.0.1:{free_port()}/hook"
{extra}
"""
    )
    return cfg


class Serve:
    def __init__(
        self, tmp: Path, cfg: Path, *args: str, env: dict[str, str] | None = None,
        port: int | None = None,
    ) -> None:  # fmt: skip
        self.port = port or free_port()
        self.log_path = tmp / f"serve-{self.port}.log"
        self.log = self.log_path.open("w+")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gateway",
                "serve",
                "--config",
                str(cfg),
                "--port",
                str(self.port),
                *args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=tmp,
            env=env,
        )

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                with urllib.request.urlopen(self.url("/readyz"), timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):  # refused, reset, or slow (a loaded host)
                pass
            time.sleep(0.05)
        raise AssertionError("gateway not ready: " + self.output())

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def redis_pid(self) -> int:
        for line in self.output().splitlines():
            if "embedded_redis_started" in line:
                return int(json.loads(line)["pid"])
        raise AssertionError("no embedded_redis_started line: " + self.output())

    def call(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        if data is not None:  # urllib's default is a form's type: refused (415)
            headers = {"Content-Type": "application/json", **(headers or {})}
        req = urllib.request.Request(
            self.url(path), data=data, method=method, headers=headers or {}
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie entry (not yet reaped by init) counts as dead
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def init(cfg: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "init", "--config", str(cfg), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def listening(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a TCP socket listening on ``port`` (Linux's /proc): a
    gateway worker does once its app has started (``run_app`` opens its listener after the
    start-up, its signal handlers installed), so this is "serving", per worker, where /readyz
    answers for whichever worker took the connection."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            cols = row.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":  # LISTEN
                inodes.add(f"socket:[{cols[9]}]")
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except (FileNotFoundError, PermissionError):
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:
            continue
    return False


def wait_listening(pids: list[int], port: int, timeout: float = 60) -> None:
    """Until every one of ``pids`` listens on ``port`` (see :func:`listening`)."""
    deadline = time.monotonic() + timeout
    while not all(listening(pid, port) for pid in pids):
        assert time.monotonic() < deadline, f"not every worker listens on {port}: {pids}"
        time.sleep(0.05)


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


class DurableRedis:
    """A redis-server of this test's own whose AOF can be backed up and restored."""

    def __init__(self, data: Path) -> None:
        self.server = EmbeddedRedis(data, use_socket=False)
        self.url = self.server.start()
        self.aof = self.server.data_dir / "appendonly.aof"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True)

    def backup(self, to: Path) -> Path:
        """Copy the AOF as a file-level backup would: every acknowledged write is in it
        (appendfsync always), and no rewrite is running."""
        c = self.client()
        assert c.config_get("appendfsync")["appendfsync"] == "always"
        assert c.info("persistence")["aof_rewrite_in_progress"] == 0
        c.close()
        assert self.aof.is_file(), sorted(p.name for p in self.aof.parent.iterdir())
        shutil.copyfile(self.aof, to)
        return to

    def restore(self, backup: Path) -> None:
        """Stop Redis, put the backup in place of its AOF, start it again (same port)."""
        self.server.stop()
        shutil.copyfile(backup, self.aof)
        self.server.start()

    def stop(self) -> None:
        self.server.stop()
