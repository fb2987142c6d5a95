"""Connection hygiene of ``fencegate serve``: a cap on open connections, header, idle and body
deadlines, the file-descriptor limit, and log lines that stay JSON under any flood.

* **Cap** (``connections.max``, kept below the file-descriptor limit, whose soft value is
  raised to the hard one at start). At the cap, the connection idle longest (nothing sent
  since it opened or since its last response was written), else the oldest still sending a
  head, is closed for the new one. A connection serves from the moment its head is complete
  (its blank line arrived, before the handler runs) until its response is written; then it
  is idle again. When every one is serving, the new one gets ``503`` with ``Retry-After``.
  A request pipelined behind another, already read by aiohttp when the first response is
  written, keeps its connection serving (it is answered next, never evicted unanswered).
* **Header and idle deadline** (``connections.idle_timeout_seconds``): aiohttp's keep-alive
  timer, also from the moment a connection opens (a complete head by then, or closed).
* **Body deadline** (``connections.body_timeout_seconds``): else ``408 request_timeout``.
* **Logs**: the standard library's loggers (aiohttp's server and access loggers, asyncio)
  go through structlog as JSON lines, at most ``connections.log_lines_per_second``; the rest
  are counted and reported in the next line (``suppressed``). No raw traceback reaches stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import structlog
from aiohttp import web
from aiohttp.web_runner import GracefulExit

from gateway.core.errors import RequestTimeout
from gateway.http import appkeys as K
from gateway.http.hotlane import hot_lane_of
from gateway.http.problems import problem_response
from gateway.runtime.exitbound import ExitBound
from gateway.runtime.settings import ConnectionSettings

__all__ = [
    "GUARD",
    "ConnectionGuard",
    "GuardSlot",
    "RequestTimeout",
    "TenantShares",
    "body_refusal",
    "bridge_stdlib_logging",
    "guard_of",
    "raise_fd_limit",
    "run_app",
    "serving",
    "share_of",
    "write_response",
]

log = structlog.get_logger("fencegate.connections")

FD_RESERVE = 256  # descriptors kept for Redis, the adapters' pools, files, the log


def raise_fd_limit() -> int:
    """Raise the soft limit on open files to the hard limit; returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft


_HEAD_END = b"\r\n\r\n"


class _Conn(asyncio.Protocol):
    """One client connection: aiohttp's protocol behind a gate that counts and evicts."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard
        self.inner: Any = None
        self.transport: asyncio.Transport | None = None
        self.opened = time.monotonic()
        self.busy = False  # serving a request: its head is complete, its response not written
        self.tenant: str | None = None  # whose, from its first authenticated request
        self.tail = b""  # the last bytes of a head that is still arriving (a split blank line)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        if not self.guard.admit(self):
            return
        self.inner = self.guard.server()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.busy:
            seen = self.tail + data
            if _HEAD_END in seen:
                self.tail = b""
                self.guard.started(self)
            else:
                self.tail = seen[-3:]
                self.guard.spoke(self)
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.release(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)


def share_of(max_per_tenant: int, cap: int, tenants: int) -> int:
    """The share in force: the configured one (at most the cap), else half the cap when the
    deployment has several tenants; 0: no share."""
    if max_per_tenant:
        return min(max_per_tenant, cap)
    return max(1, cap // 2) if tenants > 1 else 0


class TenantShares:
    """Connections by tenant, oldest first (the guard owns the connections themselves)."""

    def __init__(self, share: int) -> None:
        self.share = share
        self.held: dict[str, dict[_Conn, None]] = {}
        self.refused = 0

    def claim(self, guard: ConnectionGuard, conn: _Conn, tenant: str) -> bool:
        """Count ``conn`` for ``tenant`` (idempotent); False: over the share, nothing idle of
        the tenant's to close."""
        if not self.share or conn.tenant is not None:
            return True
        held = self.held.setdefault(tenant, {})
        if len(held) >= self.share and not self._close_idle(guard, held):
            self.refused += 1
            return False
        held[conn] = None
        conn.tenant = tenant
        return True

    def _close_idle(self, guard: ConnectionGuard, held: dict[_Conn, None]) -> bool:
        for other in held:
            transport = other.transport
            if other in guard.idle and transport is not None:
                if transport.get_write_buffer_size() > 0:
                    continue
                guard.release(other)
                transport.abort()
                guard.evicted += 1
                return True
        return False

    def release(self, conn: _Conn) -> None:
        if conn.tenant is not None and (held := self.held.get(conn.tenant)) is not None:
            held.pop(conn, None)
            if not held:
                del self.held[conn.tenant]


