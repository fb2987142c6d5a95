"""The hot lane: a worker's effect call and heartbeat reach the gateway's middleware and
their handler without aiohttp's application dispatch (its router's walk over every resource,
its per-app ``current_app`` layer, its middleware chain of partials).

:meth:`HotLane.serve` wraps the request handler of aiohttp's low-level ``web.Server`` (its
C parser, keep-alive and response writing stay). A request is taken by the lane only when it
is a ``POST`` without ``Expect`` whose raw path is exactly ``/v1/jobs/<job>/effects/<step>``
or ``/v1/jobs/<job>/fence`` with both names matching :data:`gateway.core.names.NAME`: such a
path has no percent-escape, dot segment, query or empty segment, so its raw text is the
path the router would have matched, with the same names. Every other request goes to the
application as before.

A taken request gets the match information the router would have built (the same route,
its names, the application), so everything after it — the middleware, the handler,
``request.app``, the metrics' route label — runs as on the routed path, and answers the same
bytes (``tests/http/test_hot_lane.py``).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import hdrs, web
from aiohttp.web_urldispatcher import AbstractRoute, UrlMappingMatchInfo

from gateway.core.names import NAME

__all__ = ["HOT_LANE", "HotLane"]

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
RouteHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, RouteHandler], Awaitable[web.StreamResponse]]

_HOT_PATH = re.compile(rf"/v1/jobs/({NAME.pattern})/(?:effects/({NAME.pattern})|fence)")


class HotLane:
    """The lane of one application: its middleware and its two hot routes."""

    def __init__(self, middleware: Middleware, effect: AbstractRoute, fence: AbstractRoute) -> None:
        self.middleware = middleware
        self.effect = effect
        self.fence = fence
        self.taken = 0  # requests the lane served (a count, for tests and curiosity)

    def serve(self, app: web.Application, server: web.Server) -> None:
        """Put the lane in front of ``server``'s handler (the application's)."""
        routed: Handler = server.request_handler
        match = _HOT_PATH.fullmatch
        middleware = self.middleware

        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            if request.method == "POST":
                found = match(request.raw_path)
                if found is not None and hdrs.EXPECT not in request.headers:
                    job, step = found.groups()
                    if step is None:
                        route, names = self.fence, {"job": job}
                    else:
                        route, names = self.effect, {"job": job, "step": step}
                    info = UrlMappingMatchInfo(names, route)
                    info.add_app(app)
                    info.freeze()
                    assert isinstance(request, web.Request)  # the application's request factory
                    request._match_info = info  # what Application._handle sets after routing
                    self.taken += 1
                    return await middleware(request, route.handler)
            return await routed(request)

        server.request_handler = handle


HOT_LANE = web.AppKey("hot_lane", HotLane)


def hot_lane_of(app: web.Application) -> HotLane | None:
    """The application's lane, if it has one (``create_app``'s does)."""
    lane: Any = app.get(HOT_LANE)
    return lane if isinstance(lane, HotLane) else None
