"""The scripts' plumbing: their sources (prelude + body), request and dispatch ids, what a Redis
failure means, and the client every store method goes through."""

from __future__ import annotations

import itertools
import secrets
from importlib import resources

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.core.errors import StoreUnavailable
from gateway.store.cluster import connect_cluster
from gateway.store.replication import NotReplicated

SCRIPT_NAMES = (
    "admit-6",
    "record-3",
    "register-2",
    "heartbeat-2",
    "cancel-1",
    "reject-2",
    "resolve-5",
    "relay-5",
    "void-4",
    "checkpoint-3",
    "complete-3",
    # attempt-scoped outputs (gateway.fencing.outputs)
    "output-stage-3",
    "output-record-3",
    "reindex-2",
)
# Redis error prefixes that mean "this Redis cannot serve us now", not a bug.
_UNAVAILABLE_PREFIXES = (
    "OOM", "MISCONF", "READONLY", "LOADING", "NOREPLICAS", "MASTERDOWN", "CLUSTERDOWN",
    "TRYAGAIN",
)  # fmt: skip
# Cluster refusals redis-py raises with the code stripped (the router retries MOVED/ASK/TRYAGAIN
# and turns what is left into NotRun; redis-py's own client raises these past its retries)
_CLUSTER_REFUSALS = (ClusterDownError, TryAgainError, AskError, ClusterError)


def _lua_source(name: str) -> str:
    """The prelude (the trailer, re-send memory, the slot counter, the audit chain), then the
    script's body as a function the prelude runs."""
    lua = resources.files("gateway.store") / "lua"
    prelude = (lua / "_prelude.lua").read_text(encoding="utf-8")
    body = (lua / f"{name}.lua").read_text(encoding="utf-8")
    return f"{prelude}\nreturn run_script(function()\n{body}\nend)\n"


_REDIS_FAILURES = (
    RedisConnectionError, RedisTimeoutError, OSError, ResponseError, ClusterError,
    RedisClusterException,
)  # fmt: skip


def _oom(exc: Exception) -> bool:
    return isinstance(exc, OutOfMemoryError) or (
        isinstance(exc, ResponseError) and "-OOM " in str(exc)
    )


def _unavailable(exc: Exception) -> StoreUnavailable | None:
    """The ``StoreUnavailable`` a Redis failure means; None for an error reply that is a bug.

    redis-py strips the code of some error replies (``-OOM …`` becomes an
    ``OutOfMemoryError`` whose text starts "command not allowed"), and an error inside a
    script comes back as "Error running script … -OOM command not allowed …": all three
    forms are Redis refusing to serve, not a bug (503, never 500)."""
    if isinstance(exc, _CLUSTER_REFUSALS):
        return StoreUnavailable(f"Redis Cluster refused the command: {type(exc).__name__} {exc}")
    if isinstance(exc, ResponseError):
        text = str(exc)
        if (
            isinstance(exc, OutOfMemoryError | ReadOnlyError)
            or text.startswith(_UNAVAILABLE_PREFIXES)
            or any(f"-{prefix} " in text for prefix in _UNAVAILABLE_PREFIXES)
        ):
            if _oom(exc) or text.startswith("OOM"):
                return StoreUnavailable("Redis is out of memory (maxmemory): nothing was done")
            return StoreUnavailable(f"Redis refused the command: {exc}")
        return None
    if isinstance(exc, NotReplicated):  # the script ran; its reply must not leave (replicas)
        unacked = StoreUnavailable(str(exc))
        unacked.unacknowledged = True
        return unacked
    return StoreUnavailable(f"Redis is unreachable: {type(exc).__name__}")


# Dispatch ids only have to be unique (they never leave the gateway: the admit hands one
# out, the record must present it): a random 64-bit prefix per process and a counter,
# instead of a getrandom() system call per admit.
_DISPATCH_PREFIX = secrets.token_hex(8)
_dispatch_counter = itertools.count()


def _dispatch_id() -> str:
    return f"{_DISPATCH_PREFIX}{next(_dispatch_counter):x}"


new_request_id = _dispatch_id


MARKER_MISSING = (
    "Redis has lost fencegate's data (the durability marker of this job's slot is "
    "missing): fences may be gone, so nothing is dispatched. An operator must run "
    "`fencegate init --confirm-data-loss` and re-register current generations."
)
UNINITIALISED = (
    "this Redis has no fencegate durability marker and the gateway does not initialise an "
    "external Redis on its own: if it is new, run `fencegate init --config <this config>` once "
    "(it refuses when this Redis or data dir held fencegate data before); if it was wiped or "
    "replaced, fences may be gone: `fencegate init --confirm-data-loss`, then re-register "
    "current generations. Nothing is dispatched until then."
)


def _optional_int(raw: str) -> int | None:
    return int(raw) if raw else None


def connect(
    url: str, *, timeout: float, max_connections: int, cluster: bool = False
) -> aioredis.Redis:
    """A redis-py client with one shared pool (``cluster``: redis-py's ``RedisCluster`` for the
    seeds in ``url``, see :mod:`gateway.store.cluster`; it serves the same commands).

    Only connection errors are retried (twice, quickly): a command that timed
    out may have run, so it is never re-sent blindly; admit and record are safe
    to re-run with the same dispatch id when a reset connection lost the reply.
    """
    if cluster:
        client = connect_cluster(url, timeout=timeout, max_connections=max_connections)
        return client  # type: ignore[return-value]  # the same command API
    retry = Retry(ExponentialBackoff(cap=0.2, base=0.01), 2, (RedisConnectionError,))
    # A blocking pool: under a burst, requests wait (up to `timeout`) for a
    # connection instead of failing with "Too many connections".
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        decode_responses=True,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        max_connections=max_connections,
        timeout=timeout,
        retry=retry,
        health_check_interval=0,
    )
    return aioredis.Redis.from_pool(pool)  # the client owns and closes the pool
