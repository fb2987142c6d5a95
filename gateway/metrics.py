"""Prometheus metrics (prometheus-client), one registry per app so tests stay isolated."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

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
            "Calls refused by the fence, by problem code (all audited).",
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
