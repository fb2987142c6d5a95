"""The web console under ``/console``: rejections live, a job's history, steps that need a
decision, the audit chain, an overview (docs/console.md).

Server-rendered HTML (Jinja2, autoescaped), live parts over server-sent events, htmx 2 and
its SSE extension as vendored files (``static/vendor``, see ``static/VENDORED.md``). Pages
work without JavaScript. The gateway's app factory mounts it with :func:`mount`, passing
what it needs from the HTTP layer (the keys, the Host rule, the store), so this package
imports nothing from ``gateway.http``: both sit at the same level.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from gateway.console import site
from gateway.console.access import Keys
from gateway.console.context import CONSOLE
from gateway.runtime.settings import Settings
from gateway.store.store import Store

__all__ = ["mount", "owns", "state"]

_MOUNTED = web.AppKey("console_app", web.Application)


def mount(
    app: web.Application,
    settings: Settings,
    *,
    secret: Callable[[str, str], str],
    audit_keys: list[str],
    keys: Keys,
    host_allowed: Callable[[str], bool],
    store: Callable[[], Store],
    claim_connection: Callable[[web.Request, str], bool] | None = None,
) -> None:
    """Mount the console at ``/console`` unless ``[console] enabled`` is false. Its open SSE
    streams are ended first thing at shutdown (before the in-flight dispatches are drained).
    ``claim_connection(request, tenant)`` counts a logged-in request's connection for its
    tenant (False: over ``connections.max_per_tenant``, gateway.http.tenantshare)."""
    if not settings.console.enabled:
        return
    console_app = site.build(
        settings,
        secret=secret,
        audit_keys=audit_keys,
        keys=keys,
        host_allowed=host_allowed,
        store=store,
        claim_connection=claim_connection,
    )
    app[_MOUNTED] = console_app
    app.add_subapp(site.PREFIX, console_app)

    async def stop(_: web.Application) -> None:
        await site.stop(console_app)

    app.on_shutdown.insert(0, stop)


def owns(request: web.Request) -> bool:
    """Is this request the console's (which applies its own browser rules)? On the API's hot
    path this is one string prefix test."""
    if not request.raw_path.startswith("/console"):
        return False
    apps = request.match_info.apps
    return len(apps) > 1 and apps[-1] is request.config_dict.get(_MOUNTED)


def state(app: web.Application) -> Any:
    """The mounted console's shared state (:class:`gateway.console.context.Console`), for tests."""
    return app[_MOUNTED][CONSOLE]
