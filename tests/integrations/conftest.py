"""The integrations' fixtures: the gateway their worker processes talk to (a claim key named
``CLAIM_NAME``; the test reads as admin) and Debian's PostgreSQL on loopback, one server per
test module (the Postgres and Procrastinate tests)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import Gateway
from tests.support.frameworks import claim_gateway
from tests.support.postgres import PostgresServer


@pytest.fixture
async def gw(make_gateway: Any) -> Gateway:
    return await claim_gateway(make_gateway)


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    server = PostgresServer()
    server.start()
    yield server
    server.stop()
