"""Every route the gateway serves: :mod:`gateway.app` mounts them, :mod:`gateway.openapi`
describes them."""

from __future__ import annotations

from gateway import handlers, jobviews
from gateway.handlers import HOT_HANDLERS, Route

__all__ = ["HOT_HANDLERS", "ROUTES", "Route"]

ROUTES: tuple[Route, ...] = (*handlers.ROUTES, *jobviews.ROUTES)
