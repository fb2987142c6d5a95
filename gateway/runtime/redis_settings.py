"""The ``[redis]`` section of the settings (:mod:`gateway.runtime.settings`, which re-exports
it): frozen, unknown keys refused, like every section."""

from __future__ import annotations

from typing import Annotated, Any

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["RedisSettings"]


class _Section(BaseModel):
    # every field's docstring is its description (gateway.cli.configdoc writes the docs)
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class RedisSettings(_Section):
    """Redis, its durability and restore detection (``[redis]``)."""

    url: str = ""
    """Empty: an embedded durable redis-server; else `redis://`, `rediss://` (TLS),
    `unix://`; with `redis.cluster`, seed nodes: `redis://h1:6379,h2:6379` or a list
    `["redis://h1:6379", "h2:6379"]`."""
    cluster: bool = False
    """Redis/Valkey Cluster: scripts routed per slot to each shard's primary, markers per
    slot per node, every node's durability checked at start (see [Redis Cluster and many
    gateways](./operations.md#redis-cluster-and-many-gateways)); needs `redis.url` (the
    embedded Redis is standalone)."""
    data_dir: str = ".fencegate"
    """The embedded Redis's data (AOF) and the gateway's state file (initialised, epoch,
    per-slot high-water marks): keep it on durable storage."""
    timeout_seconds: Annotated[float, Field(gt=0, le=60)] = 2.0
    """Bound on each Redis exchange (one pipelined batch, or one command); past it the call
    fails closed (503)."""
    max_connections: Annotated[int, Field(ge=1, le=10_000)] = 64
    """Connections per pool (the auto-pipeline's, and one for views, relay and epochs; on a
    cluster, per primary); bursts wait for a connection."""
    allow_volatile: bool = False
    """Start even when an external Redis is not durable (`appendonly yes`, `appendfsync
    always`, `maxmemory-policy noeviction`), warning on every start (same as
    `--allow-volatile-redis`)."""
    epoch_interval_seconds: Annotated[float, Field(gt=0, le=3600)] = 30.0
    """How often the Redis epoch is bumped and the slot marks are compared with Redis's
    markers: a restored backup is detected within this without a call; on a cluster, all
    16,384 markers are read and kept as marks (no global epoch)."""
    marks_interval_seconds: Annotated[float, Field(gt=0, le=3600)] = 1.0
    """How often slot marks that rose are written to the state file (also at shutdown), and
    how often each process raises and checks its data dir's witness counter: a restore
    hidden from the slot counters is quarantined within it."""
    auto_init: bool = False
    """An external Redis is initialised only by `fencegate init`, never by a starting
    gateway, unless this is true (then keep `data_dir` on durable storage: a fresh data dir
    meeting a wiped Redis would initialise it again). The embedded Redis is always
    initialised at its first start."""
    embedded_maxmemory_mb: Annotated[int, Field(ge=0, le=1_048_576)] = 512
    """The embedded Redis's `maxmemory`, with `noeviction`: at the bound writes are refused
    and every call answers 503, nothing is evicted; 0: none."""
    min_free_mb: Annotated[int, Field(ge=0, le=1_048_576)] = 256
    """Free space kept on the embedded Redis's data dir volume: below it `/readyz` is 503
    (`disk`); outputs on the same volume stop this much earlier (`outputs.min_free_mb`)."""
    request_memory_seconds: Annotated[float, Field(ge=5, le=3600)] = 60.0
    """How long a deciding script's reply is remembered for a re-send of the same request: a
    registration re-sent with the same `Idempotency-Key` within this answers the first one's
    generation instead of allocating another. Keep it above the longest retry horizon of the
    workers' clients."""
    replicas_acked: Annotated[int, Field(ge=0, le=16)] = 0
    """R: no verdict (200, 201, 202, replay, 409) leaves the gateway and no adapter is called
    before the writes it depends on (its own and those its script read) are fsynced on the
    primary and on R replicas (`WAIT` + `WAITAOF`), else 503 `store_unavailable`. Set it to
    the number of replicas of each primary; the topology is checked at start (refusal, exit
    3) and while serving (`/readyz`). Needs Redis/Valkey >= 7.2 and an external Redis; 0:
    off. See [Replicas and failover](./operations.md#replicas-and-failover)."""
    replica_ack_timeout_ms: Annotated[int, Field(ge=1, le=30_000)] = 500
    """Bound on each of the two waits (`WAIT`, `WAITAOF`): a batch not acknowledged within
    them answers 503 after at most twice this; twice it must fit in `redis.timeout_seconds`
    (checked)."""
    topology_interval_seconds: Annotated[float, Field(gt=0, le=3600)] = 10.0
    """How often the replication topology is checked again while serving (`replicas_acked`
    > 0); a problem makes `/readyz` 503 and is logged (`replication_topology_unsupported`)."""

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