class ConnectionGuard:
    """Counts connections; at the cap evicts the one idle longest (else the oldest still
    sending its head), never one serving a request; else refuses the new one with a 503."""

    def __init__(
        self, server: Callable[[], Any], settings: ConnectionSettings, cap: int, share: int = 0
    ) -> None:
        self.server = server
        self.cap = cap
        self.shares = TenantShares(share)  # connections.max_per_tenant (gateway.http.tenantshare)
        self.open: dict[asyncio.Transport, _Conn] = {}
        # not serving, oldest first: idle (nothing sent since open or the last response) /
        # sending a request head
        self.idle: dict[_Conn, None] = {}
        self.partial: dict[_Conn, None] = {}
        self.refused = self.evicted = 0
        self._reported = 0.0
        body = json.dumps(
            {
                "type": "https://fencegate.dev/problems/too_many_connections",
                "title": "Too many connections",
                "status": 503,
                "detail": "the gateway is at its connection cap; retry shortly",
                "code": "too_many_connections",
            }
        ).encode()
        self._refusal = (
            b"HTTP/1.1 503 Service Unavailable\r\n"
            b"Content-Type: application/problem+json\r\n"
            + f"Retry-After: {settings.retry_after_seconds}\r\n".encode()
            + b"Connection: close\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )

    def factory(self) -> _Conn:
        return _Conn(self)

    def admit(self, conn: _Conn) -> bool:
        assert conn.transport is not None
        if len(self.open) >= self.cap and not self._evict():
            self.refused += 1
            conn.transport.write(self._refusal)
            conn.transport.close()
            self._report()
            return False
        self.open[conn.transport] = conn
        self.idle[conn] = None
        return True

    def _evict(self) -> bool:
        """Close the one idle longest, else the oldest sending a head; never one serving,
        nor one whose response is still in the socket's write buffer."""
        for queue in (self.idle, self.partial):
            for conn in queue:
                transport = conn.transport
                if transport is not None and transport.get_write_buffer_size() > 0:
                    continue
                queue.pop(conn)
                self.evicted += 1
                if transport is not None:
                    self.open.pop(transport, None)
                    transport.abort()
                self._report()
                return True
        return False

    def spoke(self, conn: _Conn) -> None:
        """Bytes of a request head that is not complete yet."""
        if self.idle.pop(conn, 0) is None:
            self.partial[conn] = None

    def started(self, conn: _Conn) -> None:
        """A complete request head: the connection serves until :meth:`finished`."""
        conn.busy = True
        self.idle.pop(conn, None)
        self.partial.pop(conn, None)

    def finished(self, transport: Any) -> None:
        """The response of the connection's request is written: idle again (the newest),
        unless aiohttp holds a request pipelined behind it (``_messages``): that one serves."""
        conn = self.open.get(transport)
        if conn is not None and conn.busy and not getattr(conn.inner, "_messages", None):
            conn.busy = False
            conn.tail = b""
            self.idle[conn] = None

    def serving(self, transport: Any) -> None:
        """A request reached the middleware (its head may have ended in a bare LF)."""
        if (conn := self.open.get(transport)) is not None and not conn.busy:
            self.started(conn)

    def release(self, conn: _Conn) -> None:
        self.shares.release(conn)
        self.idle.pop(conn, None)
        self.partial.pop(conn, None)
        if conn.transport is not None:
            self.open.pop(conn.transport, None)

    def _report(self) -> None:
        now = time.monotonic()
        if now - self._reported >= 1.0:
            self._reported = now
            log.warning(
                "connection_cap_reached",
                cap=self.cap,
                open=len(self.open),
                refused_total=self.refused,
                evicted_idle_total=self.evicted,
            )


class GuardSlot:
    """Where ``run_app`` puts the guard (the app is frozen by then; tests run without one)."""

    guard: ConnectionGuard | None = None


GUARD = web.AppKey("connection_guard", GuardSlot)


def guard_of(request: web.Request) -> ConnectionGuard | None:
    """The connection guard serving this request (None: tests' in-process servers)."""
    slot = request.app.get(GUARD)
    return slot.guard if slot is not None else None


async def write_response(request: web.Request, response: web.StreamResponse) -> None:
    """Write the response now, while the connection still serves (the two calls aiohttp makes
    after the handler then do nothing)."""
    with contextlib.suppress(ConnectionError):  # aiohttp's own write sees it again
        await response.prepare(request)
        await response.write_eof()


@web.middleware
async def serving(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The guard's part of the gateway's middleware (``gateway.http.app``), on its own: the
    connection serves until its response is written here, then it is idle again."""
    guard = guard_of(request)
    if guard is None:
        return await handler(request)
    transport = request.transport
    guard.serving(transport)
    try:
        response = await handler(request)
        await write_response(request, response)
        return response
    finally:
        guard.finished(transport)


async def body_refusal(request: web.Request, seconds: float) -> web.StreamResponse | None:
    """The body deadline: the whole body within ``seconds``, else this ``408`` (its connection
    closes); None: the handler may run. A body that arrived with its head (the parser has
    seen its end) is not timed."""
    if request.content.is_eof():
        return None  # no body, or all of it arrived: nothing to time
    limit = request.app[K.SETTINGS].server.max_body_bytes
    length = request.content_length
    streams = getattr(request.match_info.handler, "streams_body", False)  # outputs
    if request.body_exists and not streams and (length is None or length <= limit):
        try:
            async with asyncio.timeout(seconds):
                await request.read()  # cached: the handler's read() gets the same bytes
        except TimeoutError:
            response = problem_response(
                RequestTimeout(f"the request body did not arrive within {seconds:g} s")
            )
            response.force_close()
            return response
        except web.HTTPRequestEntityTooLarge:
            pass  # the handler reads again and answers 413
    return None


class _JsonBridge(logging.Handler):
    """Standard-library log records as structlog JSON lines, rate-limited."""

    def __init__(self, per_second: float) -> None:
        super().__init__(logging.INFO)
        self.rate = per_second
        self.tokens = per_second
        self.stamp = time.monotonic()
        self.suppressed = 0
        self.log = structlog.get_logger("fencegate.stdlib")

    def emit(self, record: logging.LogRecord) -> None:
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            self.suppressed += 1
            return
        self.tokens -= 1
        try:
            message = record.getMessage()
        except Exception:
            message = str(record.msg)
        fields: dict[str, Any] = {"logger": record.name, "level_name": record.levelname}
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            fields["exception"] = f"{type(exc).__name__}: {exc}"[:500]
        if self.suppressed:
            fields["suppressed"], self.suppressed = self.suppressed, 0
        try:
            self.log.warning(message[:1000], **fields)
        except Exception:
            self.handleError(record)

    def handleError(self, record: logging.LogRecord) -> None:  # never print to stderr
        self.suppressed += 1


def bridge_stdlib_logging(per_second: float) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _JsonBridge):
            root.removeHandler(handler)
    root.addHandler(_JsonBridge(per_second))
    root.setLevel(logging.WARNING)
    for name in ("aiohttp.access", "aiohttp.server", "aiohttp.web", "asyncio"):
        logging.getLogger(name).propagate = True


def _stop_if_asked() -> None:
    """The serving task stops once it was cancelled (the shutdown, from a signal), even if
    code under an await swallowed the cancellation: Python 3.11's ``asyncio.wait_for``, under
    which redis-py sends every command of the app's start-up, returns the result of a future
    that finished as the cancellation landed."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def run_app(
    app: web.Application,
    *,
    loop: asyncio.AbstractEventLoop,
    host: str,
    port: int,
    settings: ConnectionSettings,
    shutdown_timeout: float,
    reuse_port: bool | None = None,
    exit_bound: ExitBound | None = None,
) -> None:
    """``web.run_app`` with the connection guard in front of aiohttp's protocol. When it stops
    serving (a signal, or a failure) it arms ``exit_bound``: the process ends within that
    bound even if the cleanup never does (gateway.runtime.exitbound)."""
    bridge_stdlib_logging(settings.log_lines_per_second)
    soft = raise_fd_limit()
    cap = max(8, min(settings.max, soft - FD_RESERVE))
    if cap < settings.max:
        log.warning("connection_cap_lowered", configured=settings.max, cap=cap, fd_limit=soft)
    slot = app.get(GUARD)
    if slot is None:
        slot = app[GUARD] = GuardSlot()
    tenancy = app.get(K.TENANCY)
    tenants = len(tenancy.tenants) if tenancy is not None else 1

    async def serve() -> None:
        runner = web.AppRunner(
            app,
            handle_signals=True,
            access_log=None,
            keepalive_timeout=settings.idle_timeout_seconds,
            # no lingering read of an unread body (10 s by default): the body deadline
            # decides, and a cut-off request's connection closes right after its answer
            lingering_time=0,
            shutdown_timeout=shutdown_timeout,
        )
        try:
            await runner.setup()
            _stop_if_asked()
            assert runner.server is not None
            lane = hot_lane_of(app)
            if lane is not None:
                lane.serve(app, runner.server)
            share = share_of(settings.max_per_tenant, cap, tenants)
            guard = ConnectionGuard(runner.server, settings, cap, share)
            slot.guard = guard
            listener = await loop.create_server(
                guard.factory,
                host,
                port,
                backlog=settings.backlog,
                reuse_address=True,
                reuse_port=reuse_port,
            )
            try:
                _stop_if_asked()
                await asyncio.Event().wait()  # until a signal raises GracefulExit
            finally:
                listener.close()
        finally:
            await runner.cleanup()

    main = loop.create_task(serve())
    ending = "the server stopped"
    try:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(main)
    except GracefulExit:
        ending = "SIGTERM or SIGINT"
    except KeyboardInterrupt:
        ending = "KeyboardInterrupt"
    except BaseException:
        ending = "the server failed"
        raise
    finally:
        if exit_bound is not None:
            exit_bound.arm(loop, why=ending)
        if not main.done():
            main.cancel()
            with contextlib.suppress(asyncio.CancelledError, GracefulExit):
                loop.run_until_complete(main)
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
