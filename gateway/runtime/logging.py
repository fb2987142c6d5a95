"""structlog, configured once: JSON lines when not on a TTY, secrets redacted.

Each request has one log context, a plain dict in one context variable
(:func:`request_context`, :func:`bind`), merged into every event logged while
the request runs and rendered once more as the canonical request line. It
replaces structlog's per-key context variables on the hot path: binding is a
dict update, merging a dict copy. JSON is rendered by orjson straight to bytes.

Lines are written through one :class:`LineSink` per process: the canonical request lines
are buffered and written together (at most every :data:`FLUSH_SECONDS`, or when the buffer
holds :data:`FLUSH_BYTES`) instead of one ``write`` and ``flush`` system call per request (so
are the batches of :func:`log_info_lines`, e.g. the audit anchors of one tick);
every other line (warnings, errors, start-up) first writes what is buffered, then itself, at
once, so the order of lines is kept. The buffer is written at shutdown (the app's cleanup
and ``atexit``): a process killed with SIGKILL loses at most its last
:data:`FLUSH_SECONDS` of request lines, never an error line.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import re
import sys
import time
from collections.abc import Iterable, MutableMapping
from contextvars import ContextVar
from typing import Any

import structlog

from gateway.core import fastjson

__all__ = [
    "bind",
    "configure_logging",
    "end_request",
    "escape_controls",
    "flush_logs",
    "log_info_lines",
    "log_request",
    "redactor",
    "request_context",
    "request_field",
]

_REQUEST: ContextVar[dict[str, Any] | None] = ContextVar("fencegate_request", default=None)


def request_context(**fields: Any) -> dict[str, Any]:
    """Start the log context of the current task (one request); returns it."""
    context = dict(fields)
    _REQUEST.set(context)
    return context


def request_field(name: str) -> Any:
    """A field of the current request's log context (None outside a request)."""
    context = _REQUEST.get()
    return None if context is None else context.get(name)


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


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_CONTROL_NO_LF = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")
_MULTILINE = frozenset({"exception", "stack"})  # tracebacks keep their line breaks and tabs


