"""``fencegate serve`` on Redis/Valkey Cluster: every node's durability settings, checked at start.

A replica can be promoted at any time, so the check covers primaries *and* replicas (as the
cluster's ``CLUSTER SLOTS`` lists them): ``appendonly yes``, ``appendfsync always``,
``maxmemory-policy noeviction`` on each. Refused (exit 3) otherwise, unless ``allow_volatile``.
"""

from __future__ import annotations

from typing import Any

import redis

from gateway.cli.common import log
from gateway.store.cluster import node_addresses, parse_seeds

__all__ = ["check_cluster_durability"]

_WANTED = {"appendonly": "yes", "appendfsync": "always", "maxmemory-policy": "noeviction"}


def check_cluster_durability(url: str, allow_volatile: bool) -> bool:
    """True if every node of the cluster keeps fences across restarts (or it was waived)."""
    creds = parse_seeds(url)[1]
    problems: list[str] = []
    for host, port, role in node_addresses(url):
        client = redis.Redis(
            host=host,
            port=port,
            socket_timeout=5,
            socket_connect_timeout=5,
            decode_responses=True,
            **creds,
        )
        try:
            config: dict[Any, Any] = {}
            for name in _WANTED:
                config.update(client.config_get(name))
        except redis.exceptions.ResponseError:
            log.warning(
                "redis_durability_unverified",
                node=f"{host}:{port}",
                detail="CONFIG GET is not permitted; make sure every node runs with appendonly "
                "yes, appendfsync always and maxmemory-policy noeviction",
            )
            continue
        finally:
            client.close()
        for name, wanted in _WANTED.items():
            if config.get(name) != wanted:
                problems.append(f"{role} {host}:{port}: {name} is {config.get(name)!r}")
    if not problems:
        return True
    detail = (
        "; ".join(problems)
        + " (need appendonly yes, appendfsync always, maxmemory-policy noeviction on every "
        "node: a replica may be promoted): a restart, a crash or an eviction would lose fences"
    )
    if allow_volatile:
        log.warning("REDIS_NOT_DURABLE", detail=detail, allowed_by="--allow-volatile-redis")
        return True
    log.error("redis_not_durable", detail=detail, hint="fix Redis or pass --allow-volatile-redis")
    return False
