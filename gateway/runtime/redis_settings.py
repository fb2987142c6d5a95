"""The ``[redis]`` section of the settings (:mod:`gateway.runtime.settings`, which re-exports
it): frozen, unknown keys refused, like every section."""

from __future__ import annotations

from typing import Annotated, Any

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["RedisSettings"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RedisSettings(_Section):
    url: str = ""
    # Redis/Valkey Cluster: `url` names seed nodes ("redis://h1:6379,h2:6379" or a list);
    # commands are routed per slot to each shard's primary (gateway.store.router). The
    # embedded Redis is always standalone.
    cluster: bool = False
    data_dir: str = ".fencegate"
    # Bound on a single Redis command; past it the call fails closed (503).
    timeout_seconds: Annotated[float, Field(gt=0, le=60)] = 2.0
    max_connections: Annotated[int, Field(ge=1, le=10_000)] = 64
    # Start even when an external Redis is not configured durably (warns loudly).
    allow_volatile: bool = False
    # How often the gateway bumps the Redis epoch and compares its slot marks with Redis's
    # markers (detects restores of older snapshots).
    epoch_interval_seconds: Annotated[float, Field(gt=0, le=3600)] = 30.0
    # How often the slot marks (the highest write counter seen per slot) are written to the
    # state file when they rose; also written at shutdown.
    marks_interval_seconds: Annotated[float, Field(gt=0, le=3600)] = 1.0
    # An external Redis (url set) is initialised only by `fencegate init`, never by a
    # starting gateway, unless this is true (then keep data_dir on durable storage: a
    # fresh data_dir meeting a wiped Redis would initialise it again). The embedded
    # Redis keeps its data in data_dir, so it is always initialised at its first start.
    auto_init: bool = False
    # The embedded Redis's memory bound (maxmemory, with noeviction: at the bound writes are
    # refused, every call fails closed with 503, nothing is evicted); 0: none.
    embedded_maxmemory_mb: Annotated[int, Field(ge=0, le=1_048_576)] = 512
    # Free space kept on the embedded Redis's data dir volume: below it /readyz is 503
    # (`disk`); outputs on the same volume stop this much earlier (see outputs.min_free_mb).
    min_free_mb: Annotated[int, Field(ge=0, le=1_048_576)] = 256
    # How long a deciding script's reply is remembered for a re-send of the same request.
    request_memory_seconds: Annotated[float, Field(ge=5, le=3600)] = 60.0
    # R: no verdict before its writes (and what its scripts read) are fsynced on the primary
    # and R replicas (gateway.store.replication); R = each primary's replicas; 0: off. Each of
    # the two waits is bounded (then 503); the topology is checked again every interval.
    replicas_acked: Annotated[int, Field(ge=0, le=16)] = 0
    replica_ack_timeout_ms: Annotated[int, Field(ge=1, le=30_000)] = 500
    topology_interval_seconds: Annotated[float, Field(gt=0, le=3600)] = 10.0

    @field_validator("url", mode="before")
    @classmethod
    def _seed_list(cls, value: Any) -> Any:
        """A list of seed nodes becomes one URL: ``["redis://a:1", "b:2"]`` → ``redis://a:1,b:2``."""
        if not isinstance(value, list | tuple):
            return value
        entries = [str(v).strip() for v in value if str(v).strip()]
        if not entries:
            return ""
        first = entries[0] if "://" in entries[0] else "redis://" + entries[0]
        rest = [e.split("://", 1)[-1].rsplit("@", 1)[-1] for e in entries[1:]]
        return ",".join([first, *rest])

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> RedisSettings:  # cluster and seeds; the acks within the timeout
        if self.cluster and not self.url:
            raise ValueError(
                "redis.cluster needs redis.url (seed nodes): the embedded Redis is standalone"
            )
        if not self.cluster and "," in self.url.split("?", 1)[0]:
            raise ValueError("redis.url names several nodes: set redis.cluster = true")
        if self.replicas_acked and 2 * self.replica_ack_timeout_ms >= self.timeout_seconds * 1000:
            raise ValueError("replica_ack_timeout_ms: twice it must fit in timeout_seconds")
        return self
