"""Bulkheads: one bounded HTTP connection pool per adapter, and per tenant of an adapter.

A slow downstream of one tenant fills only its own pool: another tenant's sends (or
another adapter's) never wait behind it. A send that waits for a connection longer than
``bulkheads.pool_wait_seconds`` (or the step's deadline) never left the gateway: it is
classified known-not-delivered (``released``), never ``unknown``
(:func:`adapters.http.request` tells the two apart with :func:`adapters.http.send_trace`).

Adapters keep their interface: each gets an :class:`HttpPools` where an
``aiohttp.ClientSession`` was, and :class:`TenantScoped` around it names the tenant of
each dispatch (a context variable read by :meth:`HttpPools.request`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any, cast

import aiohttp
from aiohttp.abc import AbstractResolver

from adapters.base import Adapter, Delivered, EffectRequest, NotDelivered, Outcome
from adapters.http import send_trace
from gateway.runtime.settings import BulkheadSettings

__all__ = ["HttpPools", "TenantScoped", "scope_adapters"]

_TENANT: ContextVar[str] = ContextVar("fencegate_pool_tenant", default="")


class HttpPools:
    """Stands in for one adapter's ``aiohttp.ClientSession``: a bounded session per tenant."""

    def __init__(
        self,
        adapter: str,
        settings: BulkheadSettings,
        *,
        resolver: Callable[[], AbstractResolver] | None = None,
    ) -> None:
        self.adapter = adapter
        self._settings = settings
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        # each pool's own resolver (gateway.proxy: one that refuses private addresses)
        self._resolver = resolver

    def session(self, tenant: str = "") -> aiohttp.ClientSession:
        key = tenant if self._settings.per_tenant else ""
        session = self._sessions.get(key)
        if session is None or session.closed:
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._settings.connections_per_pool,
                    limit_per_host=0,
                    resolver=self._resolver() if self._resolver is not None else None,
                ),
                auto_decompress=True,
                trace_configs=[send_trace()],
            )
            self._sessions[key] = session
        return session

    def request(self, method: str, url: Any, **kwargs: Any) -> Any:
        """``ClientSession.request`` on the current tenant's pool, waiting for a connection
        at most ``pool_wait_seconds`` (within the request's own timeout)."""
        timeout = kwargs.get("timeout")
        wait = self._settings.pool_wait_seconds
        if isinstance(timeout, aiohttp.ClientTimeout):
            connect = wait if timeout.connect is None else min(wait, timeout.connect)
            kwargs["timeout"] = aiohttp.ClientTimeout(
                total=timeout.total,
                connect=connect,
                sock_read=timeout.sock_read,
                sock_connect=timeout.sock_connect,
                ceil_threshold=timeout.ceil_threshold,
            )
        else:
            kwargs["timeout"] = aiohttp.ClientTimeout(connect=wait)
        return self.session(_TENANT.get()).request(method, url, **kwargs)

    @property
    def pools(self) -> Mapping[str, aiohttp.ClientSession]:
        return self._sessions

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()


class TenantScoped:
    """An adapter whose dispatches and lookups run on their tenant's pool."""

    def __init__(self, inner: Adapter) -> None:
        self.inner = inner
        self.name = inner.name
        self.capabilities = inner.capabilities

    def validate(self, operation: str, payload: Mapping[str, Any]) -> None:
        self.inner.validate(operation, payload)

    async def dispatch(self, request: EffectRequest) -> Outcome:
        _TENANT.set(request.tenant)  # this dispatch's own task: its context only
        return await self.inner.dispatch(request)

    async def lookup(self, request: EffectRequest) -> Delivered | NotDelivered | None:
        _TENANT.set(request.tenant)
        return await self.inner.lookup(request)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def __getattr__(self, name: str) -> Any:  # anything else an adapter offers
        return getattr(self.inner, name)


def scope_adapters(adapters: Mapping[str, Adapter]) -> dict[str, Adapter]:
    return {name: cast(Adapter, TenantScoped(adapter)) for name, adapter in adapters.items()}
