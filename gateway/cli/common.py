"""Helpers every command group shares: settings from the arguments, a short-lived store, the
Redis a command talks to, table output."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis
import structlog

from gateway.runtime.settings import Settings, load_settings
from gateway.store.embedded import EmbeddedRedis, socket_of

if TYPE_CHECKING:
    from gateway.store.store import Store

EXIT_OK, EXIT_RUNTIME, EXIT_CONFIG, EXIT_REFUSED = 0, 1, 2, 3

log = structlog.get_logger("fencegate")


def cli_settings(args: argparse.Namespace) -> Settings:
    return load_settings(
        args.config,
        server={"host": getattr(args, "host", None), "port": getattr(args, "port", None)},
        redis={
            "url": getattr(args, "redis_url", None),
            "allow_volatile": True if getattr(args, "allow_volatile_redis", False) else None,
        },
    )


@contextlib.asynccontextmanager
async def cli_store(
    url: str, state_file: Path | None = None, *, cluster: bool = False
) -> AsyncIterator[Store]:
    """A short-lived store for CLI commands (init, audit verify, the workers' supervisor)."""
    from gateway.store.store import Store, connect

    client = connect(url, timeout=10, max_connections=2, cluster=cluster)
    store = Store(
        client,
        registration="required",
        dispatch_timeout_ms=1,
        retention_seconds=60,
        state_file=state_file,
    )
    try:
        yield store
    finally:
        await store.aclose()
        await client.aclose()


async def init_durability(
    url: str,
    state_file: Path,
    *,
    auto: bool,
    confirm: bool = False,
    write: bool = True,
    cluster: bool = False,
) -> str:
    async with cli_store(url, state_file, cluster=cluster) as store:
        return await store.initialize(auto=auto, confirm_data_loss=confirm, write=write)


def cli_redis_url(settings: Settings) -> tuple[str, EmbeddedRedis | None]:
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


def client_args(args: argparse.Namespace) -> dict[str, Any]:
    return {"api_key": args.api_key or os.environ.get("FENCEGATE_API_KEY") or None}


def render_table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip()
        for r in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
