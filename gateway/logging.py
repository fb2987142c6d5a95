"""structlog, configured once: JSON lines when not on a TTY, secrets redacted."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, MutableMapping
from typing import Any

import structlog

__all__ = ["configure_logging", "redactor"]

_SENSITIVE_KEYS = frozenset({"authorization", "api_key", "password", "secret", "token_key"})


def redactor(secrets: Iterable[str]) -> structlog.types.Processor:
    """A processor that blanks known secret values wherever they appear in an event."""
    values = tuple(s for s in secrets if s)

    def redact(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        for key, value in list(event.items()):
            if key.lower() in _SENSITIVE_KEYS:
                event[key] = "[redacted]"
            elif isinstance(value, str) and values:
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
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            redactor(secrets),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
