"""gateway.store.failures: the one place a redis-py error becomes the gateway's. Redis not
serving is ``StoreUnavailable`` (503); an error reply that is not a refusal (a script's own
error) is raised as it is (500). The errors are redis-py's own classes, as its parser raises
them for these replies (redis-py ``_parsers/base.py`` EXCEPTION_CLASSES)."""

from __future__ import annotations

import pytest
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    DataError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.core.errors import StoreUnavailable
from gateway.store.failures import redis_errors, store_unavailable
from gateway.store.replication import NotReplicated

pytestmark = pytest.mark.fast

SCRIPT_BUG = (
    "Error running script (call to f_0123): @user_script:3: WRONGTYPE Operation against a key "
    "holding the wrong kind of value script: 0123, on @user_script:3."
)


@pytest.mark.parametrize(
    ("error", "detail"),
    [
        (RedisConnectionError("Connection refused"), "unreachable"),
        (RedisTimeoutError("Timeout reading from socket"), "unreachable"),
        (OSError(104, "Connection reset by peer"), "unreachable"),
        (BusyLoadingError("Redis is loading the dataset in memory"), "unreachable"),
        (ReadOnlyError("You can't write against a read only replica."), "refused"),
        (OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), "memory"),
        (ResponseError("Error running script (call to f_1): -OOM command not allowed"), "memory"),
        (ResponseError("MISCONF Redis is configured to save RDB snapshots"), "refused"),
        (ResponseError("NOREPLICAS Not enough good replicas to write."), "refused"),
        (ClusterDownError("The cluster is down"), "Cluster"),
        (TryAgainError("Multiple keys request during rehashing of slot"), "Cluster"),
        (NoScriptError("No matching script. Please use EVAL."), "script cache"),
    ],
)
def test_redis_not_serving_is_store_unavailable(error: Exception, detail: str) -> None:
    unavailable = store_unavailable(error)
    assert isinstance(unavailable, StoreUnavailable)
    assert unavailable.http_status == 503 and unavailable.code == "store_unavailable"
    assert detail in unavailable.detail


def test_a_reply_the_replicas_did_not_acknowledge_is_unacknowledged() -> None:
    unavailable = store_unavailable(NotReplicated("1 of 2 replicas acknowledged"))
    assert isinstance(unavailable, StoreUnavailable) and unavailable.unacknowledged


@pytest.mark.parametrize(
    "error",
    [
        ResponseError(SCRIPT_BUG),
        ResponseError("Error running script (call to f_2): @user_script:9: attempt to compare nil"),
        ResponseError("ERR wrong number of arguments for 'hget' command"),
        DataError("Invalid input of type: 'NoneType'"),
    ],
)
def test_an_error_reply_that_is_not_a_refusal_is_a_bug(error: Exception) -> None:
    assert store_unavailable(error) is None
    with pytest.raises(type(error)) as raised, redis_errors():
        raise error
    assert raised.value is error


def test_redis_errors_raises_store_unavailable_from_the_redis_error() -> None:
    cause = RedisConnectionError("Connection refused")
    with pytest.raises(StoreUnavailable) as raised, redis_errors():
        raise cause
    assert raised.value.__cause__ is cause
