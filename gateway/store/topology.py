"""The replication topology that ``[redis] replicas_acked = R`` can rely on, checked.

Checked at start (``fencegate serve`` refuses to start on a problem, unless
``allow_volatile``) and every ``redis.topology_interval_seconds`` while serving (a problem
makes ``/readyz`` answer 503 and is logged). For every primary (the URL's server; on a
Cluster every primary of ``CLUSTER SHARDS``) and every replica of it, each one connected
to by its own address:

* Redis/Valkey >= 7.2 (``WAITAOF`` exists; replicas report their fsynced offset);
* ``appendonly yes`` and ``appendfsync always`` (primaries *and* replicas: a promoted
  replica is the next primary);
* exactly R replicas connected to the primary. Fewer: no write could be acknowledged.
  More: ``WAIT R`` returns when *any* R replicas have the write, so the one promoted may
  not be among them (a read-only replica counts too: hang extra read replicas off a
  replica, chained, where the primary's ``WAIT`` does not count them);
* at least one of them promotable (``replica-priority`` not 0, ``cluster-replica-no-failover
  no``), else failover cannot happen at all (a warning, not a problem).

``WAITAOF`` enforces the fsync on every batch anyway (a replica that does not fsync never
counts): this check makes a wrong topology visible at start instead of as 503s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from gateway.store.cluster import first_seed

__all__ = ["NodeFacts", "Shard", "Topology", "check_topology", "node_url", "watch"]

log = structlog.get_logger("fencegate.topology")

MIN_VERSION = (7, 2)
_SETTINGS = ("appendonly", "appendfsync", "replica-priority", "cluster-replica-no-failover")


@dataclass
class NodeFacts:
    address: str
    role: str = ""
    version: str = ""
    config: dict[str, str] = field(default_factory=dict)  # empty: CONFIG GET not permitted
    error: str = ""

    @property
    def promotable(self) -> bool:
        return (
            self.config.get("replica-priority", "100") != "0"
            and self.config.get("cluster-replica-no-failover", "no") != "yes"
        )


@dataclass
class Shard:
    primary: NodeFacts
    replicas: list[NodeFacts]


@dataclass
class Topology:
    shards: list[Shard]
    problems: list[str]  # each one a reason to refuse (or to be not ready)
    warnings: list[str]
    cluster: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> list[dict[str, Any]]:
        """For the log line: one entry per shard."""
        return [
            {
                "primary": s.primary.address,
                "replicas": [r.address for r in s.replicas],
                "promotable": sum(1 for r in s.replicas if r.promotable),
            }
            for s in self.shards
        ]


def node_url(url: str, host: str, port: int) -> str:
    """The seed URL (scheme, credentials) pointed at another node."""
    parts = urlsplit(url)
    scheme = "rediss" if parts.scheme == "rediss" else "redis"
    auth = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else ""
    netloc = (auth + "@" if auth else "") + f"{host}:{port}"
    return urlunsplit((scheme, netloc, "", "", ""))


def _version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(".")[:2])
    except ValueError:
        return (0,)


def _pairs(raw: Any) -> dict[str, Any]:
    """A RESP map as redis-py hands it back: a dict, or a flat [k, v, k, v] list."""
    if isinstance(raw, Mapping):
        return {str(k): v for k, v in raw.items()}
    items = list(raw)
    return {str(items[i]): items[i + 1] for i in range(0, len(items) - 1, 2)}


async def _facts(url: str, address: str, io_timeout: float) -> tuple[NodeFacts, dict[str, Any]]:
    """One node's version, role and settings, and its INFO replication."""
    facts = NodeFacts(address)
    client = aioredis.Redis.from_url(
        url, decode_responses=True, socket_timeout=io_timeout, socket_connect_timeout=io_timeout
    )
    replication: dict[str, Any] = {}
    try:
        server = await client.info("server")
        facts.version = str(server.get("redis_version", ""))
        replication = await client.info("replication")
        facts.role = str(replication.get("role", ""))
        try:
            raw = await client.execute_command("CONFIG", "GET", *_SETTINGS)  # type: ignore[no-untyped-call]
            facts.config = {k: str(v) for k, v in _pairs(raw).items()}
        except RedisError:
            facts.config = {}  # not permitted (ACL, managed service): unverified
    except (RedisError, OSError) as exc:
        facts.error = f"{type(exc).__name__}: {exc}"
    finally:
        await client.aclose()
    return facts, replication


def _replicas_of(replication: Mapping[str, Any]) -> list[tuple[str, int]]:
    """The replicas a primary's INFO replication lists as online (``slaveN`` entries)."""
    out = []
    for key, value in replication.items():
        online = isinstance(value, Mapping) and value.get("state") == "online"
        if key.startswith("slave") and online:
            out.append((str(value["ip"]), int(value["port"])))
    return out


def _cluster_shards(raw: Sequence[Any]) -> list[tuple[tuple[str, int], list[tuple[str, int]]]]:
    """(primary, [online replicas]) per shard from ``CLUSTER SHARDS``."""
    shards = []
    for entry in raw:
        shard = _pairs(entry)
        primary: tuple[str, int] | None = None
        replicas = []
        for node_raw in shard.get("nodes", []):
            node = _pairs(node_raw)
            address = (str(node.get("ip") or node.get("endpoint")), int(node["port"]))
            if node.get("role") == "master":
                primary = address
            elif node.get("health") == "online":
                replicas.append(address)
        if primary is not None and shard.get("slots"):
            shards.append((primary, replicas))
    return shards


