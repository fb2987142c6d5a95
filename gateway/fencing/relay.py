"""The async relay: queued steps claimed under the fence (``relay-6``) and dispatched, fair
across tenants; the sweep that finds a step whose hint was lost.

:class:`Relay` owns its loop, its wake-up event and its stop flag; it dispatches through the
:class:`~gateway.fencing.dispatch.Dispatcher` it is given (which owns the in-flight dispatches
and the pending voids, retried by this loop)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time

import structlog

from gateway.core.errors import (
    AdapterUnavailable,
    FencegateError,
    StoreUnavailable,
    UnknownAdapter,
)
from gateway.core.records import (
    Admitted,
    RelayClaim,
)
from gateway.fencing.dispatch import RELAY_RETRY_MS, Dispatcher
from gateway.runtime.metrics import Metrics
from gateway.store.keys import JobKeys
from gateway.store.store import Store, new_request_id

log = structlog.get_logger("fencegate.service")

# A step left untouched (its claim got no verdict: its slot unavailable, or behind) waits this
# long in this process before it is tried again, doubling per failure up to the last.
_UNTOUCHED_BACKOFF = (0.25, 5.0)


class Relay:
    """Performs queued steps: the relay loop and its sweep."""

    def __init__(self, store: Store, dispatcher: Dispatcher, metrics: Metrics) -> None:
        self._store = store
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._wakeup = asyncio.Event()
        self._stopping = False

    def wake(self) -> None:
        """Start the loop's next turn now (a step was queued, a void is pending)."""
        self._wakeup.set()

    def stop(self) -> None:
        """Ask :meth:`run` to return at its next turn (shutdown); a stopped relay stays
        stopped."""
        self._stopping = True
        self._wakeup.set()

    async def run(
        self,
        *,
        interval: float = 0.25,
        per_tenant: int = 16,
        sweep_seconds: float = 10.0,
        stop_grace: float = 2.0,
    ) -> None:
        """Perform queued steps. Any number of gateways may run this: each step is
        claimed atomically in its own slot, so it is dispatched by one relay only, and the
        claim re-checks the fence, the lease, cancellation and the pinned intent.

        Steps run concurrently, at most ``per_tenant`` of each tenant at a time, taken from
        the tenants' hints interleaved: a tenant with a backlog or a slow downstream does
        not delay another tenant's steps. Every ``sweep_seconds`` (and at start) the queue of
        every slot is read again: a hint lost in a crash between an admit and its hint is
        found there.

        Stopped by :meth:`stop` (checked every turn), not only by cancellation:
        a cancellation can be swallowed on its way (Python 3.11's ``wait_for`` turned
        one that landed as it timed out into ``TimeoutError``; an ``asyncio.Condition``
        waiter re-acquires its lock before it lets a cancellation through), and the
        app's cleanup must never wait forever for this loop. At the stop, steps being
        claimed get ``stop_grace`` seconds to finish (a claim cut off may have run: its step
        would then read ``unknown`` with nothing sent); their dispatches are the drain's."""
        sweeper = asyncio.create_task(self._sweep_forever(sweep_seconds))
        running: dict[str, asyncio.Task[bool]] = {}  # queue member -> its task
        per: dict[str, int] = {}  # tenant -> steps running
        # queue member -> (not before, in loop time; the wait after the next failure): a step
        # whose claim got no verdict is not picked again at once (that was a spin while its
        # slot stayed unavailable)
        later: dict[str, tuple[float, float]] = {}
        loop = asyncio.get_running_loop()
        first, most = _UNTOUCHED_BACKOFF

        def finished(member: str, tenant: str, task: asyncio.Task[bool]) -> None:
            running.pop(member, None)
            per[tenant] -= 1
            if not task.cancelled() and task.exception() is None and not task.result():
                wait = later.get(member, (0.0, first))[1]
                later[member] = (loop.time() + wait, min(wait * 2, most))
            else:
                later.pop(member, None)
            self._wakeup.set()

        try:
            while not self._stopping:
                started = 0
                try:
                    if self._dispatcher.voids_pending:
                        await self._dispatcher.retry_voids()
                    due = await self._store.relay_due(self._store.redis_clock_ms(), per_tenant)
                except StoreUnavailable:
                    due = []
                now = loop.time()
                if len(later) > 4096:  # steps that left the queue meanwhile: forget them
                    later = {m: v for m, v in later.items() if v[0] > now - most}
                for keys, step, _ in due:
                    member = keys.member(step)
                    if member in running or per.get(keys.tenant, 0) >= per_tenant:
                        continue
                    if member in later and later[member][0] > now:
                        continue
                    task = asyncio.create_task(self._relay_one(keys, step))
                    running[member] = task
                    per[keys.tenant] = per.get(keys.tenant, 0) + 1
                    task.add_done_callback(functools.partial(finished, member, keys.tenant))
                    started += 1
                if not started:
                    self._wakeup.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(interval):
                            await self._wakeup.wait()
                else:
                    await asyncio.sleep(0)
        finally:
            sweeper.cancel()
            if running:
                await asyncio.wait(list(running.values()), timeout=stop_grace)
                for task in running.values():
                    task.cancel()

    async def _sweep_forever(self, every: float) -> None:
        """Read every slot's queue at start and every ``every`` seconds: a step whose hint
        was lost (a crash between its admit and its hint) is hinted again."""
        while not self._stopping:
            try:
                found = await self._store.sweep(self._store.redis_clock_ms())
            except StoreUnavailable:
                found = 0
            except Exception:
                log.exception("relay_sweep_failed")
                found = 0
            if found:
                self._wakeup.set()
            await asyncio.sleep(every)

    async def _claim(self, keys: JobKeys, step: str) -> RelayClaim | int | str | None:
        """The relay's claim, safe when its reply is lost (sent again with the same request
        id; given up in Redis if that fails too). None: no verdict, look again later."""
        dispatch_id = new_request_id()
        maybe = False  # an attempt may have run: then the claim must be given up in Redis
        run_before: int | None = None  # the first send's bound, kept by every re-send
        for delay in (0.0, 0.05, 0.2):
            if delay:
                await asyncio.sleep(delay)
            try:
                return await self._store.relay_claim(keys, step, dispatch_id, run_before)
            except StoreUnavailable as exc:
                run_before = run_before or exc.run_before_ms
                maybe = maybe or exc.maybe_applied
                if not maybe:
                    return None
                if exc.unacknowledged:  # it ran; its replicas lag: sending again only waits
                    break
        if not await self._dispatcher.void(keys, step, dispatch_id, run_before):
            self._dispatcher.void_later(keys, step, dispatch_id, run_before)
        return None

    async def _relay_one(self, keys: JobKeys, step: str) -> bool:
        """Perform one queued step; False when it was left for later untouched."""
        try:
            return await self._relay_step(keys, step)
        except StoreUnavailable:
            return False  # still queued in its slot: found again by a hint or the sweep
        except Exception:
            log.exception("relay_step_failed", key=f"{keys.job_id}:{step}")
            return False

    async def _relay_step(self, keys: JobKeys, step: str) -> bool:
        started = time.monotonic()  # the step's deadline counts from before the claim
        claim = await self._claim(keys, step)
        if claim is None:
            return False
        if isinstance(claim, str):  # nothing to send: the step left the queue
            if claim in ("superseded", "lease_expired", "cancelled", "job_completed", "unbound"):
                self._metrics.relay_not_sent.labels(claim).inc()
                log.info("relay_not_sent", key=f"{keys.job_id}:{step}", why=claim)
            await self._store.relay_left(keys, step)
            return True
        if isinstance(claim, int):  # someone is dispatching it: look again after its deadline
            # (on a standalone Redis the claim's script keeps the hint with the queue entry: a
            # hint written here could undo the holder's re-queue for a retry meanwhile)
            await self._store.relay_queued(keys, step, claim + 50)
            return True
        try:
            adapter = self._dispatcher.adapter(claim.adapter, keys.tenant)
        except UnknownAdapter:
            log.error("relay_unknown_adapter", adapter=claim.adapter, key=f"{keys.job_id}:{step}")
            reason = {"reason": f"adapter {claim.adapter!r} is not configured"}
            await self._store.record(keys, step, claim.dispatch_id, "failed", error=reason)
            await self._store.relay_left(keys, step)
            return True
        request = self._dispatcher.request(
            keys, step, claim.generation, claim.adapter, claim.operation, claim.payload, started
        )
        admitted = Admitted(claim.dispatch_id, claim.generation, claim.deadline_ms, resolving=False)
        try:
            await self._dispatcher.spawn(keys, adapter, request, admitted)
        except AdapterUnavailable:  # released, still queued: try again later (re-claimed)
            await self._store.relay_queued(
                keys, step, self._store.redis_clock_ms() + RELAY_RETRY_MS
            )
            return True
        except FencegateError:
            pass  # failed or unknown: recorded; nothing more for the relay to do
        await self._store.relay_left(keys, step)
        return True
