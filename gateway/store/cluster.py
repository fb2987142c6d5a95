"""Redis/Valkey Cluster plumbing: the client, the seeds, per-node and per-slot helpers.

``[redis] cluster = true`` with seed nodes in ``redis.url`` (``redis://[user:pass@]h1:p1,h2:p2``;
``rediss://`` for TLS). Two clients come out of :func:`connect_cluster`:

* the returned :class:`ClusterClient` (redis-py's asyncio ``RedisCluster``) for everything off
  the hot path — job views, relay hints, quotas, anchors, ``SCAN`` of every primary, script
  loading on every primary — where redis-py follows ``MOVED``/``ASK`` itself;
* the store's :class:`~gateway.store.router.ClusterRouter` (:func:`router_for`), built from the
  same seeds and credentials, for the deciding scripts and the pipelined commands: one
  auto-pipeline per primary, its own slot map and redirection handling. (redis-py refuses
  ``EVALSHA`` in a cluster pipeline, and its ``wait``/``waitaof`` run on another connection.)

Per-slot keys (the 16,384 durability markers) are never read or written with one multi-key
command: Cluster refuses keys of several slots in one command (``CROSSSLOT``) even on one node.
:func:`mget_slots`/:func:`mset_slots` send one command per slot, pipelined per node.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.store.driver import driver_info
from gateway.store.keys import SLOTS, slot_marker
from gateway.store.marks import SlotMarks
from gateway.store.replication import AckPolicy
from gateway.store.router import ClusterRouter

__all__ = [
    "ClusterClient",
    "all_markers",
    "connect_cluster",
    "delete_slots",
    "first_seed",
    "is_cluster",
    "mget_slots",
    "mset_slots",
    "node_addresses",
    "parse_seeds",
    "per_slot",
    "router_for",
]


def parse_seeds(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """``redis://user:pass@h1:p1,h2:p2`` → the seeds and the connection's credentials/TLS."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("redis", "rediss"):
        raise ValueError(f"a cluster URL is redis://host:port[,host:port...], not {url!r}")
    rest = rest.split("/", 1)[0].split("?", 1)[0]
    creds, _, hosts = rest.rpartition("@")
    kwargs: dict[str, Any] = {}
    if creds:
        user, _, password = creds.partition(":")
        kwargs["username"] = unquote(user) or None
        kwargs["password"] = unquote(password) or None
    seeds = []
    for entry in hosts.split(","):
        parts = urlsplit("//" + entry.strip())
        if not parts.hostname:
            raise ValueError(f"a seed node without a host in {url!r}")
        seeds.append((parts.hostname, parts.port or 6379))
    kwargs["ssl"] = scheme == "rediss"
    return seeds, kwargs


class ClusterClient(aioredis.RedisCluster):
    """redis-py's asyncio ``RedisCluster``, remembering how the router should connect; its own
    router (:attr:`router`) sends the per-slot bulk commands (markers), hiredis-packed."""

    fencegate_seeds: list[tuple[str, int]]
    fencegate_kwargs: dict[str, Any]
    fencegate_max_connections: int
    _fencegate_router: ClusterRouter | None = None

    @property
    def router(self) -> ClusterRouter:
        if self._fencegate_router is None:
            self._fencegate_router = router_for(self, {})
        return self._fencegate_router

    async def aclose(self) -> None:
        if self._fencegate_router is not None:
            await self._fencegate_router.aclose()
        await super().aclose()


def connect_cluster(url: str, *, timeout: float, max_connections: int) -> ClusterClient:
    seeds, creds = parse_seeds(url)
    ssl = creds.pop("ssl")
    client = ClusterClient(
        startup_nodes=[ClusterNode(host, port) for host, port in seeds],
        decode_responses=True,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        max_connections=max_connections,
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.01), 2),
        ssl=ssl,
        driver_info=driver_info(),
        **creds,
    )
    node_kwargs: dict[str, Any] = {
        "decode_responses": True,
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "health_check_interval": 0,
        "retry": Retry(ExponentialBackoff(cap=0.2, base=0.01), 2, (RedisConnectionError,)),
        "driver_info": driver_info(),
        **creds,
    }
    if ssl:
        node_kwargs["connection_class"] = aioredis.SSLConnection
    client.fencegate_seeds = seeds
    client.fencegate_kwargs = node_kwargs
    client.fencegate_max_connections = max_connections
    return client


