"""The web console under ``/console``: rejections live, a job's history, steps that need a
decision, the audit chain, an overview (docs/console.md).

Server-rendered HTML (Jinja2, autoescaped), live parts over server-sent events, htmx 2 and
its SSE extension as vendored files (``static/vendor``, see ``static/VENDORED.md``). Pages
work without JavaScript. Mounted by :func:`mount` in the gateway's app factory.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from gateway.settings import Settings

__all__ = ["mount", "owns"]

_MOUNTED = web.AppKey("console_app", web.Application)


def mount(
    app: web.Application,
    settings: Settings,
    secret: Callable[[str, str], str],
    audit_keys: list[str],
) -> None:
    """Mount the console at ``/console`` unless ``[console] enabled`` is false. Its open SSE
    streams are ended first thing at shutdown (before the in-flight dispatches are drained)."""
    if not settings.console.enabled:
        return
    from gateway.console import site

    console_app = site.build(settings, app, secret, audit_keys)
    app[_MOUNTED] = console_app
    app.add_subapp(site.PREFIX, console_app)
    
    async def stop(_: web.Application) -> None:
        await site.stop(console_app)

    app.on_shutdown.insert(0, stop)


def owns(request: web.Request) -> bool:
    """Is this request the console's (which applies its own browser rules)?"""
    apps = request.match_info.apps
    return len(apps) > 1 and apps[-1] is request.config_dict.get(_MOUNTED)
