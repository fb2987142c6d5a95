"""Live parts: one reader of the tenant feeds per process, and the SSE streams it feeds.

:class:`FeedPump` reads ``fg:audit:<tenant>`` (``XRANGE`` after the last id it read) every
``[console] poll_seconds`` for each tenant that has an open tab, and hands every new entry
to each tab's queue: one Redis read per tenant per interval, whatever the number of tabs.
No tab, no read.

A stream never misses or repeats an entry: it subscribes first (the pump's position for a
new tenant is the feed's newest id, read before the queue is registered), then reads from
Redis what came after the id the browser has (``Last-Event-ID``, else the page's ``after``),
then takes the queue, skipping ids it has already sent. Stream ids only grow.

:class:`Streams` holds every open SSE response: at shutdown they are ended (an open tab must
not hold up SIGTERM), and a tab that went away is noticed by the keep-alive ping within
``[console] sse_ping_seconds`` (aiohttp does not cancel a handler whose client left).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import structlog
from aiohttp import web
from aiohttp_sse import EventSourceResponse

from gateway.core.errors import StoreUnavailable, TooManyHeld
from gateway.store.console_reads import ConsoleReads

__all__ = ["FeedPump", "Holds", "Streams", "id_key", "open_stream"]

log = structlog.get_logger("fencegate.console")

Row = tuple[str, dict[str, str]]
QUEUE_MAX = 2000  # a tab this far behind is closed; its browser reconnects and reads Redis
_END: Row = ("", {})


def id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class FeedPump:
    """One poll per tenant (with open tabs) per interval, fanned out to every tab."""

    def __init__(self, reads_of: Callable[[], ConsoleReads], poll_seconds: float) -> None:
        self._reads_of = reads_of  # the store's, made at startup after the console is built
        self._poll = poll_seconds
        self._subscribers: dict[str, set[asyncio.Queue[Row]]] = {}
        self._last: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None
        self.reads = 0  # XRANGE calls made (the tests check one per interval, not per tab)

    async def subscribe(self, tenant: str) -> asyncio.Queue[Row]:
        queue: asyncio.Queue[Row] = asyncio.Queue(QUEUE_MAX)
        if tenant not in self._last:
            self._last.setdefault(tenant, await self._reads_of().feed_newest(tenant))
        self._subscribers.setdefault(tenant, set()).add(queue)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        return queue

    def unsubscribe(self, tenant: str, queue: asyncio.Queue[Row]) -> None:
        subs = self._subscribers.get(tenant)
        if subs is not None:
            subs.discard(queue)
            if not subs:
                del self._subscribers[tenant]
                self._last.pop(tenant, None)

    async def _read(self, tenant: str) -> None:
        last = self._last.get(tenant)
        if last is None:
            return
        self.reads += 1
        rows = await self._reads_of().feed_after(tenant, last, 1000)
        if not rows or tenant not in self._last:
            return
        self._last[tenant] = rows[-1][0]
        for queue in list(self._subscribers.get(tenant, ())):
            for row in rows:
                try:
                    queue.put_nowait(row)
                except asyncio.QueueFull:  # too slow: end that stream, it resumes from Redis
                    with contextlib.suppress(asyncio.QueueEmpty):
                        queue.get_nowait()
                    queue.put_nowait(_END)
                    break

    async def _run(self) -> None:
        while self._subscribers:
            await asyncio.sleep(self._poll)
            for tenant in list(self._subscribers):
                try:
                    await self._read(tenant)
                except (StoreUnavailable, OSError, TimeoutError) as exc:
                    log.warning("console_feed_read_failed", tenant=tenant, detail=str(exc))

    async def aclose(self) -> None:
        for subs in self._subscribers.values():
            for queue in subs:
                with contextlib.suppress(asyncio.QueueFull):
                    queue.put_nowait(_END)
        self._subscribers.clear()
        self._last.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class Streams:
    """Every open SSE response of this process, ended together at shutdown, counted per
    login (``per_session``: the session id) and per tenant (``per_tenant``; 0: no cap)."""

    def __init__(self, ping_seconds: float, per_session: int = 0, per_tenant: int = 0) -> None:
        self.ping_seconds = ping_seconds
        self.open: set[EventSourceResponse] = set()
        self.closing = False
        self.caps = {"sse_per_session": per_session, "sse_per_tenant": per_tenant}
        self.held: dict[tuple[str, str], int] = {}  # ("sse_per_session", nonce) -> streams

    def hold(self, session: str, tenant: str) -> tuple[tuple[str, str], ...]:
        """Count one more stream of ``session`` and ``tenant``; :class:`TooManyHeld` past
        a cap (nothing counted). Give the returned keys back with :meth:`release`."""
        keys = (("sse_per_session", session), ("sse_per_tenant", tenant))
        for key in keys:
            cap = self.caps[key[0]]
            if cap and self.held.get(key, 0) >= cap:
                whose = "this login" if key[0] == "sse_per_session" else f"tenant {tenant!r}"
                raise TooManyHeld(
                    f"{whose} has {cap} live streams open (console.{key[0]}): close a tab "
                    "or retry later",
                    limit=f"console.{key[0]}",
                    retry_after=max(1, round(self.ping_seconds * 2)),
                )
        for key in keys:
            self.held[key] = self.held.get(key, 0) + 1
        return keys

    def release(self, keys: tuple[tuple[str, str], ...]) -> None:
        for key in keys:
            if (left := self.held.get(key, 0) - 1) > 0:
                self.held[key] = left
            else:
                self.held.pop(key, None)

    async def close_all(self, _app: web.Application | None = None) -> None:
        self.closing = True
        for sse in list(self.open):
            sse.stop_streaming()


class Holds:
    """Requests of one kind (exports) running at once in this process, counted per login and
    per tenant against ``caps`` (``{config key: cap}``, the session's first; 0: no cap)."""

    def __init__(self, what: str, caps: dict[str, int], retry_after: int = 5) -> None:
        self.what = what
        self.caps = caps
        self.retry_after = retry_after
        self.held: dict[tuple[str, str], int] = {}

    @contextlib.contextmanager
    def holding(self, session: str, tenant: str) -> Iterator[None]:
        """One more for ``session`` and ``tenant`` while the block runs; past a cap
        :class:`TooManyHeld` before it runs (nothing counted)."""
        (per_session, s_cap), (per_tenant, t_cap) = self.caps.items()
        keys = ((per_session, session), (per_tenant, tenant))
        for key, cap in zip(keys, (s_cap, t_cap), strict=True):
            name = key[0]
            if cap and self.held.get(key, 0) >= cap:
                whose = "this login" if name == per_session else f"tenant {tenant!r}"
                raise TooManyHeld(
                    f"{whose} has {cap} {self.what} running (console.{name}): wait for it "
                    "to end or retry later",
                    limit=f"console.{name}",
                    retry_after=self.retry_after,
                )
        for key in keys:
            self.held[key] = self.held.get(key, 0) + 1
        try:
            yield
        finally:
            for key in keys:
                if (left := self.held.get(key, 0) - 1) > 0:
                    self.held[key] = left
                else:
                    self.held.pop(key, None)


@contextlib.asynccontextmanager
async def open_stream(
    request: web.Request, streams: Streams, *, session: str, tenant: str
) -> AsyncIterator[tuple[EventSourceResponse, asyncio.Future[None]]]:
    """Prepare an SSE response (its ping set in the constructor: assigning it later does
    nothing) and register it; yields it and a future that ends when the client went away or
    the gateway shuts down. Past a cap of :class:`Streams`: :class:`TooManyHeld`, before
    anything is sent."""
    if streams.closing:
        raise web.HTTPServiceUnavailable(text="shutting down")
    held = streams.hold(session, tenant)
    try:
        sse = EventSourceResponse(ping_interval=streams.ping_seconds)
        await sse.prepare(request)
        streams.open.add(sse)
        closed: asyncio.Future[None] = asyncio.ensure_future(sse.wait())
        try:
            async with sse:
                yield sse, closed
        except ConnectionResetError:
            pass
        finally:
            closed.cancel()
            streams.open.discard(sse)
    finally:
        streams.release(held)


async def next_or_closed(queue: asyncio.Queue[Row], closed: asyncio.Future[None]) -> Row:
    """The queue's next row, or the end marker when the stream closed first."""
    if closed.done():
        return _END
    get: asyncio.Future[Any] = asyncio.ensure_future(queue.get())
    done, _ = await asyncio.wait([get, closed], return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        row: Row = get.result()
        return row
    get.cancel()
    return _END
