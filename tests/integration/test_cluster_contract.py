"""The contract suite on a 3+3 Valkey Cluster: every outcome row (test_effects), the relay
(test_relay) and the concurrency tests (test_concurrency), unchanged, through a gateway with
``[redis] cluster = true``; the fixtures of cluster_support replace the standalone ones."""

from __future__ import annotations

from tests.integration.cluster_support import make_gateway, redis_sync, redis_url  # noqa: F401
from tests.integration.test_concurrency import *  # noqa: F403
from tests.integration.test_effects import *  # noqa: F403
from tests.integration.test_relay import *  # noqa: F403
