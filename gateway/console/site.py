"""The console application: its middleware (browser rules, login, HTML errors), login and
logout, static files, and how it is mounted under ``/console`` of the gateway."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp_jinja2
import jinja2
import structlog
from aiohttp import web

from gateway.console import feed_pages, job_pages  # the route handlers
from gateway.console.access import Keys, Session, Sessions, console_secret, cookie_name
from gateway.console.chain import ChainRuns
from gateway.console.context import (
    CONSOLE,
    SESSION,
    Console,
    error_page,
    render,
    see_other,
    session_of,
)
from gateway.console.data import BadFilter
from gateway.console.guard import Refused, check_request, security_headers
from gateway.console.live import FeedPump, Holds, Streams
from gateway.core.errors import FencegateError, StoreUnavailable
from gateway.fencing.tenancy import resolve_tenancy
from gateway.runtime.settings import Settings
from gateway.store.anchors import anchor_path
from gateway.store.store import Store

__all__ = ["PREFIX", "build", "stop"]

log = structlog.get_logger("fencegate.console")
HERE = Path(__file__).parent
PREFIX = "/console"
_PUBLIC = ("/console/login", "/console/static/")


def _safe_next(value: str | None) -> str:
    """Only a path of the console itself (never ``//host`` or a scheme)."""
    if value and value.startswith(PREFIX) and not value.startswith("//") and "\\" not in value:
        return value
    return PREFIX


@web.middleware
async def console_middleware(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    console = request.app[CONSOLE]
    if request.path == PREFIX:
        return see_other(f"{PREFIX}/")
    try:
        check_request(request, console.host_allowed, console.settings.server.allowed_origins)
    except Refused as exc:
        return error_page(request, exc.status, exc.why)
    sessions = console.sessions
    if sessions.open:
        request[SESSION] = sessions.open_session()
    else:
        try:
            session = await _live_session(console, request)
        except (StoreUnavailable, OSError, TimeoutError) as exc:
            log.warning("console_redis_failed", path=request.path, detail=str(exc))
            return error_page(request, 503, "Redis is not answering; try again shortly")
        if session is not None:
            request[SESSION] = session
            claim = console.claim_connection
            if claim is not None and not claim(request, session.tenant):
                page = error_page(request, 429, "this tenant holds all its connections; retry")
                page.headers["Retry-After"] = str(console.settings.connections.retry_after_seconds)
                page.force_close()
                return page
        elif not request.path.startswith(_PUBLIC):
            if request.headers.get("Accept") == "text/event-stream":
                return error_page(request, 401, "log in again")
            target = request.path_qs if request.method == "GET" else PREFIX
            return see_other(f"{PREFIX}/login?next={quote(target, safe='')}")
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPRedirection as exc:
        return see_other(exc.headers.get("Location", PREFIX))
    except web.HTTPException as exc:
        return error_page(request, exc.status, exc.text or exc.reason)
    except BadFilter as exc:
        return error_page(request, 400, str(exc))
    except FencegateError as exc:
        if isinstance(exc, StoreUnavailable):
            log.warning("console_redis_failed", path=request.path, detail=exc.detail)
        page = error_page(request, exc.http_status, exc.detail)
        if (retry := exc.fields.get("retry_after")) is not None:
            page.headers["Retry-After"] = str(retry)
        return page
    except (OSError, TimeoutError) as exc:
        log.warning("console_redis_failed", path=request.path, detail=str(exc))
        return error_page(request, 503, "Redis is not answering; try again shortly")


async def _live_session(console: Console, request: web.Request) -> Session | None:
    """The request's session: a cookie signed here, unexpired, whose key is configured, and
    not logged out (one Redis read)."""
    session = console.sessions.check(request.cookies.get(cookie_name(_secure(request))))
    if session is None:
        return None
    assert console.state is not None
    if await console.state.revoked(session.nonce):
        return None
    return session


def _secure(request: web.Request) -> bool:
    """Do browsers reach the console over HTTPS: this connection is TLS, or the config says a
    TLS-terminating proxy is in front (``[console] https``)."""
    return request.secure or request.app[CONSOLE].settings.console.https


def _peer(request: web.Request) -> str:
    return request.remote or "-"


async def login_form(request: web.Request) -> web.Response:
    console = request.app[CONSOLE]
    if console.sessions.open or SESSION in request:
        return see_other(_safe_next(request.query.get("next")))
    return render(request, "login.html", {"next": _safe_next(request.query.get("next"))})


async def login(request: web.Request) -> web.Response:
    """Log in with an auditor or admin key. Failed logins are throttled per peer and for all
    peers together (``[console] login_failures_*``, counted in Redis): past a limit, 429 with
    ``Retry-After`` until the window ends, whatever the key. The log has one line for the
    first failure of a peer in a window and one when a limit is reached, not one per try."""
    console = request.app[CONSOLE]
    form = await request.post()
    target = _safe_next(str(form.get("next") or ""))
    if console.sessions.open:
        return see_other(target)
    limits = console.settings.console
    assert console.state is not None
    peer = _peer(request)
    try:
        wait = await console.state.wait_seconds(
            peer, per_peer=limits.login_failures_per_peer, total=limits.login_failures_total
        )
        if wait:
            response = render(
                request,
                "login.html",
                {"next": target, "failed": f"Too many failed logins; try again in {wait} s."},
                status=429,
            )
            response.headers["Retry-After"] = str(wait)
            return response
        found = console.sessions.login(str(form.get("key") or ""))
        if found is None:
            failures = await console.state.failed(peer)
    except (StoreUnavailable, OSError, TimeoutError) as exc:
        log.warning("console_redis_failed", path=request.path, detail=str(exc))
        return error_page(request, 503, "Redis is not answering; try again shortly")
    if found is None:
        if failures.peer == 1 or failures.peer == limits.login_failures_per_peer:
            log.info(
                "console_login_refused",
                remote=peer,
                peer_failures=failures.peer,
                all_failures=failures.total,
                window_seconds=limits.login_window_seconds,
                throttled=failures.peer >= limits.login_failures_per_peer > 0,
            )
        if failures.total == limits.login_failures_total:
            log.warning(
                "console_logins_throttled",
                all_failures=failures.total,
                window_seconds=limits.login_window_seconds,
            )
        return render(
            request,
            "login.html",
            {"next": target, "failed": "Not a key of role auditor or admin."},
            status=401,
        )
    session, cookie = found
    log.info("console_login", tenant=session.tenant, role=session.role, key_name=session.name)
    # the proof of login travels in the fragment: the browser keeps it, no server sees it
    response = see_other(f"{target}#fg-proof={console.sessions.proof(session)}")
    secure = _secure(request)
    response.set_cookie(
        cookie_name(secure),
        cookie,
        max_age=console.sessions.ttl,
        path="/" if secure else PREFIX,
        httponly=True,
        samesite="Strict",
        secure=secure,
    )
    return response


async def logout(request: web.Request) -> web.Response:
    """End the session here and everywhere: its id is recorded as revoked in Redis for what
    is left of the cookie's life. A CSRF token is enough (no proof of login): whoever holds
    the cookie may end it."""
    console = request.app[CONSOLE]
    session = session_of(request)
    form = await request.post()
    if not console.sessions.csrf_ok(session, str(form.get("csrf") or "")):
        return error_page(request, 403, "the form's CSRF token does not match; reload the page")
    if not session.open:
        assert console.state is not None
        await console.state.revoke(session.nonce, session.expires - int(time.time()) + 1)
        log.info("console_logout", tenant=session.tenant, role=session.role, key_name=session.name)
    response = see_other(f"{PREFIX}/login")
    secure = _secure(request)
    response.del_cookie(
        cookie_name(secure),
        path="/" if secure else PREFIX,
        httponly=True,
        samesite="Strict",
        secure=secure,
    )
    return response


def build(
    settings: Settings,
    *,
    secret: Callable[[str, str], str],
    audit_keys: list[str],
    keys: Keys,
    host_allowed: Callable[[str], bool],
    store: Callable[[], Store],
    claim_connection: Callable[[web.Request, str], bool] | None = None,
) -> web.Application:
    """The console sub-application (mounted by :func:`gateway.console.mount`)."""
    app = web.Application(middlewares=[console_middleware])
    if settings.redis.url and settings.auth.keys and not settings.console.secret_env:
        # the config cannot say how many hosts share this Redis: say what a second one means
        log.warning(
            "console_secret_per_host",
            detail="[console] secret_env is unset: this host signs console logins with its own "
            "secret (<redis.data_dir>/console.secret); behind one name, several hosts must "
            "share a secret_env, or a login holds on the host that made it only",
        )
    console = Console(
        settings=settings,
        sessions=Sessions(
            console_secret(settings, secret), keys, settings.console.cookie_ttl_seconds
        ),
        pump=FeedPump(lambda: store().console_reads, settings.console.poll_seconds),
        streams=Streams(
            settings.console.sse_ping_seconds,
            per_session=settings.console.sse_per_session,
            per_tenant=settings.console.sse_per_tenant,
        ),
        audit_keys=audit_keys,
        host_allowed=host_allowed,
        store_of=store,
        tenancy=resolve_tenancy(settings),
        claim_connection=claim_connection,
        exports=Holds(
            "exports",
            {
                "exports_per_session": settings.console.exports_per_session,
                "exports_per_tenant": settings.console.exports_per_tenant,
            },
        ),
    )
    app[CONSOLE] = console
    aiohttp_jinja2.setup(
        app,
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    app.on_response_prepare.append(security_headers)
    app.router.add_static("/static/", HERE / "static", name="static", append_version=True)
    app.router.add_get("/login", login_form)
    app.router.add_post("/login", login)
    app.router.add_post("/logout", logout)
    feed_pages.add_routes(app)
    job_pages.add_routes(app)

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        # the store is made by the gateway's startup, which runs first
        console.state = store().console_state(window_seconds=settings.console.login_window_seconds)
        console.runs = ChainRuns(
            store().console_reads,
            keys=audit_keys,
            anchor_file=anchor_path(settings),
            retention_seconds=settings.fencing.retention_seconds,
            record=lambda tenant, summary: store().record_chain_check(tenant, summary),
            interval_seconds=settings.console.chain_check_interval_seconds,
            max_entries=settings.console.chain_check_max_entries,
        )
        yield
        await stop(app)

    app.cleanup_ctx.append(lifetime)
    return app


async def stop(app: web.Application) -> None:
    """End every open stream, the feed reader and chain checks (first thing at shutdown)."""
    console = app[CONSOLE]
    await console.streams.close_all()
    await console.pump.aclose()
    if console.runs is not None:
        await console.runs.aclose()
