"""The bound on a gateway process's exit once its shutdown has begun.

``fencegate serve`` arms an :class:`ExitBound` when it stops serving (a SIGTERM or SIGINT,
the death signal a worker gets when its supervisor dies, or a failed start): from then the
process is gone within ``server.shutdown_grace_seconds`` + :data:`MARGIN_SECONDS`, whatever
its cleanup awaits or blocks on. The watchdog is a daemon thread, so it fires while the event
loop is stuck too: it logs ``shutdown_overran`` with what was still pending (each task's
chain of awaited coroutines, the main thread's stack, the live threads), writes the log out
and ends the process with :data:`EXIT_SHUTDOWN_OVERRAN`. A supervisor stops its workers on
the same bound while it is alive; this one covers a worker whose supervisor is dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import sys
import threading
import traceback
import types
from types import FrameType
from typing import Any

import structlog

from gateway.runtime.logging import flush_logs

__all__ = ["EXIT_SHUTDOWN_OVERRAN", "MARGIN_SECONDS", "ExitBound", "pending_work"]

EXIT_SHUTDOWN_OVERRAN = 4
MARGIN_SECONDS = 5.0  # past the shutdown grace: the cleanup after the drain (relay, ticks, store)

log = structlog.get_logger("fencegate.shutdown")

_CHAIN_DEPTH = 24  # awaited coroutines named per task, outermost first
_STACK_DEPTH = 8  # innermost frames of the main thread
_TASKS_NAMED = 50


def _where(frame: FrameType | None) -> str:
    if frame is None:
        return "?"
    code = frame.f_code
    return f"{code.co_qualname} ({code.co_filename}:{frame.f_lineno})"


def _awaiting(coro: Any) -> str:
    """A task's chain of awaited coroutines (``a <- b``: ``a`` awaits ``b``), outermost first;
    through async generators too (an app's cleanup contexts are)."""
    chain: list[str] = []
    while coro is not None and len(chain) < _CHAIN_DEPTH:
        if not hasattr(coro, "cr_frame") and not hasattr(coro, "gi_frame"):
            # an async generator's asend()/athrow() awaitable: its generator is a referent
            gens = [g for g in gc.get_referents(coro) if isinstance(g, types.AsyncGeneratorType)]
            if gens:
                coro = gens[0]
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        frame = frame or getattr(coro, "gi_frame", None)
        chain.append(_where(frame) if frame is not None else type(coro).__name__)
        coro = (
            getattr(coro, "cr_await", None)
            or getattr(coro, "ag_await", None)
            or getattr(coro, "gi_yieldfrom", None)
        )
    return " <- ".join(chain)


def pending_work(loop: asyncio.AbstractEventLoop) -> dict[str, list[str]]:
    """What a process that does not end is busy with: the loop's unfinished tasks (each
    ``name: chain``), the main thread's innermost frames, the other live threads. Safe to call
    from another thread than the loop's (a read; a task set changing meanwhile is read again
    by ``asyncio.all_tasks``)."""
    try:
        tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    except RuntimeError:  # the set kept changing
        tasks = []
    named = [f"{task.get_name()}: {_awaiting(task.get_coro())}" for task in tasks]
    main = threading.main_thread()
    frame = sys._current_frames().get(main.ident or 0)
    stack = [
        f"{entry.name} ({entry.filename}:{entry.lineno})"
        for entry in (traceback.extract_stack(frame)[-_STACK_DEPTH:] if frame is not None else [])
    ]
    threads = [
        f"{thread.name}{' (daemon)' if thread.daemon else ''}"
        for thread in threading.enumerate()
        if thread is not main and thread is not threading.current_thread()
    ]
    return {"tasks": sorted(named)[:_TASKS_NAMED], "main_thread": stack, "threads": threads}


class ExitBound:
    """Once :meth:`arm` ed, the process ends within ``seconds`` (see the module docstring),
    unless :meth:`disarm` ed first."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._disarmed = threading.Event()
        self._thread: threading.Thread | None = None

    def arm(self, loop: asyncio.AbstractEventLoop, *, why: str) -> None:
        """Start the watchdog (once; a second call changes nothing)."""
        if self._thread is not None:
            return
        log.info("shutting_down", why=why, exit_within_seconds=self.seconds)
        self._thread = threading.Thread(
            target=self._watch, args=(loop,), name="exit-bound", daemon=True
        )
        self._thread.start()

    def disarm(self) -> None:
        """The process's owner ends it itself from here (e.g. it stops its embedded Redis,
        which a forced exit would leave running where no death signal exists)."""
        self._disarmed.set()

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._disarmed.wait(self.seconds):
            return
        try:
            log.error(
                "shutdown_overran",
                exit_within_seconds=self.seconds,
                exit_code=EXIT_SHUTDOWN_OVERRAN,
                **pending_work(loop),
            )
        finally:
            flush_logs()
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            os._exit(EXIT_SHUTDOWN_OVERRAN)
