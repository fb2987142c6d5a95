"""``fencegate serve``: one process or a supervisor of ``--workers N``, the event loop, the
safety refusals (open gateway off loopback, non-durable external Redis, a replication
topology ``redis.replicas_acked`` cannot rely on)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import ipaddress
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import redis

from adapters.registry import validate_configs
from gateway import __version__
from gateway.cli.common import (
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_RUNTIME,
    cli_settings,
    init_durability,
    log,
)
from gateway.runtime.exitbound import MARGIN_SECONDS, ExitBound
from gateway.runtime.logging import configure_logging
from gateway.runtime.settings import Settings, read_secret
from gateway.store.durability import settings_problems
from gateway.store.embedded import EmbeddedRedis, EmbeddedRedisError, die_with_parent

if TYPE_CHECKING:
    pass


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_replication(settings: Settings) -> bool:
    """With ``redis.replicas_acked``: the topology it relies on (gateway.store.topology), or a
    refusal to start (unless ``allow_volatile``, which starts with a loud warning)."""
    replicas = settings.redis.replicas_acked
    if not replicas:
        return True
    from gateway.store.topology import check_topology

    topology = asyncio.run(
        check_topology(settings.redis.url, replicas, io_timeout=settings.redis.timeout_seconds)
    )
    for warning in topology.warnings:
        log.warning("replication_topology_warning", detail=warning)
    if topology.ok:
        log.info("replication_topology_ok", replicas_acked=replicas, shards=topology.summary())
        return True
    detail = "; ".join(topology.problems)
    if settings.redis.allow_volatile:
        log.warning("REPLICATION_UNSUPPORTED", detail=detail, allowed_by="allow_volatile")
        return True
    log.error(
        "replication_topology_unsupported",
        detail=detail,
        hint="fix the replicas, change redis.replicas_acked, or pass --allow-volatile-redis",
    )
    return False


def check_external_durability(url: str, allow_volatile: bool) -> bool:
    """True if the external Redis keeps fences across restarts (or the operator waived it)."""
    client = redis.Redis.from_url(
        url, socket_timeout=5, socket_connect_timeout=5, decode_responses=True
    )
    try:
        aof = client.config_get("appendonly").get("appendonly")
        fsync = client.config_get("appendfsync").get("appendfsync")
        policy = client.config_get("maxmemory-policy").get("maxmemory-policy")
    except redis.exceptions.ResponseError:
        log.warning(
            "redis_durability_unverified",
            detail="CONFIG GET is not permitted; make sure Redis runs with appendonly yes, "
            "appendfsync always and maxmemory-policy noeviction",
        )
        return True
    finally:
        client.close()
    problems = settings_problems(aof, fsync, policy)
    if not problems:
        return True
    detail = (
        "; ".join(problems)
        + ": a restart, a crash or an eviction would lose fences and let zombies through"
    )
    if allow_volatile:
        log.warning("REDIS_NOT_DURABLE", detail=detail, allowed_by="--allow-volatile-redis")
        return True
    log.error("redis_not_durable", detail=detail, hint="fix Redis or pass --allow-volatile-redis")
    return False


def _configured_secrets(settings: Settings) -> list[str]:
    """Every secret the config names (adapter and upstream credentials, keys, signing keys):
    never logged."""
    names: list[object] = []
    for section in (*settings.adapters.values(), *settings.upstreams.values()):
        for key, value in section.items():
            if key.endswith("_env"):  # a name, or a table of names (webhook headers_env)
                names += list(value.values()) if isinstance(value, dict) else [value]
    names += [k.key_env for k in settings.auth.keys if k.key_env]
    if settings.auth.token_signing_key_env:
        names.append(settings.auth.token_signing_key_env)
    if settings.audit.key_env:
        names.append(settings.audit.key_env)
    values: list[str] = []
    with contextlib.suppress(ValueError):  # the Redis URL's password, if it has one
        from urllib.parse import urlsplit

        if password := urlsplit(settings.redis.url).password:
            values.append(password)
    for name in names:
        value = os.environ.get(str(name), "") if name else ""
        values += [v.strip() for v in value.split(",") if len(v.strip()) >= 4]
    return values


def _crash_hook(args: argparse.Namespace) -> Callable[[str], None] | None:
    """Chaos testing: SIGKILL this process at a named point with some probability."""
    point, rate = args.chaos_crash_at, args.chaos_crash_rate
    if not point:
        return None
    rng = random.Random()

    def crash(at: str) -> None:
        if at == point and rng.random() < rate:
            os.kill(os.getpid(), signal.SIGKILL)

    return crash


def _serve_workers(args: argparse.Namespace, settings: Settings, url: str) -> int:
    """N processes on one port (SO_REUSEPORT) and one Redis; this process supervises them."""
    data_dir = Path(settings.redis.data_dir)
    # the embedded Redis (its data in data_dir) is initialised at its first start; an
    # external one only by `fencegate init`, or with redis.auto_init
    write = not settings.redis.url or settings.redis.auto_init
    result = asyncio.run(
        init_durability(
            url,
            data_dir / "fencegate.state",
            auto=True,
            write=write,
            cluster=settings.redis.cluster,
        )
    )
    log.info("workers_starting", workers=args.workers, durability_marker=result)
    # The URL (it may hold a password) goes by environment, never on a command line: a
    # process's argv is readable by every local user (ps), its environment only by its owner.
    argv = [sys.executable, "-m", "gateway", "serve", "--reuse-port", "--workers", "1"]
    env = {**os.environ, "FENCEGATE_REDIS__URL": url}
    argv += ["--host", settings.server.host, "--port", str(settings.server.port)]
    if args.config:
        argv += ["--config", args.config]
    if settings.redis.allow_volatile or args.allow_volatile_redis:
        argv.append("--allow-volatile-redis")
    stopping: list[float] = []

    def forward(signum: int, frame: object) -> None:
        stopping.append(time.monotonic())
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    # workers die with this supervisor even if it is SIGKILLed (Linux)
    children = [
        subprocess.Popen(argv, env=env, preexec_fn=die_with_parent()) for _ in range(args.workers)
    ]
    # a second past a worker's own bound (gateway.runtime.exitbound), which ends it first and
    # logs what it was still waiting for
    bound = settings.server.shutdown_grace_seconds + MARGIN_SECONDS + 1
    while any(child.poll() is None for child in children):
        time.sleep(0.1)
        if stopping and time.monotonic() - stopping[0] > bound:
            # a worker that missed or ignored the signal (e.g. still starting): stop it for good
            for child in children:
                if child.poll() is None:
                    log.warning("worker_killed_after_grace", pid=child.pid)
                    child.kill()
    return max(child.returncode for child in children)


def cmd_serve(args: argparse.Namespace) -> int:
    settings = cli_settings(args)
    configure_logging(secrets=_configured_secrets(settings))
    validate_configs(settings.adapters, read_secret)
    host, port = settings.server.host, settings.server.port
    if not settings.auth.keys:
        if not _is_loopback(host):
            log.error(
                "refusing_to_start",
                detail=f"no [[auth.keys]] are configured and {host} is not a loopback address; "
                "configure keys or bind to 127.0.0.1",
            )
            return EXIT_REFUSED
        log.warning(
            "no_api_keys", detail=f"no API keys configured: serving unauthenticated on {host} only"
        )
    data_dir = Path(settings.redis.data_dir)
    embedded: EmbeddedRedis | None = None
    exit_bound = ExitBound(settings.server.shutdown_grace_seconds + MARGIN_SECONDS)
    try:
        if settings.redis.url:
            url = settings.redis.url
            if settings.redis.cluster:
                from gateway.cli.cluster_check import check_cluster_durability

                if not check_cluster_durability(url, settings.redis.allow_volatile):
                    return EXIT_REFUSED
            elif not check_external_durability(url, settings.redis.allow_volatile):
                return EXIT_REFUSED
            if not check_replication(settings):
                return EXIT_REFUSED
        elif settings.redis.replicas_acked:
            log.error(
                "refusing_to_start",
                detail="redis.replicas_acked needs an external Redis with replicas (redis.url); "
                "the embedded Redis has none",
            )
            return EXIT_REFUSED
        else:
            embedded = EmbeddedRedis(data_dir, maxmemory_mb=settings.redis.embedded_maxmemory_mb)
            url = embedded.start()
            log.info(
                "embedded_redis_started",
                url=url,
                data_dir=str(embedded.data_dir),
                pid=embedded.process.pid if embedded.process else None,
                maxmemory_mb=settings.redis.embedded_maxmemory_mb or None,
            )

            def supervised(event: str, facts: dict[str, object]) -> None:
                level = log.info if event == "restarted" else log.error
                level(f"embedded_redis_{event}", **facts)

            embedded.supervise(supervised)
        if args.workers > 1:
            return _serve_workers(args, settings, url)
        from gateway.http.app import create_app

        app = create_app(
            settings,
            redis_url=url,
            state_file=data_dir / "fencegate.state",
            crash_hook=_crash_hook(args),
            handle_signals=True,
        )
        loop, loop_name = _new_event_loop(settings.server.event_loop)
        log.info(
            "listening",
            host=host,
            port=port,
            registration=settings.fencing.registration,
            event_loop=loop_name,
            version=__version__,
        )
        _tame_gc()
        from gateway.http.connections import run_app

        run_app(  # web.run_app with a connection cap, deadlines and JSON-only logs
            app,
            loop=loop,
            host=host,
            port=port,
            settings=settings.connections,
            shutdown_timeout=settings.server.shutdown_grace_seconds,
            reuse_port=args.reuse_port or None,
            exit_bound=exit_bound,
        )
        return EXIT_OK
    except EmbeddedRedisError as exc:
        log.error("embedded_redis_failed", detail=str(exc))
        return EXIT_RUNTIME
    finally:
        if embedded is not None:
            # stopped here, within its own bound: a forced exit would leave it running where
            # there is no death signal (PR_SET_PDEATHSIG is Linux's)
            exit_bound.disarm()
            embedded.stop()
            log.info("embedded_redis_stopped")


def _new_event_loop(choice: str) -> tuple[asyncio.AbstractEventLoop, str]:
    """uvloop when chosen or (``auto``) installed; it runs the same code with less overhead."""
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":  # pragma: no cover - the settings check this first
                raise
        else:
            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            asyncio.set_event_loop(loop)
            return loop, "uvloop"
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    return loop, "asyncio"


def _tame_gc() -> None:
    """Steadier tail latency under load (measured with ``make bench``, p99/p50).

    Objects alive after start-up (modules, settings, scripts) leave the collector's
    generations, and the young generation is collected every 10,000 net
    allocations rather than 700: a request allocates a few hundred objects, nearly
    all freed by reference counting, so young collections were frequent and
    found almost nothing.
    """
    gc.collect()
    gc.freeze()
    _, second, third = gc.get_threshold()
    gc.set_threshold(10_000, second, third)
