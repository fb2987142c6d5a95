"""The ``fencegate`` command: parse args → load settings → configure logging → run.

Exit codes: 0 success; 1 runtime failure (Redis or the gateway unreachable,
embedded Redis failed, a demo invariant did not hold); 2 bad usage or
configuration (the message names the key); 3 refused for safety (durability
marker missing, non-durable Redis, open gateway on a non-loopback address).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import redis

from adapters.registry import AdapterConfigError
from gateway import __version__
from gateway.cli import outputs as outputs_cli
from gateway.cli.admin import cmd_check_config, cmd_example_config, cmd_init, cmd_keys_new
from gateway.cli.common import EXIT_CONFIG, EXIT_RUNTIME
from gateway.cli.jobs import cmd_audit, cmd_job
from gateway.cli.serve import cmd_serve
from gateway.core.errors import FencegateError
from gateway.core.names import NAME, NAME_RULE
from gateway.objects import runtime_started
from gateway.runtime.settings import ConfigError

if TYPE_CHECKING:
    pass


def cmd_demo(args: argparse.Namespace) -> int:
    from gateway.cli.demo import main as demo_main

    return demo_main([])


def _tenant(value: str) -> str:
    if not NAME.fullmatch(value):
        raise argparse.ArgumentTypeError(f"tenant {NAME_RULE}")
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
        choices=[
            "before_admit",
            "after_admit",
            "after_dispatch",
            "after_record",
            "after_output_write",
            "after_presigned_copy",
        ],
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

    example = sub.add_parser(
        "example-config", help="print the annotated example config (fencegate.example.toml)"
    )
    example.add_argument(
        "--path", action="store_true", help="print the folder of the shipped example configs"
    )
    example.set_defaults(func=cmd_example_config)

    keys = sub.add_parser("keys", help="API keys").add_subparsers(
        dest="keys_command", required=True
    )
    new = keys.add_parser("new", help="print a fresh key and its config lines")
    new.add_argument("--role", required=True, choices=["worker", "scheduler", "auditor", "admin"])
    new.add_argument("--tenant", default="default", type=_tenant)
    new.add_argument(
        "--claims",
        action="store_true",
        help="a worker key that may register its jobs' generations (claims = true)",
    )
    new.set_defaults(func=cmd_keys_new)

    outputs_cli.add_parser(sub.add_parser("outputs", help="attempt-scoped job outputs"))

    demo = sub.add_parser("demo", help="run the zombie-worker timeline end to end, locally")
    demo.set_defaults(func=cmd_demo)

    for name, helptext in (
        ("job", "show a job's fence, effects, checkpoints, outputs and completion"),
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
    code = _run(argv)
    if argv is None and runtime_started():
        # the process's own command line, and it used obstore, whose Rust runtime is never
        # shut down and can abort the interpreter's finalization (SIGABRT after all the
        # work is done; gateway.objects.store.runtime_started): everything is closed and
        # written by now, so flush and leave without finalizing
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _run(argv: Sequence[str] | None) -> int:
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
