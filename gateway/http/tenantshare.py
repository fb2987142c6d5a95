"""A tenant's share of the connection cap (``connections.max_per_tenant``).

The connection cap (:mod:`gateway.http.connections`) decides before any byte is read, when
nobody knows whose a connection is. A connection becomes a tenant's at its first request
that authenticates: an API key (``Authorization``) checked by the gateway's middleware
(:func:`share_refusal`), or a console login checked by the console's own middleware (which calls
:func:`claim_connection`). From then on it counts against that tenant until it closes,
whatever later requests on it carry (a connection is never re-attributed). A connection
that never authenticates counts against the global cap only; so does every connection of
an open gateway (no keys: one tenant).

At the share, the tenant's own connection idle longest (its last response written) is
closed for the new one; when every one of its connections is serving, the request that
would have made one more is answered ``429 too_many_held`` (``Retry-After``,
``limit = connections.max_per_tenant``) and its connection closed. Another tenant's
connections are never closed for it.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.core.errors import TooManyHeld, Unauthorized
from gateway.http import appkeys as K
from gateway.http.connections import GUARD
from gateway.http.problems import problem_response

__all__ = ["claim_connection", "share_refusal"]


def claim_connection(request: web.Request, tenant: str) -> bool:
    """Count the request's connection for ``tenant``; False: over its share (answer 429
    and close). Always True without a connection guard (tests' in-process servers)."""
    slot = request.config_dict.get(GUARD)
    guard = slot.guard if slot is not None else None
    if guard is None or request.transport is None:
        return True
    conn = guard.open.get(request.transport)
    return conn is None or guard.shares.claim(guard, conn, tenant)


def refusal(settings_retry: int, share: int) -> web.Response:
    response = problem_response(
        TooManyHeld(
            f"this tenant holds {share} connections (connections.max_per_tenant), each "
            "serving a request: retry when one has answered",
            limit="connections.max_per_tenant",
            retry_after=settings_retry,
        )
    )
    response.force_close()
    return response


def share_refusal(request: web.Request) -> web.Response | None:
    """Attribute the connection to the tenant of the request's API key (module docstring):
    the ``429`` to answer when that is over the tenant's share, else None. A missing or
    unknown key is the handler's to answer (401): nothing is counted. Called by the gateway's
    middleware (``gateway.http.app``) before the handler."""
    slot: Any = request.config_dict.get(GUARD)
    guard = slot.guard if slot is not None else None
    if guard is None or not guard.shares.share or request.transport is None:
        return None  # no share to count (one tenant, tests' servers)
    conn = guard.open.get(request.transport)
    if conn is None or conn.tenant is not None:
        return None  # counted at its first authenticated request
    header = request.headers.get("Authorization")
    auth = request.app[K.AUTH]
    if header is not None and not auth.open:
        try:
            tenant = auth.authenticate(header).tenant
        except Unauthorized:
            tenant = None
        if tenant is not None and not claim_connection(request, tenant):
            settings = request.app[K.SETTINGS].connections
            return refusal(settings.retry_after_seconds, guard.shares.share)
    return None
