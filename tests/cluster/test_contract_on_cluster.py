"""The contract suite on a 3+3 Valkey Cluster: every outcome row (test_effects), the relay
(test_relay), the concurrency tests (test_concurrency) and the checkpoint quotas
(test_checkpoint_quotas: the tenant's counter in another slot than the job's), unchanged,
through a gateway with ``[redis] cluster = true`` and ``replicas_acked = 1``; the fixtures of
cluster_support replace the standalone ones."""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway.fencing.relay import Relay
from gateway.http import appkeys as K
from tests.conftest import Gateway
from tests.fencing import test_relay
from tests.fencing.test_checkpoint_quotas import *  # noqa: F403
from tests.fencing.test_concurrency import *  # noqa: F403
from tests.fencing.test_effect_outcomes import *  # noqa: F403
from tests.fencing.test_relay import *  # noqa: F403
from tests.support.cluster_gateway import make_gateway, redis_sync, redis_url  # noqa: F401

pytestmark = pytest.mark.cluster

# 300 rounds, each starting a sweep of 16,384 slot queues: ~50 s on Cluster; 40 here (below)
del test_a_stopped_relay_always_stops  # noqa: F821
assert test_relay.test_a_stopped_relay_always_stops


async def test_a_stopped_relay_always_stops_on_cluster(gw: Gateway) -> None:
    """As test_relay's, fewer rounds: the stop lands anywhere, including in the router's
    futures of a sweep (cancelled callers, batches still in flight per node)."""
    dispatcher = gw.app[K.SERVICE].dispatcher
    rng = random.Random(20261201)
    for _ in range(40):
        loop = Relay(gw.app[K.STORE], dispatcher, gw.app[K.METRICS])
        relay = asyncio.create_task(loop.run(interval=0.001))
        await asyncio.sleep(rng.uniform(0, 0.02))
        loop.stop()
        relay.cancel()
        done, _ = await asyncio.wait({relay}, timeout=4)
        assert relay in done, "the relay did not stop"
