"""The downstream fencing helper, and third-party adapters through the entry-point group."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from adapters.registry import AdapterConfigError, load_type, validate_configs
from gateway.downstream import MemoryFenceKeeper, RedisFenceKeeper, fencing_middleware
from tests.conftest import Gateway


def orders_app(keeper: Any, writes: list[tuple[str, str]]) -> web.Application:
    async def update(request: web.Request) -> web.Response:
        if request.method == "POST":
            writes.append((request.match_info["order"], request.headers["Fencing-Token"]))
            await asyncio.sleep(0)  # let other requests interleave, as real I/O would
        return web.json_response({"ok": True})

    app = web.Application(
        middlewares=[fencing_middleware(keeper, resource=lambda r: r.match_info["order"])]
    )
    app.router.add_post("/orders/{order}", update)
    app.router.add_get("/orders/{order}", update)
    return app


@pytest.fixture(params=["memory", "redis"])
async def keeper(request: pytest.FixtureRequest, redis_url: str) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield MemoryFenceKeeper()
        return
    client = aioredis.Redis.from_url(redis_url)
    yield RedisFenceKeeper(client)
    await client.aclose()


async def test_downstream_refuses_lower_tokens(keeper: Any) -> None:
    writes: list[tuple[str, str]] = []
    async with TestClient(TestServer(orders_app(keeper, writes))) as client:
        assert (await client.post("/orders/7", headers={"Fencing-Token": "5"})).status == 200
        assert (
            await client.post("/orders/7", headers={"Fencing-Token": "5"})
        ).status == 200  # same gen again
        stale = await client.post("/orders/7", headers={"Fencing-Token": "4"})
        body = await stale.json(content_type=None)
        assert stale.status == 409 and body["code"] == "stale_generation"
        assert (body["presented"], body["current"]) == (4, 5)
        assert (
            await client.post("/orders/8", headers={"Fencing-Token": "1"})
        ).status == 200  # per resource
        assert (await client.post("/orders/7")).status == 400  # a write without a token
        assert (await client.get("/orders/7")).status == 200  # reads are not fenced
        assert (await client.post("/orders/7", headers={"Fencing-Token": "abc"})).status == 400
    assert writes == [("7", "5"), ("7", "5"), ("8", "1")]


async def test_downstream_fencing_under_concurrency(keeper: Any) -> None:
    writes: list[tuple[str, str]] = []
    async with TestClient(TestServer(orders_app(keeper, writes))) as client:
        tokens = list(range(1, 41))
        results = await asyncio.gather(
            *(client.post("/orders/1", headers={"Fencing-Token": str(t)}) for t in tokens)
        )
        accepted = [int(tok) for _, tok in writes]
        # writes landed in token order: a stale write never overwrote a newer one
        assert accepted == sorted(accepted)
        assert sum(r.status == 200 for r in results) == len(accepted)
        assert await keeper.highest("1") == max(accepted)


async def test_gateway_webhook_into_a_fenced_downstream(make_gateway: Any) -> None:
    keeper = MemoryFenceKeeper()
    writes: list[tuple[str, str]] = []
    server = TestServer(orders_app(keeper, writes), host="127.0.0.1", port=0)
    await server.start_server()
    try:
        gw: Gateway = await make_gateway(
            adapters={"orders": {"type": "webhook", "url": str(server.make_url("/orders/7"))}}
        )
        await gw.register("r", generation=3)
        assert (await gw.effect("r", "ship", 3, adapter="orders", operation="ship")).status == 200
        # a caller that bypasses the gateway with an old token is refused by the target itself
        async with TestClient(server) as direct:
            resp = await direct.post("/orders/7", headers={"Fencing-Token": "2"})
            assert resp.status == 409
        assert writes == [("7", "3")]
    finally:
        await server.close()


@pytest.fixture
def plugin_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A real installed distribution (dist-info on sys.path) declaring fencegate.adapters."""
    (tmp_path / "echo_adapter.py").write_text(
        textwrap.dedent(
            """
            from typing import Any, ClassVar, Literal
            from adapters.base import AdapterConfig, Capabilities, Delivered

            class EchoConfig(AdapterConfig):
                type: Literal["echo"] = "echo"
                prefix: str = ""

            class EchoAdapter:
                Config: ClassVar[type[EchoConfig]] = EchoConfig

                def __init__(self, name: str, config: EchoConfig, ctx: Any) -> None:
                    self.name, self._prefix = name, config.prefix
                    self.capabilities = Capabilities()

                def validate(self, operation: str, payload: Any) -> None:
                    pass

                async def dispatch(self, request: Any) -> Delivered:
                    return Delivered({"echo": self._prefix + request.idempotency_key})

                async def lookup(self, request: Any) -> None:
                    return None

                async def aclose(self) -> None:
                    pass
            """
        )
    )
    (tmp_path / "needs_missing.py").write_text("import fencegate_no_such_sdk\nclass A: pass\n")
    dist = tmp_path / "fencegate_echo-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fencegate-echo\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[fencegate.adapters]\necho = echo_adapter:EchoAdapter\nneedy = needs_missing:A\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("echo_adapter", None)


async def test_third_party_adapter_from_entry_point(plugin_dist: Path, make_gateway: Any) -> None:
    gw: Gateway = await make_gateway(adapters={"loud": {"type": "echo", "prefix": ">"}})
    await gw.register("r", generation=1)
    resp = await gw.effect("r", "s", 1, adapter="loud", operation="x")
    assert resp.status == 200 and (await resp.json())["result"] == {"echo": ">r:s"}


def test_missing_dependency_gives_an_actionable_message(plugin_dist: Path) -> None:
    with pytest.raises(AdapterConfigError, match=r"needs 'fencegate_no_such_sdk'.*pip install"):
        load_type("needy")


def test_unknown_type_and_bad_keys_name_the_problem(plugin_dist: Path) -> None:
    with pytest.raises(AdapterConfigError, match=r"unknown adapter type 'fax'.*echo"):
        validate_configs({"x": {"type": "fax"}})
    with pytest.raises(AdapterConfigError, match=r"adapters\.e\.colour"):
        validate_configs({"e": {"type": "echo", "colour": "red"}})
    with pytest.raises(AdapterConfigError, match=r"adapters\.m\.sender"):
        validate_configs({"m": {"type": "smtp", "host": "h"}})


def test_duplicate_adapter_type_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dist = tmp_path / "evil-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: evil\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[fencegate.adapters]\nwebhook = evil:Webhook\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(AdapterConfigError, match="clashes"):
        load_type("webhook")
