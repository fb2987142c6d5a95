"""Target-side fencing for teams that own their downstream service.

fencegate sends ``Fencing-Token: <generation>`` with every webhook. A
downstream that keeps the highest token it has seen per resource and refuses
lower ones is fenced *by itself* — even against a caller that bypasses the
gateway, or a write that was admitted before a takeover and arrives late::

    keeper = MemoryFenceKeeper()           # one process; RedisFenceKeeper for many
    fence = fencing_middleware(keeper, resource=lambda r: r.match_info["order"])
    app = web.Application(middlewares=[fence])

    # or, without aiohttp:
    if not await keeper.admit("order-7", token):
        ...  # refuse: a newer generation already wrote here

When to use which: **idempotency keys** (what every adapter sends) make a
*repeat of the same step* harmless; they do nothing against a *different*
write from an old generation (a stale "set status = shipped" after the new
worker set "cancelled"). **Fencing tokens** checked at the target stop those,
but only a downstream you control can check them. Use both where you can.

Check and write must be one step, or the gap reopens (token 38 admitted, then
40 admitted and written, then 38 written over it). The middleware therefore
holds a per-resource lock from the check until the handler returns, which
makes it exact within one process. Across processes, the handler's write must
itself be conditional — store the token with the data and update
``WHERE token <= :token``, or do the write inside the keeper's Redis script.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Protocol

import redis.asyncio as aioredis
from aiohttp import web

from gateway.core.errors import InvalidRequest, StaleGeneration
from gateway.core.tokens import parse_unsigned_token

__all__ = ["FenceKeeper", "MemoryFenceKeeper", "RedisFenceKeeper", "fencing_middleware"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class FenceKeeper(Protocol):
    async def admit(self, resource: str, token: int) -> bool:
        """Atomically: if ``token`` >= the highest seen for ``resource``, record it; True if so."""

    async def highest(self, resource: str) -> int: ...


class MemoryFenceKeeper:
    """Highest token per resource in this process (a lock makes check-and-set atomic)."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}
        self._lock = asyncio.Lock()

    async def admit(self, resource: str, token: int) -> bool:
        async with self._lock:
            if token < self._seen.get(resource, 0):
                return False
            self._seen[resource] = token
            return True

    async def highest(self, resource: str) -> int:
        return self._seen.get(resource, 0)


_ADMIT_LUA = """
local seen = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) < seen then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""


class RedisFenceKeeper:
    """Highest token per resource in Redis, compared and set in one Lua script."""

    def __init__(self, client: aioredis.Redis, prefix: str = "fence:") -> None:
        self._client = client
        self._prefix = prefix
        self._script = client.register_script(_ADMIT_LUA)

    async def admit(self, resource: str, token: int) -> bool:
        return bool(await self._script(keys=[self._prefix + resource], args=[str(token)]))

    async def highest(self, resource: str) -> int:
        raw = await self._client.get(self._prefix + resource)
        return int(raw or 0)


def _problem(err: InvalidRequest | StaleGeneration) -> web.Response:
    return web.Response(
        body=json.dumps(err.problem()),
        status=err.http_status,
        content_type="application/problem+json",
    )


def fencing_middleware(
    keeper: FenceKeeper,
    resource: Callable[[web.Request], str],
    *,
    methods: frozenset[str] = frozenset({"POST", "PUT", "PATCH", "DELETE"}),
    required: bool = True,
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """aiohttp middleware: refuse writes whose ``Fencing-Token`` is below the resource's highest."""

    locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}  # resource -> (lock, [users])

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method not in methods:
            return await handler(request)
        raw = request.headers.get("Fencing-Token")
        if raw is None and not required:
            return await handler(request)
        try:
            token = parse_unsigned_token(raw)
        except InvalidRequest as err:
            return _problem(err)
        key = resource(request)
        lock, users = locks.setdefault(key, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:  # check and write as one step (in this process)
                return await _admit_and_handle(keeper, key, token, request, handler)
        finally:
            users[0] -= 1
            if not users[0]:  # bounded memory: forget idle resources
                locks.pop(key, None)

    return middleware


async def _admit_and_handle(
    keeper: FenceKeeper, key: str, token: int, request: web.Request, handler: Handler
) -> web.StreamResponse:
    if not await keeper.admit(key, token):
        current = await keeper.highest(key)
        return _problem(
            StaleGeneration(
                f"token {token} is below the highest seen for {key} ({current})",
                presented=token,
                current=current,
            )
        )
    return await handler(request)
