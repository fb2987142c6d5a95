"""The scripts' plumbing: their sources (prelude + includes + body; a plain script's includes
and body, :class:`PlainScript`), request and dispatch ids, and the client every store method
goes through (what a Redis failure means: :mod:`gateway.store.failures`)."""

from __future__ import annotations

import hashlib
import itertools
import re
import secrets
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.store.cluster import connect_cluster
from gateway.store.driver import driver_info
from gateway.store.keys import JobKeys

SCRIPT_NAMES = (
    "admit-8",
    "record-4",
    "register-2",
    "heartbeat-2",
    "check-2",
    "cancel-1",
    "reject-2",
    "resolve-6",
    "relay-6",
    "void-5",
    "checkpoint-3",
    "complete-3",
    # attempt-scoped outputs (gateway.fencing.outputs)
    "output-stage-3",
    "output-record-3",
    "reindex-2",
)
# lua/plain/: scripts without the prelude, each owned by one store module (named in its header)
PLAIN_NAMES = (
    "quota-reserve-2",
    "quota-settle-4",
    "quota-settle-checkpoint-4",
    "quota-drop-2",
    "ledger-reserve-3",
    "ledger-settle-3",
    "ledger-fix-3",
    "anchor-snapshots-2n",
    "witness-raise-2",
    "due-in-slots-1n",
    "relay-rehint-3",
)
_INCLUDE = re.compile(r'^--- @include "includes/([a-z][a-z0-9_-]*)"\s*$', re.M)


class ScriptSourceError(ValueError):
    """A script's source cannot be assembled: an unknown include, an include cycle."""


def _included(name: str, body: str, includes: Traversable) -> list[str]:
    """The includes ``body`` pulls in (``--- @include "includes/<name>"``, in the body or in an
    include), each once, in the order they must be placed: an include before whatever
    includes it. An unknown include or a cycle raises :class:`ScriptSourceError`."""
    included: list[str] = []
    placed: set[str] = set()

    def pull(text: str, chain: tuple[str, ...]) -> None:
        for wanted in _INCLUDE.findall(text):
            if wanted in chain:
                cycle = " -> ".join((*chain, wanted))
                raise ScriptSourceError(f"{name}: include cycle {cycle}")
            if wanted in placed:
                continue
            path = includes / f"{wanted}.lua"
            if not path.is_file():
                raise ScriptSourceError(f"{name}: unknown include {wanted!r} (no {path})")
            source = path.read_text(encoding="utf-8")
            pull(source, (*chain, wanted))
            placed.add(wanted)
            included.append(f"-- includes/{wanted}\n{source}")

    pull(body, ())
    return included


def lua_source(name: str, lua: Traversable | None = None) -> str:
    """The prelude (the trailer, re-send memory, the slot counter, the audit chain), the
    script's includes, then its body as a function the prelude runs.

    A line ``--- @include "includes/<name>"`` (in a body or in an include) pulls in
    ``lua/includes/<name>.lua``: every include the script needs, each once, placed after the
    prelude and before whatever includes it (an include's definitions are chunk-level
    locals, seen by everything after them). An unknown include or a cycle raises
    :class:`ScriptSourceError`: the store assembles every source when it is built, so such a
    script fails the boot."""
    lua = lua or resources.files("gateway.store") / "lua"
    prelude = (lua / "_prelude.lua").read_text(encoding="utf-8")
    body = (lua / f"{name}.lua").read_text(encoding="utf-8")
    head = "\n".join((prelude, *_included(name, body, lua / "includes")))
    return f"{head}\nreturn run_script(function()\n{body}\nend)\n"


def plain_source(name: str, plain: Traversable | None = None) -> str:
    """A plain script's source: its includes (``--- @include "includes/<name>"``, from
    ``lua/plain/includes/``, placed as :func:`lua_source` places them), then its body as the
    chunk itself. No prelude: no trailer, no re-send memory, no slot marker, no audit chain;
    a plain script keeps counters and reads, and decides nothing a fence depends on."""
    plain = plain or resources.files("gateway.store") / "lua" / "plain"
    body = (plain / f"{name}.lua").read_text(encoding="utf-8")
    return "\n".join((*_included(name, body, plain / "includes"), body))


