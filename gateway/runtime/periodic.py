"""Periodic background work: the one loop every ticker of a gateway process runs in.

:func:`every` calls a tick at an interval until its task is cancelled; :func:`stop` cancels
tickers at shutdown and waits for them a bounded time. Both hold whatever the tick awaits:
a cancellation that lands inside a tick ends the loop even when code under it turned the
``CancelledError`` into another exception (the task's ``cancelling()`` count is checked
after every tick), and a ticker that still does not end is left behind with a log line,
never waited for without bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

import structlog

__all__ = ["every", "stop"]

log = structlog.get_logger("fencegate.periodic")


async def every(
    seconds: Callable[[], float],
    tick: Callable[[], Awaitable[object]],
    *,
    name: str,
    quiet: tuple[type[Exception], ...] = (),
) -> None:
    """Sleep ``seconds()``, then ``await tick()``, until cancelled. An exception of a
    ``quiet`` type ends that tick silently (the next one tries again); any other exception is
    logged (``periodic_tick_failed``) and the loop goes on."""
    task = asyncio.current_task()
    while True:
        await asyncio.sleep(seconds())
        try:
            await tick()
        except quiet:
            pass
        except Exception:
            log.exception("periodic_tick_failed", ticker=name)
        if task is not None and task.cancelling():
            raise asyncio.CancelledError  # cancelled inside the tick, and something kept it


async def stop(tasks: Iterable[asyncio.Task[None]], within: float) -> None:
    """Cancel ``tasks`` and wait at most ``within`` seconds for them to end."""
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    if not pending:
        return
    _, stuck = await asyncio.wait(pending, timeout=within)
    for task in stuck:
        log.error("ticker_did_not_stop", ticker=task.get_name(), detail="shutdown goes on")
