"""What the console's handlers share: its state (one :class:`Console` per process), the
session of a request, and how a page or a redirect is answered."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import aiohttp_jinja2
from aiohttp import web

from gateway.console.access import Session, Sessions
from gateway.console.chain import ChainRuns
from gateway.console.data import iso
from gateway.console.live import FeedPump, Holds, Streams
from gateway.fencing.tenancy import Tenancy
from gateway.runtime.settings import Settings
from gateway.store.consolestate import ConsoleState
from gateway.store.store import Store

__all__ = ["CONSOLE", "SESSION", "Console", "error_page", "render", "see_other", "session_of"]


@dataclass
class Console:
    """What the console's handlers share (one per process)."""

    settings: Settings
    sessions: Sessions
    pump: FeedPump
    streams: Streams
    audit_keys: list[str]
    host_allowed: Callable[[str], bool]
    store_of: Callable[[], Store]
    tenancy: Tenancy  # the downstream key of a step (the one its adapter sent)
    # counts a logged-in request's connection for its tenant (False: over its share)
    claim_connection: Callable[[web.Request, str], bool] | None = None
    exports: Holds | None = None  # exports running (console.exports_per_*)
    runs: ChainRuns | None = None
    state: ConsoleState | None = None  # revocations, login throttling (made at startup)

    @property
    def store(self) -> Store:
        return self.store_of()

    @property
    def read_only(self) -> bool:
        return self.settings.console.read_only


CONSOLE = web.AppKey("console", Console)
SESSION = web.RequestKey("console_session", Session)


def session_of(request: web.Request) -> Session:
    return request[SESSION]


def see_other(location: str) -> web.Response:
    """A 303 as a plain response: the gateway's outer middleware turns a raised HTTP
    exception into a problem document."""
    return web.Response(status=303, headers={"Location": location})


def render(
    request: web.Request, template: str, context: dict[str, Any], status: int = 200
) -> web.Response:
    """A page: the template with the console's common context (no context processors: they
    keep their state under a plain string key of the request)."""
    return aiohttp_jinja2.render_template(
        template, request, {**_context(request), **context}, status=status
    )


def error_page(request: web.Request, status: int, message: str) -> web.Response:
    return render(request, "error.html", {"status": status, "message": message}, status=status)


def _context(request: web.Request) -> dict[str, Any]:
    console = request.app[CONSOLE]
    session = request.get(SESSION)
    return {
        "session": session,
        "csrf": console.sessions.csrf(session) if isinstance(session, Session) else "",
        "open_mode": console.sessions.open,
        "read_only": console.read_only,
        "keyed": bool(console.audit_keys),
        "iso": iso,
        "static": lambda name: request.app.router["static"].url_for(filename=name),
        "request": request,
        "qs": lambda filters, **extra: urlencode(filters.query(**extra)),
    }