def _node_problems(facts: NodeFacts, what: str, warnings: list[str]) -> list[str]:
    if facts.error:
        return [f"{what} {facts.address} is unreachable ({facts.error})"]
    problems = []
    if _version(facts.version) < MIN_VERSION:
        problems.append(
            f"{what} {facts.address} runs Redis {facts.version or '?'}: WAITAOF needs >= 7.2"
        )
    if not facts.config:
        warnings.append(
            f"{what} {facts.address}: CONFIG GET is not permitted, its AOF settings are "
            "unverified (WAITAOF still refuses to count a replica that did not fsync)"
        )
        return problems
    if facts.config.get("appendonly") != "yes":
        problems.append(f"{what} {facts.address}: appendonly is not 'yes'")
    if facts.config.get("appendfsync") != "always":
        problems.append(
            f"{what} {facts.address}: appendfsync is {facts.config.get('appendfsync')!r} "
            "(need 'always')"
        )
    return problems


async def check_topology(url: str, replicas: int, *, io_timeout: float = 5.0) -> Topology:
    """Every primary and its replicas against what ``replicas_acked = replicas`` needs."""
    url = first_seed(url)  # a cluster's seed list: the first seed tells the whole layout
    seed = urlsplit(url)
    seed_address = f"{seed.hostname}:{seed.port or 6379}" if seed.hostname else url
    seed_facts, replication = await _facts(url, seed_address, io_timeout)
    problems: list[str] = []
    warnings: list[str] = []
    if seed_facts.error:
        return Topology([], [f"Redis at {seed_address} is unreachable ({seed_facts.error})"], [])
    layout: list[tuple[tuple[str, int] | None, list[tuple[str, int]]]]
    cluster = False
    client = aioredis.Redis.from_url(url, decode_responses=True, socket_timeout=io_timeout)
    try:
        info = await client.info("cluster")
        cluster = str(info.get("cluster_enabled", "0")) == "1"
        if cluster:
            raw = await client.execute_command("CLUSTER", "SHARDS")  # type: ignore[no-untyped-call]
            layout = list(_cluster_shards(raw))
    except (RedisError, OSError) as exc:
        return Topology([], [f"Redis at {seed_address}: {type(exc).__name__}: {exc}"], [])
    finally:
        await client.aclose()
    if not cluster:
        if seed_facts.role != "master":
            problems.append(f"{seed_address} is a {seed_facts.role or '?'}, not a primary")
        layout = [(None, _replicas_of(replication))]
    shards: list[Shard] = []
    for primary_address, replica_addresses in layout:
        if primary_address is None:
            primary = seed_facts
        else:
            primary, _ = await _facts(
                node_url(url, *primary_address), _fmt(primary_address), io_timeout
            )
        found = await asyncio.gather(
            *(_facts(node_url(url, h, p), _fmt((h, p)), io_timeout) for h, p in replica_addresses)
        )
        shard = Shard(primary, [facts for facts, _ in found])
        shards.append(shard)
        problems += _node_problems(primary, "primary", warnings)
        for facts in shard.replicas:
            problems += _node_problems(facts, "replica", warnings)
        n = len(shard.replicas)
        if n < replicas:
            problems.append(
                f"primary {primary.address} has {n} online replica(s), replicas_acked = "
                f"{replicas}: no write could be acknowledged"
            )
        elif n > replicas:
            problems.append(
                f"primary {primary.address} has {n} replicas, replicas_acked = {replicas}: WAIT "
                "counts any of them, so a promoted one may lack an acknowledged write; set "
                f"replicas_acked = {n} (or chain extra read replicas off a replica)"
            )
        verified = all(r.config for r in shard.replicas)
        if n and verified and not any(r.promotable for r in shard.replicas):
            warnings.append(f"primary {primary.address}: no replica is promotable")
    return Topology(shards, problems, warnings, cluster=cluster)


def _fmt(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


async def watch(
    url: str, replicas: int, every: float, report: Callable[[Topology], None], io_timeout: float
) -> None:
    """Check the topology now and every ``every`` seconds; ``report`` gets each result.
    A change of the problems found is logged (an error while there are any)."""
    last: list[str] | None = None
    while True:
        try:
            topology = await check_topology(url, replicas, io_timeout=io_timeout)
        except Exception as exc:  # a check that fails is a problem, never the end of the loop
            log.exception("topology_check_failed")
            topology = Topology([], [f"the topology check failed: {exc!r}"], [])
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # a cancellation the check swallowed
            raise asyncio.CancelledError
        report(topology)
        if topology.problems != last:
            if topology.problems:
                log.error(
                    "replication_topology_unsupported",
                    problems=topology.problems,
                    shards=topology.summary(),
                    detail="replicas_acked cannot be relied on: /readyz answers 503",
                )
            elif last is not None:
                log.info("replication_topology_ok", shards=topology.summary())
            last = topology.problems
        await asyncio.sleep(every)