def first_seed(url: str) -> str:
    """A cluster URL with only its first seed node (``redis://u:p@h1:1,h2:2`` → ``…@h1:1``),
    for code that talks to one node; a URL of one node comes back unchanged."""
    scheme, sep, rest = url.partition("://")
    hosts, slash, tail = rest.partition("/")
    creds, at, nodes = hosts.rpartition("@")
    return f"{scheme}{sep}{creds}{at}{nodes.split(',')[0]}{slash}{tail}"


def is_cluster(client: Any) -> bool:
    return isinstance(client, aioredis.RedisCluster)


def router_for(
    client: ClusterClient, slot_seen: SlotMarks | Mapping[int, int], ack: AckPolicy | None = None
) -> ClusterRouter:
    """The store's router for the cluster this client talks to (``slot_seen``: the store's
    high-water marks, read on every re-send of a script; ``ack``: replicas_acked)."""
    return ClusterRouter(
        client.fencegate_seeds,
        client.fencegate_kwargs,
        max_connections=client.fencegate_max_connections,
        slot_seen=slot_seen,
        ack=ack,
    )


async def per_slot(router: ClusterRouter, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Single-key commands of many slots, each to its primary, 1,024 at a time (pipelined per
    node by the router's batchers)."""
    out: list[Any] = []
    for start in range(0, len(commands), 1024):
        chunk = commands[start : start + 1024]
        out += await asyncio.gather(*(router.execute(*c) for c in chunk))
    return out


async def mget_slots(client: Any, keys: Sequence[str]) -> list[Any]:
    """``MGET`` of keys of many slots: one command on standalone; on Cluster one ``GET`` per
    key, pipelined per node."""
    if isinstance(client, ClusterClient):
        return await per_slot(client.router, [("GET", k) for k in keys])
    return list(await client.mget(list(keys)))


async def mset_slots(client: Any, mapping: Mapping[str, str]) -> None:
    """``MSET`` of keys of many slots (as :func:`mget_slots`)."""
    if isinstance(client, ClusterClient):
        await per_slot(client.router, [("SET", k, v) for k, v in mapping.items()])
    else:
        await client.mset(dict(mapping))


async def delete_slots(client: Any, keys: Sequence[str]) -> None:
    """``DEL`` of keys of many slots (as :func:`mget_slots`)."""
    if isinstance(client, ClusterClient):
        await per_slot(client.router, [("DEL", k) for k in keys])
    else:
        await client.delete(*keys)


async def all_markers(router: ClusterRouter) -> dict[int, str | None]:
    """Every slot's durability marker, one ``GET`` per slot through ``router``."""
    values = await per_slot(router, [("GET", slot_marker(s)) for s in range(SLOTS)])
    return dict(enumerate(values))


def node_addresses(url: str, timeout: float = 5.0) -> list[tuple[str, int, str]]:
    """Every node of the cluster ``(host, port, 'primary'|'replica')`` as a seed sees it
    (``CLUSTER SLOTS``; a node serving no slot and replicating none is not listed)."""
    seeds, creds = parse_seeds(url)
    creds["ssl"] = bool(creds.get("ssl"))
    last: Exception | None = None
    for host, port in seeds:
        client = redis.Redis(
            host=host,
            port=port,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            decode_responses=True,
            **creds,
        )
        try:
            reply = client.execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
        except (redis.RedisError, OSError) as exc:
            last = exc
            continue
        finally:
            client.close()
        nodes: dict[tuple[str, int], str] = {}
        for entry in reply:
            for i, node in enumerate(entry[2:]):
                nodes.setdefault((str(node[0]), int(node[1])), "primary" if i == 0 else "replica")
        return [(h, p, role) for (h, p), role in sorted(nodes.items())]
    raise redis.ConnectionError(f"no seed node of {len(seeds)} answered CLUSTER SLOTS: {last!r}")
