"""structlog, configured once: JSON lines when not on a TTY, secrets redacted.

Each request has one log context, a plain dict in one context variable
(:func:`request_context`, :func:`bind`), merged into every event logged while
the request runs and rendered once more as the canonical request line. It
replaces structlog's per-key context variables on the hot path: binding is a
dict update, merging a dict copy. JSON is rendered by orjson straight to bytes.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Iterable, MutableMapping
from contextvars import ContextVar
from typing import Any

import structlog

from gateway import fastjson

__all__ = ["bind", "configure_logging", "end_request", "redactor", "request_context"]

_REQUEST: ContextVar[dict[str, Any] | None] = ContextVar("fencegate_request", default=None)


def request_context(**fields: Any) -> dict[str, Any]:
    """Start the log context of the current task (one request); returns it."""
    context = dict(fields)
    _REQUEST.set(context)
    return context


def end_request() -> None:
    """Detach the current task from its request's log context (tasks it spawned keep it)."""
    _REQUEST.set(None)


def bind(**fields: Any) -> None:
    """Add fields to the current request's log context (no-op outside a request)."""
    context = _REQUEST.get()
    if context is not None:
        context.update(fields)


def _merge_request(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    context = _REQUEST.get()
    if context:
        return {**context, **event}
    return event


_SENSITIVE_KEYS = frozenset({"authorization", "api_key", "password", "secret", "token_key"})


@functools.lru_cache(maxsize=4096)
def _sensitive(key: str) -> bool:  # event keys are few and repeat: decide each once
    return key.lower() in _SENSITIVE_KEYS


def redactor(secrets: Iterable[str]) -> structlog.types.Processor:
    """A processor that blanks known secret values wherever they appear in an event."""
    values = tuple(s for s in secrets if s)

    def redact(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        for key, value in event.items():  # values are replaced in place: no keys added
            if _sensitive(key):
                event[key] = "[redacted]"
            elif values and isinstance(value, str):
                for secret in values:
                    if secret in value:
                        value = value.replace(secret, "[redacted]")
                event[key] = value
        return event

    return redact


def configure_logging(
    *, json: bool | None = None, level: str = "info", secrets: Iterable[str] = ()
) -> None:
    """Configure structlog for the process. ``json=None``: JSON unless stderr is a TTY."""
    as_json = (not sys.stderr.isatty()) if json is None else json
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer(serializer=fastjson.dumps)
        if as_json
        else structlog.dev.ConsoleRenderer()
    )
    factory: Any = (
        structlog.BytesLoggerFactory(sys.stderr.buffer)
        if as_json
        else structlog.PrintLoggerFactory(sys.stderr)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,  # what adapters may bind themselves
            _merge_request,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            redactor(secrets),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
