"""What a Redis failure means: the one place redis-py's errors become the gateway's.

Every store module runs its Redis calls through :func:`redis_errors` (or :func:`guarded`);
nothing above the store sees a redis-py exception. The mapping (:func:`store_unavailable`):

* Redis cannot serve now — a lost or refused connection, a timeout, ``READONLY``, ``OOM``,
  ``LOADING``, ``MISCONF``, ``NOREPLICAS``, ``MASTERDOWN``, a Cluster refusal (``CLUSTERDOWN``,
  ``TRYAGAIN``, ``ASK`` past the retries), a script cache flushed under a call (``NOSCRIPT``),
  a reply the replicas did not acknowledge (:class:`~gateway.store.replication.NotReplicated`):
  :class:`~gateway.core.errors.StoreUnavailable`, ``503 store_unavailable``, try later.
* Any other error reply — above all an error raised inside a script (a bug in its Lua, or in
  the arguments the gateway built for it): ``None``, the error is raised as it is (``500``),
  never hidden behind a 503 that a client would retry forever.

redis-py strips the code of some replies (``-OOM …`` becomes an ``OutOfMemoryError`` whose text
starts "command not allowed"), and an error inside a script comes back as "Error running
script … -OOM command not allowed …": every form of a refusal maps the same way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TypeVar

from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.core.errors import StoreUnavailable
from gateway.store.replication import NotReplicated

__all__ = ["REDIS_FAILURES", "guarded", "is_oom", "redis_errors", "store_unavailable"]

T = TypeVar("T")

# What a Redis call may raise that :func:`store_unavailable` judges (anything else redis-py
# raises, a DataError for an argument it cannot encode, is a bug of the caller: it passes).
REDIS_FAILURES = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    ResponseError,
    ClusterError,
    RedisClusterException,
)
# Redis error prefixes that mean "this Redis cannot serve us now", not a bug.
_UNAVAILABLE_PREFIXES = (
    "OOM",
    "MISCONF",
    "READONLY",
    "LOADING",
    "NOREPLICAS",
    "MASTERDOWN",
    "CLUSTERDOWN",
    "TRYAGAIN",
)
# Cluster refusals redis-py raises with the code stripped (the router retries MOVED/ASK/TRYAGAIN
# and turns what is left into NotRun; redis-py's own client raises these past its retries)
_CLUSTER_REFUSALS = (ClusterDownError, TryAgainError, AskError, ClusterError)


def is_oom(exc: BaseException) -> bool:
    """Whether Redis refused for ``maxmemory`` (a script refused so did nothing)."""
    return isinstance(exc, OutOfMemoryError) or (
        isinstance(exc, ResponseError) and ("-OOM " in str(exc) or str(exc).startswith("OOM"))
    )


def store_unavailable(exc: BaseException) -> StoreUnavailable | None:
    """The ``StoreUnavailable`` a Redis failure means; None for an error reply that is a bug
    (the module docstring)."""
    if isinstance(exc, _CLUSTER_REFUSALS):
        return StoreUnavailable(f"Redis Cluster refused the command: {type(exc).__name__} {exc}")
    if isinstance(exc, NoScriptError):
        return StoreUnavailable("Redis lost its script cache during the call; try again")
    if isinstance(exc, ResponseError):
        text = str(exc)
        if (
            isinstance(exc, OutOfMemoryError | ReadOnlyError)
            or text.startswith(_UNAVAILABLE_PREFIXES)
            or any(f"-{prefix} " in text for prefix in _UNAVAILABLE_PREFIXES)
        ):
            if is_oom(exc):
                return StoreUnavailable("Redis is out of memory (maxmemory): nothing was done")
            return StoreUnavailable(f"Redis refused the command: {exc}")
        return None
    if isinstance(exc, NotReplicated):  # the script ran; its reply must not leave (replicas)
        unacked = StoreUnavailable(str(exc))
        unacked.unacknowledged = True
        return unacked
    if isinstance(exc, REDIS_FAILURES):
        return StoreUnavailable(f"Redis is unreachable: {type(exc).__name__}")
    return None


class _RedisErrors:
    """:func:`redis_errors`' context manager (a class: a generator-based one costs ~7 µs a use
    on the request path, this one a fraction of that)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # never swallows: raises StoreUnavailable instead, or lets the error through
        if exc is None or not isinstance(exc, REDIS_FAILURES):
            return  # nothing raised, or not Redis's: as it is
        if (unavailable := store_unavailable(exc)) is None:
            return  # a bug: raised as it is
        raise unavailable from exc


_REDIS_ERRORS = _RedisErrors()


def redis_errors() -> _RedisErrors:
    """Run the Redis calls of the ``with`` block under :func:`store_unavailable`: an
    availability failure is raised as ``StoreUnavailable`` (from the Redis error), a bug as
    it is."""
    return _REDIS_ERRORS


async def guarded(call: Callable[[], Awaitable[T]]) -> T:
    """``await call()`` under :func:`redis_errors`."""
    try:
        return await call()
    except REDIS_FAILURES as exc:
        if (unavailable := store_unavailable(exc)) is None:
            raise
        raise unavailable from exc
