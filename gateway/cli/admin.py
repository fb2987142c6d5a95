"""Administration: ``init`` (durability markers), ``check-config``, ``example-config``,
``keys new``."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import secrets
import sys
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING

from adapters.registry import validate_configs
from gateway.cli.common import (
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_REFUSED,
    cli_redis_url,
    cli_settings,
    init_durability,
)
from gateway.fencing.tenancy import resolve_tenancy
from gateway.proxy.config import load_upstreams
from gateway.runtime.logging import configure_logging
from gateway.runtime.settings import load_settings

if TYPE_CHECKING:
    pass


def cmd_init(args: argparse.Namespace) -> int:
    settings = cli_settings(args)
    configure_logging()
    data_dir = Path(settings.redis.data_dir)
    url, embedded = cli_redis_url(settings)
    try:
        result = asyncio.run(
            init_durability(
                url,
                data_dir / "fencegate.state",
                auto=False,
                confirm=args.confirm_data_loss,
                cluster=settings.redis.cluster,
            )
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
    tenancy = resolve_tenancy(settings)  # adapters' tenants and keys: refused here as at start
    # [upstreams.*] as at start, but the credentials' variables need not be set here
    upstreams = load_upstreams(settings.upstreams, tenancy.tenants, lambda env, what: "-")
    print(
        f"{args.file}: ok ({len(settings.adapters)} adapters, {len(upstreams)} upstreams, "
        f"{len(settings.auth.keys)} keys, registration={settings.fencing.registration})"
    )
    return EXIT_OK


def cmd_example_config(args: argparse.Namespace) -> int:
    """The annotated example config shipped in the package (gateway/examples, a link to the
    repository's config/), or with --path the folder that holds it, the compose config and
    redis.conf."""
    examples = files("gateway") / "examples"
    if args.path:
        print(examples)
    else:
        sys.stdout.write((examples / "fencegate.example.toml").read_text(encoding="utf-8"))
    return EXIT_OK


def cmd_keys_new(args: argparse.Namespace) -> int:
    if args.claims and args.role != "worker":
        print(
            "fencegate: --claims is for worker keys (a scheduler registers already)",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    key = secrets.token_urlsafe(32)
    digest = hashlib.sha256(key.encode()).hexdigest()
    print(f"key (give it to the {args.role}; it is not stored anywhere):\n  {key}\n")
    print("config (add to the [auth] part of fencegate.toml):")
    print(f'[[auth.keys]]\nrole = "{args.role}"\nsha256 = "{digest}"\ntenant = "{args.tenant}"')
    if args.claims:
        print("claims = true")
    return EXIT_OK
