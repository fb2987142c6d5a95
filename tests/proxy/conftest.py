"""Fixtures of the proxy's tests: a receiver on loopback, the provider credentials in the
environment, and a gateway with both tenants' keys and the upstreams in front of the receiver."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.conftest import Gateway
from tests.support.proxying import SECRETS, Receiver, auth, upstreams


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    rc = Receiver()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", rc.handle)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    rc.url = str(server.make_url("")).rstrip("/")
    yield rc
    if rc.gate is not None:
        rc.gate.set()
    await server.close()


@pytest.fixture
def secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
async def gw(make_gateway: Any, receiver: Receiver, secrets: None) -> Gateway:
    g: Gateway = await make_gateway(auth=auth(), upstreams=upstreams(receiver.url))
    return g
