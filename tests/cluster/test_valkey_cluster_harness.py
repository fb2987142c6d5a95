"""The test cluster itself (tests/support/valkey_cluster.py): topology, faults, migration,
restart."""

from __future__ import annotations

import time

import pytest
import redis

from tests.support.valkey_cluster import ValkeyCluster

pytestmark = pytest.mark.cluster


def test_three_primaries_each_with_one_synced_replica(
    valkey_cluster: ValkeyCluster, cluster_url: str
) -> None:
    primaries = valkey_cluster.primaries()
    assert len(primaries) == 3
    for p in primaries:
        (replica,) = valkey_cluster.replicas_of(p)
        role = valkey_cluster.client(replica).execute_command("ROLE")
        assert role[0] == "slave" and int(role[2]) == p.port
        for node in (p, replica):
            config = valkey_cluster.client(node).config_get("append*")
            assert config["appendonly"] == "yes" and config["appendfsync"] == "always"
    owners = {valkey_cluster.owner(s).port for s in (0, 8000, 16383)}
    assert owners == {p.port for p in primaries}
    assert cluster_url.startswith("redis://127.0.0.1:")


def test_kill_restart_and_manual_failover_leave_it_whole(
    valkey_cluster: ValkeyCluster, cluster_url: str
) -> None:
    c = valkey_cluster.client(valkey_cluster.nodes[0])
    slot = int(c.execute_command("CLUSTER", "KEYSLOT", "{kill}"))
    primary = valkey_cluster.owner(slot)
    (replica,) = valkey_cluster.replicas_of(primary)
    valkey_cluster.client(primary).set("{kill}", "1")
    valkey_cluster.client(primary).execute_command("WAIT", 1, 2000)
    valkey_cluster.failover(replica)  # plain: the replica caught up first
    assert valkey_cluster.owner(slot).port == replica.port
    assert valkey_cluster.client(replica).get("{kill}") == "1"
    valkey_cluster.kill(replica)  # the new primary dies: the old one takes over again
    assert replica.pid is not None and not replica.alive
    valkey_cluster.wait_primary(primary, timeout=15)
    valkey_cluster.restart(replica)
    valkey_cluster.wait_ok()
    valkey_cluster.wait_synced()
    assert valkey_cluster.owner(slot).port == primary.port
    assert valkey_cluster.replicas_of(primary) == [replica]
    assert valkey_cluster.client(primary).get("{kill}") == "1"


def test_migrating_a_slot_moves_its_keys_and_answers_ask_meanwhile(
    valkey_cluster: ValkeyCluster, cluster_url: str
) -> None:
    c = valkey_cluster.client(valkey_cluster.nodes[0])
    slot = int(c.execute_command("CLUSTER", "KEYSLOT", "{mig}"))
    source = valkey_cluster.owner(slot)
    target = next(p for p in valkey_cluster.primaries() if p.port != source.port)
    src = valkey_cluster.client(source)
    src.set("{mig}:a", "1")
    src.set("{mig}:b", "2")
    valkey_cluster.begin_migration(slot, target)
    assert valkey_cluster.move_keys(slot, source, target, limit=1) == 1
    (left,) = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10)
    moved = "{mig}:b" if left == "{mig}:a" else "{mig}:a"
    assert src.get(left) in ("1", "2")
    with pytest.raises(redis.exceptions.AskError, match=str(target.port)):
        src.get(moved)  # a single moved key: ASK to the target
    with pytest.raises(redis.exceptions.TryAgainError):
        src.mget("{mig}:a", "{mig}:b")  # one key left, one moved: a multi-key command waits
    valkey_cluster.move_keys(slot, source, target)
    valkey_cluster.finish_migration(slot, target)
    assert valkey_cluster.owner(slot).port == target.port
    assert valkey_cluster.client(target).mget("{mig}:a", "{mig}:b") == ["1", "2"]
    valkey_cluster.migrate_slot(slot, source)  # back, for the next test
    started = time.monotonic()
    valkey_cluster.wait_ok()
    assert time.monotonic() - started < 20
