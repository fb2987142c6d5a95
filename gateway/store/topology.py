"""The replication topology that ``[redis] replicas_acked = R`` can rely on, checked.

Checked at start (``fencegate serve`` refuses to start on a problem, unless
``allow_volatile``) and every ``redis.topology_interval_seconds`` while serving (a problem
makes ``/readyz`` answer 503 and is logged). For every primary (the URL's server; on a
Cluster every primary of ``CLUSTER SHARDS``, asked of the first seed that answers) and every
replica its own INFO replication lists with an online link (not the shard's health string:
``CLUSTER SHARDS`` says ``loading`` until a shard had a write), each one connected to by its
own address:

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

from gateway.store.driver import driver_info

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
        url,
        decode_responses=True,
        socket_timeout=io_timeout,
        socket_connect_timeout=io_timeout,
        driver_info=driver_info(),
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


def _cluster_primaries(raw: Sequence[Any]) -> list[tuple[str, int]]:
    """The primary of every shard that serves slots, from ``CLUSTER SHARDS``.

    Its replicas are not taken from there: ``CLUSTER SHARDS`` calls a replica ``loading``
    until its shard has had a write (a brand-new cluster would look broken), and its health
    string says nothing of the replication link. The primary's own INFO replication
    (``slaveN:...,state=online``) is what ``WAIT`` counts, so that is what is judged."""
    primaries = []
    for entry in raw:
        shard = _pairs(entry)
        for node_raw in shard.get("nodes", []):
            node = _pairs(node_raw)
            if node.get("role") == "master" and shard.get("slots"):
                primaries.append((str(node.get("ip") or node.get("endpoint")), int(node["port"])))
    return primaries


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


def _seed_urls(url: str) -> list[str]:
    """One URL per seed of a cluster's seed list (a URL of one node: itself)."""
    scheme, sep, rest = url.partition("://")
    hosts, slash, tail = rest.partition("/")
    creds, at, nodes = hosts.rpartition("@")
    return [f"{scheme}{sep}{creds}{at}{node}{slash}{tail}" for node in nodes.split(",") if node]


def _address(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or 6379}" if parts.hostname else url


async def _layout(
    url: str, io_timeout: float
) -> tuple[NodeFacts, dict[str, Any], bool, list[tuple[str, int]] | None]:
    """The seed's facts, its INFO replication, whether it is a cluster node, and (cluster)
    the primaries of ``CLUSTER SHARDS``; ``facts.error`` set when the seed did not answer."""
    facts, replication = await _facts(url, _address(url), io_timeout)
    if facts.error:
        return facts, replication, False, None
    client = aioredis.Redis.from_url(
        url,
        decode_responses=True,
        socket_timeout=io_timeout,
        socket_connect_timeout=io_timeout,
        driver_info=driver_info(),
    )
    try:
        info = await client.info("cluster")
        if str(info.get("cluster_enabled", "0")) != "1":
            return facts, replication, False, None
        raw = await client.execute_command("CLUSTER", "SHARDS")  # type: ignore[no-untyped-call]
        return facts, replication, True, _cluster_primaries(raw)
    except (RedisError, OSError) as exc:
        facts.error = f"{type(exc).__name__}: {exc}"
        return facts, replication, False, None
    finally:
        await client.aclose()


async def check_topology(url: str, replicas: int, *, io_timeout: float = 5.0) -> Topology:
    """Every primary and its replicas against what ``replicas_acked = replicas`` needs."""
    problems: list[str] = []
    warnings: list[str] = []
    errors = []
    # a cluster's seed list: the first seed that answers tells the whole layout (a dead or
    # paused seed is no verdict on the topology); a single node's URL is its own one seed
    for seed_url in _seed_urls(url):
        seed_facts, replication, cluster, primaries = await _layout(seed_url, io_timeout)
        if not seed_facts.error:
            url = seed_url
            break
        errors.append(f"Redis at {seed_facts.address} is unreachable ({seed_facts.error})")
    else:
        return Topology([], errors or [f"no seed node in {url!r}"], [])
    layout: list[tuple[str, int] | None] = list(primaries or [])
    if not cluster:
        if seed_facts.role != "master":
            problems.append(f"{seed_facts.address} is a {seed_facts.role or '?'}, not a primary")
        layout = [None]
    shards: list[Shard] = []
    for primary_address in layout:
        if primary_address is None:
            primary, primary_replication = seed_facts, replication
        else:
            primary, primary_replication = await _facts(
                node_url(url, *primary_address), _fmt(primary_address), io_timeout
            )
        # the replicas the primary itself counts as online: what WAIT can count
        replica_addresses = [] if primary.error else _replicas_of(primary_replication)
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
        # a check is never cut by a cancellation (the shutdown): cut while redis-py opens a
        # connection, that connection is left unclosed; each node's I/O is bounded instead
        check = asyncio.ensure_future(check_topology(url, replicas, io_timeout=io_timeout))
        try:
            topology = await asyncio.shield(check)
        except asyncio.CancelledError:
            await asyncio.wait([check])
            if not check.cancelled():
                check.exception()  # retrieved
            raise
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
