"""The HTTP tests' fixtures."""

from __future__ import annotations

import pytest

from tests.conftest import Gateway, Upstream


@pytest.fixture
async def primed(gw: Gateway, upstream: Upstream) -> Gateway:
    """The default gateway with job ``r`` registered at generation 1 and its step ``done``
    sent (the receiver's record cleared): a job and a step for bad input to aim at."""
    await gw.register("r", generation=1, lease_ms=60_000)
    assert (await gw.effect("r", "done", 1)).status == 200
    upstream.received.clear()
    return gw
