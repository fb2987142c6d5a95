"""Prometheus metrics (prometheus-client), one registry per app so tests stay isolated."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.effects = Counter(
            "fencegate_effects",
            "Effect calls by adapter and outcome (succeeded, failed, released, unknown, replayed).",
            ["adapter", "outcome"],
            registry=self.registry,
        )
        self.rejections = Counter(
            "fencegate_rejections",
            "Calls refused by the fence, by problem code (audited, but past a tenant's "
            "quotas.rejections_per_window).",
            ["reason"],
            registry=self.registry,
        )
        self.quota_rejections = Counter(
            "fencegate_quota_rejections",
            "Effect calls the fence rejected, per tenant, counted apart from the effects quota "
            "(audited false: past the tenant's rejections_per_window). Only with [quotas].",
            ["tenant", "audited"],
            registry=self.registry,
        )
        self.relay_not_sent = Counter(
            "fencegate_relay_not_sent",
            "Queued async steps the relay's claim refused to send (superseded, lease_expired, "
            "cancelled, unbound); each is released, the first two audited.",
            ["reason"],
            registry=self.registry,
        )
        self.problems = Counter(
            "fencegate_problems",
            "Problem responses by code and HTTP status.",
            ["code", "status"],
            registry=self.registry,
        )
        self.registrations = Counter(
            "fencegate_registrations",
            "Generation registrations by result (created, current).",
            ["result"],
            registry=self.registry,
        )
        self.dispatch_seconds = Histogram(
            "fencegate_dispatch_seconds",
            "Time spent in the adapter's dispatch.",
            ["adapter"],
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.request_seconds = Histogram(
            "fencegate_request_seconds",
            "HTTP request latency by route.",
            ["route"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
        )
        # attempt-scoped outputs (gateway.outputs, gateway.outputs_sweep)
        self.outputs = Counter(
            "fencegate_outputs",
            "Output uploads through the gateway by outcome (recorded, refused, failed).",
            ["outcome"],
            registry=self.registry,
        )
        self.orphans = Gauge(
            "fencegate_output_orphans",
            "Output objects that can never be promoted, left in the store after the last "
            "sweep, by reason (completed, cancelled, stale, unrecorded, unknown).",
            ["reason"],
            registry=self.registry,
        )
        self.orphan_bytes = Gauge(
            "fencegate_output_orphan_bytes",
            "Bytes of those orphans, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.orphans_deleted = Counter(
            "fencegate_output_orphans_deleted",
            "Orphan output objects the sweeper deleted, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.orphan_age_seconds = Histogram(
            "fencegate_output_orphan_age_seconds",
            "Age of an orphan output object when the sweeper deleted it.",
            registry=self.registry,
            buckets=(1, 10, 60, 300, 900, 3600, 4 * 3600, 86_400, 7 * 86_400),
        )

        # labels() validates and locks on every call; the hot path asks for a few
        # label combinations over and over, so their children are kept here
        self.request_timer = functools.lru_cache(maxsize=512)(self.request_seconds.labels)
        self.problem_counter = functools.lru_cache(maxsize=512)(self.problems.labels)
        self.rejection_counter = functools.lru_cache(maxsize=64)(self.rejections.labels)
        self.effect_counter = functools.lru_cache(maxsize=512)(self.effects.labels)

    def watch(self, batcher: Batcher) -> None:
        """Export the auto-pipeline's counters: commands / batches is the batching factor."""
        self.registry.register(_BatcherCollector(batcher))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Batcher(Protocol):
    """What the metrics read of the store's auto-pipeline (:mod:`gateway.store.batching`)."""

    @property
    def batches(self) -> int: ...

    @property
    def commands(self) -> int: ...

    @property
    def ack_failures(self) -> tuple[int, int] | None:
        """(batches, commands) the replicas did not acknowledge; None: replicas_acked is 0."""


class _BatcherCollector(Collector):
    def __init__(self, batcher: Batcher) -> None:
        self._batcher = batcher

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "fencegate_redis_batches",
            "Pipelined writes to Redis (one per event-loop tick with Redis work).",
            value=self._batcher.batches,
        )
        yield CounterMetricFamily(
            "fencegate_redis_commands",
            "Commands sent through the auto-pipeline (scripts and audit feed copies).",
            value=self._batcher.commands,
        )
        failures = self._batcher.ack_failures
        if failures is not None:  # [redis] replicas_acked > 0
            yield CounterMetricFamily(
                "fencegate_replica_ack_failed_batches",
                "Pipelined batches whose writes the primary and replicas_acked replicas did not "
                "acknowledge (WAIT/WAITAOF) in time: every reply of the batch became a 503.",
                value=failures[0],
            )
            yield CounterMetricFamily(
                "fencegate_replica_ack_failed_commands",
                "Commands (scripts) whose verdict was withheld because their batch was not "
                "acknowledged by the replicas (answered 503 store_unavailable).",
                value=failures[1],
            )
