"""The tickers' loop (gateway.runtime.periodic): it ends when cancelled, whatever the tick does."""

from __future__ import annotations

import asyncio

import pytest
import structlog

from gateway.runtime.periodic import every, stop

pytestmark = pytest.mark.fast


class Swallowed(Exception):
    """What a library under a tick may turn a cancellation into."""


async def test_a_cancellation_a_tick_swallowed_still_ends_the_loop() -> None:
    ticks = 0
    inside = asyncio.Event()

    async def tick() -> None:
        nonlocal ticks
        ticks += 1
        inside.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise Swallowed from None  # the cancellation is gone, the task still cancelling

    task = asyncio.create_task(every(lambda: 0.0, tick, name="t", quiet=(Swallowed,)))
    await inside.wait()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=2)
    assert task in done and task.cancelled()
    assert ticks == 1


async def test_a_failing_tick_is_logged_and_the_next_one_runs() -> None:
    calls = 0
    third = asyncio.Event()

    async def tick() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("first tick fails")
        if calls == 3:
            third.set()

    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(every(lambda: 0.0, tick, name="t"))
        await asyncio.wait_for(third.wait(), 2)
        await stop([task], within=1)
    assert task.cancelled()
    assert [e["event"] for e in logs] == ["periodic_tick_failed"]
    assert logs[0]["ticker"] == "t"


async def test_stop_does_not_wait_without_bound_for_a_ticker_that_ignores_cancellation() -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            with pytest.raises(asyncio.CancelledError):
                await asyncio.sleep(10)

    task = asyncio.create_task(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    with structlog.testing.capture_logs() as logs:
        await stop([task], within=0.2)
    assert not task.done()
    assert logs == [
        {
            "event": "ticker_did_not_stop",
            "ticker": "stubborn",
            "detail": "shutdown goes on",
            "log_level": "error",
        }
    ]
    release.set()
    task.cancel()
    await asyncio.wait({task}, timeout=1)
