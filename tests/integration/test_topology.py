"""The replication topology that replicas_acked relies on, checked against real Valkey
primaries and replicas (tests.valkey_replicas), and the refusal to start without it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.cli.serve import check_replication
from gateway.runtime.settings import ConfigError, load_settings
from gateway.store.topology import check_topology
from tests.valkey_replicas import ReplicaSet


def test_one_replica_and_r1_is_supported_anything_else_is_not(tmp_path: Path) -> None:
    rs = ReplicaSet(tmp_path / "v", replicas=1).start()
    try:
        url = rs.primary.url
        ok = asyncio.run(check_topology(url, 1))
        assert ok.ok and ok.warnings == [], ok
        assert [len(s.replicas) for s in ok.shards] == [1]
        # more acknowledgements than replicas: nothing could ever be acknowledged
        assert (
            "has 1 online replica(s), replicas_acked = 2"
            in asyncio.run(check_topology(url, 2)).problems[0]
        )
        # the URL names a replica: WAIT/WAITAOF do not work there
        on_replica = asyncio.run(check_topology(rs.replicas[0].url, 1))
        assert any("not a primary" in p for p in on_replica.problems), on_replica.problems
        # a second replica, with fsync everysec: WAIT 1 could be satisfied by either one, so a
        # promoted one may lack an acknowledged write; and its AOF is not fsynced per write
        rs.add_replica(extra=("--appendfsync", "everysec"))
        two = asyncio.run(check_topology(url, 1)).problems
        assert any("has 2 replicas, replicas_acked = 1" in p for p in two), two
        assert any("appendfsync is 'everysec'" in p for p in two), two
        assert not any("has 2 replicas" in p for p in asyncio.run(check_topology(url, 2)).problems)
    finally:
        rs.stop()


def test_serve_refuses_a_topology_it_cannot_rely_on(tmp_path: Path) -> None:
    rs = ReplicaSet(tmp_path / "v", replicas=1).start()
    try:
        url = rs.primary.url
        assert check_replication(load_settings(None, redis={"url": url, "replicas_acked": 1}))
        two = load_settings(None, redis={"url": url, "replicas_acked": 2})
        assert not check_replication(two)  # exit code 3 in `fencegate serve`
        waived = load_settings(
            None, redis={"url": url, "replicas_acked": 2, "allow_volatile": True}
        )
        assert check_replication(waived)  # warned, started
        assert check_replication(load_settings(None, redis={"url": url}))  # R = 0: not checked
    finally:
        rs.stop()


def test_both_waits_must_fit_in_the_redis_timeout() -> None:
    with pytest.raises(ConfigError, match="replica_ack_timeout_ms"):
        load_settings(
            None,
            redis={"replicas_acked": 1, "replica_ack_timeout_ms": 1000, "timeout_seconds": 2},
        )
    load_settings(None, redis={"replicas_acked": 1, "replica_ack_timeout_ms": 900})