@dataclass(frozen=True, slots=True)
class PlainScript:
    """A plain script (:func:`plain_source`), assembled when its module is imported: its name
    (``<what>-<number of KEYS>``), its source and the SHA1 it is sent by. Its owner sends it
    with ``batcher.evalsha(script.sha, script.source, keys, args)`` (EVAL on NOSCRIPT, which
    loads it again) or, off the auto-pipeline, as EVAL."""

    name: str
    source: str
    sha: str

    @classmethod
    def load(cls, name: str) -> PlainScript:
        if name not in PLAIN_NAMES:
            raise ScriptSourceError(f"{name}: not a plain script (PLAIN_NAMES)")
        source = plain_source(name)
        return cls(name, source, hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest())


def fenced_args(
    keys: JobKeys,
    generation: int,
    registration: str,
    worker_id: str,
    retention: str,
    by: str,
    unaudited: str,
) -> tuple[str, str, str, str, str, str, str, str]:
    """ARGV[1..8] of every fenced script, in the order ``includes/fence`` reads them
    (``fenced_call``): the script's own arguments follow. ``registration``: 'required' |
    'implicit'; ``by``: who calls ('' when not given); ``unaudited``: '1' when the tenant's
    audited rejections are used up, else ''."""
    return (
        str(generation),
        registration,
        keys.job_id,
        keys.tenant,
        worker_id,
        retention,
        by,
        unaudited,
    )


# Dispatch ids only have to be unique (they never leave the gateway: the admit hands one
# out, the record must present it): a random 64-bit prefix per process and a counter,
# instead of a getrandom() system call per admit.
_DISPATCH_PREFIX = secrets.token_hex(8)
_dispatch_counter = itertools.count()


def new_dispatch_id() -> str:
    """A dispatch id (also a script call's request id): unique among every process's ids."""
    return f"{_DISPATCH_PREFIX}{next(_dispatch_counter):x}"


new_request_id = new_dispatch_id


MARKER_MISSING = (
    "Redis has lost fencegate's data (the durability marker of this job's slot is "
    "missing): fences may be gone, so nothing is dispatched. An operator must run "
    "`fencegate init --confirm-data-loss` and re-register current generations."
)
UNINITIALISED = (
    "this Redis has no fencegate durability marker and the gateway does not initialise an "
    "external Redis on its own: if it is new, run `fencegate init --config <this config>` once "
    "(it refuses when this Redis or data dir held fencegate data before); if it was wiped or "
    "replaced, fences may be gone: `fencegate init --confirm-data-loss`, then re-register "
    "current generations. Nothing is dispatched until then."
)


def connect(
    url: str, *, timeout: float, max_connections: int, cluster: bool = False
) -> aioredis.Redis:
    """A redis-py client with one shared pool (``cluster``: redis-py's ``RedisCluster`` for the
    seeds in ``url``, see :mod:`gateway.store.cluster`; it serves the same commands).

    Only connection errors are retried (twice, quickly): a command that timed
    out may have run, so it is never re-sent blindly; admit and record are safe
    to re-run with the same dispatch id when a reset connection lost the reply.
    """
    if cluster:
        client = connect_cluster(url, timeout=timeout, max_connections=max_connections)
        return client  # type: ignore[return-value]  # the same command API
    retry = Retry(ExponentialBackoff(cap=0.2, base=0.01), 2, (RedisConnectionError,))
    # A blocking pool: under a burst, requests wait (up to `timeout`) for a
    # connection instead of failing with "Too many connections".
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        decode_responses=True,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        max_connections=max_connections,
        timeout=timeout,
        retry=retry,
        health_check_interval=0,
        driver_info=driver_info(),
    )
    return aioredis.Redis.from_pool(pool)  # the client owns and closes the pool