def _escape_char(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_controls(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Console mode: control characters in values (a request path's ESC, CR, BEL …) are
    written as ``\\xNN`` escapes, so nothing a client sends can drive the terminal or
    forge a log line. (The JSON renderer escapes them itself.)"""
    for key, value in event.items():
        if isinstance(value, str):
            pattern = _CONTROL_NO_LF if key in _MULTILINE else _CONTROL
            if pattern.search(value):
                event[key] = pattern.sub(_escape_char, value)
    return event


_log = structlog.get_logger("fencegate")

FLUSH_SECONDS = 0.05
FLUSH_BYTES = 64 * 1024


class LineSink:
    """Where every JSON line of the process goes (see the module's docstring)."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self._buffer = bytearray()
        self._scheduled = False

    def later(self, line: bytes) -> None:
        """A request line: buffered, written within :data:`FLUSH_SECONDS`."""
        self._buffer += line
        if len(self._buffer) >= FLUSH_BYTES:
            self.flush()
        elif not self._scheduled:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no event loop (a CLI command): now
                self.flush()
                return
            self._scheduled = True
            loop.call_later(FLUSH_SECONDS, self.flush)

    def now(self, line: bytes) -> None:
        """Any other line: what is buffered, then this one, written at once."""
        self._buffer += line
        self.flush()

    def flush(self) -> None:
        self._scheduled = False
        if not self._buffer:
            return
        data, self._buffer = bytes(self._buffer), bytearray()
        try:
            self.out.write(data)
            self.out.flush()
        except (OSError, ValueError):  # stderr closed (a daemonised process at exit)
            pass


class _SinkLogger:
    """structlog's logger for the JSON chain: every level writes through the sink at once."""

    def __init__(self, sink: LineSink) -> None:
        self._sink = sink

    def msg(self, message: bytes) -> None:
        self._sink.now(message + b"\n")

    log = debug = info = warn = warning = msg
    err = error = critical = exception = fatal = failure = msg


_sink: LineSink | None = None


def flush_logs() -> None:
    """Write the buffered request lines now (the app's cleanup; also at exit)."""
    if _sink is not None:
        _sink.flush()


class _RequestLine:
    """The canonical request line, rendered without structlog's per-call machinery.

    It runs the same steps as the JSON chain :func:`configure_logging` installs
    (bound context variables, level, ISO timestamp, redaction, the chain's own
    JSON renderer, one write and flush), so the line is the same, at about half
    the cost. It stands in only while that chain is the configured one: under
    ``capture_logs`` or any other configuration the line goes through structlog.
    """

    def __init__(
        self,
        processors: list[Any],
        redact: structlog.types.Processor,
        sink: LineSink,
        enabled: bool,
    ) -> None:
        self.processors, self.renderer = processors, processors[-1]
        self.redact, self.sink, self.enabled = redact, sink, enabled

    def active(self) -> bool:
        procs = structlog.get_config()["processors"]
        return procs is self.processors and procs[-1] is self.renderer

    def write(self, event: dict[str, Any], name: str = "request") -> None:
        if not self.enabled:
            return
        event["event"] = name
        _merge_structlog_context(event)
        event["level"] = "info"
        event["timestamp"] = iso_utc(time.time_ns())
        self.redact(None, "info", event)
        self.sink.later(self.renderer(None, "info", event) + b"\n")  # the chain's JSONRenderer


_line: _RequestLine | None = None

# structlog's own context variables (bind_contextvars), by name: none bound in this process,
# nothing to merge (merge_contextvars walks every context variable of the context to know)
_STRUCTLOG_VARS: dict[str, Any] | None = getattr(structlog.contextvars, "_CONTEXT_VARS", None)


def _merge_structlog_context(event: dict[str, Any]) -> None:
    if _STRUCTLOG_VARS is None or _STRUCTLOG_VARS:
        structlog.contextvars.merge_contextvars(None, "info", event)


_clock_second: list[Any] = [None, ""]  # the second last formatted, and its text


def iso_utc(ns: int) -> str:
    """What structlog's ``TimeStamper(fmt="iso", utc=True)`` writes for the instant ``ns``
    (nanoseconds since the epoch, floored to the microsecond as ``datetime.now`` does; no
    fraction when it is 0), with the date and time of day formatted once per second."""
    second, rest = divmod(ns, 1_000_000_000)
    if _clock_second[0] != second:
        text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        _clock_second[0], _clock_second[1] = second, text
    micro = rest // 1000
    return f"{_clock_second[1]}.{micro:06d}Z" if micro else f"{_clock_second[1]}Z"


def log_request(event: dict[str, Any]) -> None:
    """Log the canonical ``request`` line with these fields (the dict is consumed)."""
    line = _line
    if line is not None and line.active():
        line.write(event)
    else:
        _log.info("request", **event)


def log_info_lines(name: str, events: Iterable[dict[str, Any]]) -> None:
    """Log an ``info`` line named ``name`` per event, buffered like the request lines (a
    periodic task's batch: one write for all of them; the dicts are consumed)."""
    line = _line
    if line is not None and line.active():
        for event in events:
            line.write(event, name)
    else:
        for event in events:
            _log.info(name, **event)


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
    global _line, _sink
    flush_logs()  # what an earlier configuration buffered
    _sink = LineSink(sys.stderr.buffer) if as_json else None
    sink = _sink
    factory: Any = (
        (lambda *_: _SinkLogger(sink))
        if sink is not None
        else structlog.PrintLoggerFactory(sys.stderr)
    )
    redact = redactor(secrets)
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,  # what adapters may bind themselves
        _merge_request,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        redact,
        *(() if as_json else (escape_controls,)),
        renderer,
    ]
    min_level = logging.getLevelName(level.upper())
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(min_level),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
    # the request line is logged outside a request's context: _merge_request adds nothing
    _line = (
        _RequestLine(processors, redact, sink, min_level <= logging.INFO)
        if sink is not None
        else None
    )


atexit.register(flush_logs)
