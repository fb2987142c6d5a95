"""The ``fencegate`` command: parse args → load settings → configure logging → run.

Exit codes: 0 success; 1 runtime failure (Redis or the gateway unreachable,
embedded Redis failed, a demo invariant did not hold); 2 bad usage or
configuration (the message names the key); 3 refused for safety (durability
marker missing, non-durable Redis, open gateway on a non-loopback address).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hashlib
import ipaddress
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis
import structlog

from adapters.registry import AdapterConfigError, validate_configs
from gateway import __version__
from gateway.embedded import EmbeddedRedis, EmbeddedRedisError, die_with_parent, socket_of
from gateway.errors import FencegateError
from gateway.logging import configure_logging
from gateway.records import AuditCheck
from gateway.settings import NAME_RE, ConfigError, Settings, load_settings, read_secret
from gateway.tenancy import resolve_tenancy

if TYPE_CHECKING:
    from gateway.store import Store

EXIT_OK, EXIT_RUNTIME, EXIT_CONFIG, EXIT_REFUSED = 0, 1, 2, 3

log = structlog.get_logger("fencegate")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _settings(args: argparse.Namespace) -> Settings:
    return load_settings(
        args.config,
        server={"host": getattr(args, "host", None), "port": getattr(args, "port", None)},
        redis={
            "url": getattr(args, "redis_url", None),
            "allow_volatile": True if getattr(args, "allow_volatile_redis", False) else None,
        },
    )


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
    problems = []
    if aof != "yes":
        problems.append(f"appendonly is {aof!r} (need 'yes')")
    if fsync != "always":
        # everysec: an acknowledged write (a registration, a recorded outcome) can be lost
        # in the last second before a crash of the host
        problems.append(f"appendfsync is {fsync!r} (need 'always')")
    if policy != "noeviction":
        problems.append(f"maxmemory-policy is {policy!r} (need 'noeviction')")
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


def check_replication(settings: Settings) -> bool:
    """With ``redis.replicas_acked``: the topology it relies on (gateway.topology), or a
    refusal to start (unless ``allow_volatile``, which starts with a loud warning)."""
    replicas = settings.redis.replicas_acked
    if not replicas:
        return True
    from gateway.topology import check_topology

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


def _configured_secrets(settings: Settings) -> list[str]:
    """Every secret the config names (adapter credentials, keys, signing keys): never logged."""
    names: list[object] = []
    for section in settings.adapters.values():
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
    result = asyncio.run(_init(url, data_dir / "fencegate.state", auto=True, write=write))
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
        subprocess.Popen(argv, env=env, preexec_fn=die_with_parent) for _ in range(args.workers)
    ]
    bound = settings.server.shutdown_grace_seconds + 5
    while any(child.poll() is None for child in children):
        time.sleep(0.1)
        if stopping and time.monotonic() - stopping[0] > bound:
            # a worker that missed or ignored the signal (e.g. still starting): stop it for good
            for child in children:
                if child.poll() is None:
                    log.warning("worker_killed_after_grace", pid=child.pid)
                    child.kill()
    return max(child.returncode for child in children)


@contextlib.asynccontextmanager
async def _cli_store(url: str, state_file: Path | None = None) -> AsyncIterator[Store]:
    """A short-lived store for CLI commands (init, audit verify, the workers' supervisor)."""
    from gateway.store import Store, connect

    client = connect(url, timeout=10, max_connections=2)
    store = Store(
        client, registration="required", dispatch_timeout_ms=1, retention_seconds=60,
        state_file=state_file,
    )  # fmt: skip
    try:
        yield store
    finally:
        await store.aclose()
        await client.aclose()


async def _init(
    url: str, state_file: Path, *, auto: bool, confirm: bool = False, write: bool = True
) -> str:
    async with _cli_store(url, state_file) as store:
        return await store.initialize(auto=auto, confirm_data_loss=confirm, write=write)


def cmd_serve(args: argparse.Namespace) -> int:
    settings = _settings(args)
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
    try:
        if settings.redis.url:
            url = settings.redis.url
            if not check_external_durability(url, settings.redis.allow_volatile):
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
            embedded = EmbeddedRedis(data_dir)
            url = embedded.start()
            log.info(
                "embedded_redis_started",
                url=url,
                data_dir=str(embedded.data_dir),
                pid=embedded.process.pid if embedded.process else None,
            )
        if args.workers > 1:
            return _serve_workers(args, settings, url)
        from gateway.app import create_app

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
        from gateway.connections import run_app

        run_app(  # web.run_app with a connection cap, deadlines and JSON-only logs
            app,
            loop=loop,
            host=host,
            port=port,
            settings=settings.connections,
            shutdown_timeout=settings.server.shutdown_grace_seconds,
            reuse_port=args.reuse_port or None,
        )
        return EXIT_OK
    except EmbeddedRedisError as exc:
        log.error("embedded_redis_failed", detail=str(exc))
        return EXIT_RUNTIME
    finally:
        if embedded is not None:
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


def _cli_redis_url(settings: Settings) -> tuple[str, EmbeddedRedis | None]:
    """The Redis a CLI command should use: the configured one, a running gateway's
    embedded one (its socket), or a freshly started embedded one."""
    if settings.redis.url:
        return settings.redis.url, None
    sock = socket_of(settings.redis.data_dir)
    if sock.exists():
        try:
            client = redis.Redis(unix_socket_path=str(sock), socket_timeout=2)
            client.ping()
            client.close()
            return f"unix://{sock}", None
        except (redis.exceptions.ConnectionError, OSError):
            pass
    embedded = EmbeddedRedis(settings.redis.data_dir)
    return embedded.start(), embedded


def cmd_init(args: argparse.Namespace) -> int:
    settings = _settings(args)
    configure_logging()
    data_dir = Path(settings.redis.data_dir)
    url, embedded = _cli_redis_url(settings)
    try:
        result = asyncio.run(
            _init(url, data_dir / "fencegate.state", auto=False, confirm=args.confirm_data_loss)
        )
    finally:
        if embedded is not None:
            embedded.stop()
    messages = {
        "present": "already initialised: the durability marker is present",
        "written": "initialised: durability marker written",
        "stale_snapshot": "refused: this Redis is older than the one this gateway last saw "
        "(restored from an old snapshot?); fences may have been lost. If you accept that, "
        "run again with --confirm-data-loss (and re-register current generations).",
        "refused": "refused: this Redis holds fencegate data or was initialised before, but has no "
        "durability marker. Fences may have been lost. If you accept that, run again with "
        "--confirm-data-loss (and re-register current generations).",
    }
    print(messages[result])
    return EXIT_REFUSED if result in ("refused", "stale_snapshot") else EXIT_OK


def cmd_check_config(args: argparse.Namespace) -> int:
    settings = load_settings(args.file)
    validate_configs(settings.adapters)
    resolve_tenancy(settings)  # adapters' tenants and keys: refused here as at start
    print(
        f"{args.file}: ok ({len(settings.adapters)} adapters, {len(settings.auth.keys)} keys, "
        f"registration={settings.fencing.registration})"
    )
    return EXIT_OK


def cmd_keys_new(args: argparse.Namespace) -> int:
    key = secrets.token_urlsafe(32)
    digest = hashlib.sha256(key.encode()).hexdigest()
    print(f"key (give it to the {args.role}; it is not stored anywhere):\n  {key}\n")
    print("config (add to the [auth] part of fencegate.toml):")
    print(f'[[auth.keys]]\nrole = "{args.role}"\nsha256 = "{digest}"\ntenant = "{args.tenant}"')
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from gateway.demo import main as demo_main

    return demo_main([])


def _client_args(args: argparse.Namespace) -> dict[str, Any]:
    return {"api_key": args.api_key or os.environ.get("FENCEGATE_API_KEY") or None}


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip()
        for r in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_job(args: argparse.Namespace) -> int:
    from gateway.client import Scheduler

    async def run() -> dict[str, Any]:
        async with Scheduler(args.url, **_client_args(args)) as sched:
            return await sched.job(args.job_id)

    job = asyncio.run(run())
    print(
        f"job {job['job_id']}: fence={job['fence']} cancelled={job['cancelled']} "
        f"lease_expires_at={job['lease_expires_at'] or '-'}"
    )
    rows = [
        [
            step,
            e["state"],
            str(e["generation"]),
            e["adapter"],
            e["operation"],
            str(e["attempts"]),
            e["updated_at"] or "-",
        ]
        for step, e in sorted(job["effects"].items())
    ]
    if rows:
        print(
            _table(rows, ["step", "state", "gen", "adapter", "operation", "attempts", "updated_at"])
        )
    return EXIT_OK


def cmd_audit_verify(args: argparse.Namespace) -> int:
    from gateway.audit_anchor import AnchorCheck, anchor_path, audit_keys

    settings = _settings(args)
    keys = audit_keys(settings, read_secret)
    files = [Path(p) for p in args.anchors] if args.anchors else [anchor_path(settings)]
    url, embedded = _cli_redis_url(settings)

    async def run() -> AuditCheck:
        async with _cli_store(url) as store:
            return await store.verify_audit(
                keys=keys,
                anchor_files=files,
                retention_seconds=settings.fencing.retention_seconds,
            )

    try:
        check = asyncio.run(run())
    finally:
        if embedded is not None:
            embedded.stop()
    assert isinstance(check, AnchorCheck)
    for problem in check.broken:
        print(f"BROKEN  {problem}")
    state = "intact" if not check.broken else f"{len(check.broken)} problems"
    how = f"keyed (kid {', '.join(check.kids)})" if check.keyed else "unkeyed"
    print(f"audit chains: {check.jobs} jobs, {check.entries} entries, {state}; {how}")
    print(
        f"anchors: {check.anchors} checked ({check.anchors_expired} past retention, not "
        f"checkable) from {', '.join(check.anchor_files) or 'no file'}"
        + (f"; not found: {', '.join(check.missing_files)}" if check.missing_files else "")
    )
    for note in check.notes:
        print(f"note: {note}")
    if not check.keyed:
        print(
            "unkeyed chain: detects accidental damage only; anyone who can write Redis can "
            "re-hash altered entries (set [audit] key_env)"
        )
    print(
        "not detectable: deleting a job's entries newer than its newest anchor together with "
        "its chain head in Redis; deleting an anchor from every place it was written"
    )
    return EXIT_OK if not check.broken else EXIT_RUNTIME


def cmd_audit(args: argparse.Namespace) -> int:
    from gateway.client import Scheduler

    if args.action == "verify":
        return cmd_audit_verify(args)

    header = ["at", "job", "step", "reason", "presented", "current", "worker"]

    def row(e: dict[str, Any]) -> list[str]:
        return [
            e["at"],
            e["job_id"],
            e["step"] or "-",
            e["reason"],
            str(e["presented"]),
            str(e["current"]),
            e["worker_id"] or "-",
        ]

    async def run() -> None:
        async with Scheduler(args.url, **_client_args(args)) as sched:
            page = await sched.audit(job_id=args.job, limit=args.limit)
            items = page["items"]
            print(_table([row(e) for e in reversed(items)], header))
            newest = items[0]["id"] if items else None
            while args.follow:
                await asyncio.sleep(args.interval)
                fresh = (await sched.audit(job_id=args.job, limit=1000))["items"]
                new = [e for e in fresh if newest is None or _after(e["id"], newest)]
                for e in reversed(new):
                    print("  ".join(row(e)), flush=True)
                if new:
                    newest = new[0]["id"]

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return EXIT_OK


def _after(a: str, b: str) -> bool:
    return tuple(map(int, a.split("-"))) > tuple(map(int, b.split("-")))


def _tenant(value: str) -> str:
    if not NAME_RE.fullmatch(value):
        raise argparse.ArgumentTypeError(f"tenant must match {NAME_RE.pattern}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fencegate", description="A fencing-token gateway for side effects."
    )
    parser.add_argument("--version", action="version", version=f"fencegate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", help="TOML config file")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--redis-url", help="external Redis; empty: embedded durable redis-server")
    serve.add_argument(
        "--allow-volatile-redis", action="store_true", help="start even if Redis is not durable"
    )
    serve.add_argument(
        "--workers", type=int, default=1, help="processes sharing the port (SO_REUSEPORT)"
    )
    serve.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    # chaos testing only: die at a point of the effect flow
    serve.add_argument(
        "--chaos-crash-at",
        choices=["before_admit", "after_admit", "after_dispatch", "after_record"],
        help=argparse.SUPPRESS,
    )
    serve.add_argument("--chaos-crash-rate", type=float, default=1.0, help=argparse.SUPPRESS)
    serve.set_defaults(func=cmd_serve)

    init = sub.add_parser("init", help="write the durability marker")
    init.add_argument("--config")
    init.add_argument("--redis-url")
    init.add_argument(
        "--confirm-data-loss", action="store_true", help="accept that fences may have been lost"
    )
    init.set_defaults(func=cmd_init)

    check = sub.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("file")
    check.set_defaults(func=cmd_check_config)

    keys = sub.add_parser("keys", help="API keys").add_subparsers(
        dest="keys_command", required=True
    )
    new = keys.add_parser("new", help="print a fresh key and its config lines")
    new.add_argument("--role", required=True, choices=["worker", "scheduler", "auditor", "admin"])
    new.add_argument("--tenant", default="default", type=_tenant)
    new.set_defaults(func=cmd_keys_new)

    demo = sub.add_parser("demo", help="run the zombie-worker timeline end to end, locally")
    demo.set_defaults(func=cmd_demo)

    for name, helptext in (
        ("job", "show a job's fence and effects"),
        ("audit", "list rejected calls"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--url", default="http://127.0.0.1:8080", help="the gateway")
        p.add_argument("--api-key", help="scheduler/auditor key (default: $FENCEGATE_API_KEY)")
        if name == "job":
            p.add_argument("job_id")
            p.set_defaults(func=cmd_job)
        else:
            p.add_argument(
                "action",
                nargs="?",
                choices=["verify"],
                help="verify: check the audit hash chains in Redis",
            )
            p.add_argument("--config", help="TOML config file (verify)")
            p.add_argument("--redis-url", help="Redis to verify (default: from the config)")
            p.add_argument(
                "--anchors",
                action="append",
                metavar="PATH",
                help="verify: an anchor file or gateway log with audit_anchor lines (repeatable; "
                "default: [audit] anchor_file, else <redis.data_dir>/audit-anchors.jsonl)",
            )
            p.add_argument("--job", help="only this job")
            p.add_argument("--limit", type=int, default=50)
            p.add_argument("--follow", action="store_true", help="keep printing new rejections")
            p.add_argument("--interval", type=float, default=1.0, help=argparse.SUPPRESS)
            p.set_defaults(func=cmd_audit)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except (ConfigError, AdapterConfigError) as exc:
        print(f"fencegate: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except redis.exceptions.ConnectionError as exc:
        print(f"fencegate: Redis unreachable: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    except FencegateError as exc:  # job / audit: the gateway's problem, as it said it
        print(f"fencegate: {exc.code}: {exc.detail}", file=sys.stderr)
        return EXIT_RUNTIME
    return code


if __name__ == "__main__":
    sys.exit(main())
