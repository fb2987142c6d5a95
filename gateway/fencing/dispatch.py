"""The dispatcher: an admitted step's adapter call under the process's own deadline, in a task
shielded from the request, then its record; the voids of admits whose reply never came; the
drain of in-flight dispatches at shutdown.

:class:`Dispatcher` owns the adapters, the in-flight dispatches and the pending voids. Its
callers (:class:`gateway.fencing.service.EffectService` for effect calls,
:class:`gateway.fencing.relay.Relay` for queued steps) decide; it performs, through its public
methods: :meth:`~Dispatcher.adapter`, :meth:`~Dispatcher.request`, :meth:`~Dispatcher.spawn`,
:meth:`~Dispatcher.result`, :meth:`~Dispatcher.replay`, :meth:`~Dispatcher.void`,
:meth:`~Dispatcher.void_later`, :meth:`~Dispatcher.retry_voids`, :meth:`~Dispatcher.drain`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from adapters.base import (
    Adapter,
    Delivered,
    EffectRequest,
    Failed,
    NotDelivered,
    Outcome,
    Unknown,
)
from gateway.core.errors import (
    AdapterUnavailable,
    EffectFailed,
    OutcomeUnknown,
    StoreUnavailable,
    UnknownAdapter,
)
from gateway.core.records import (
    Admitted,
    EffectRecord,
    EffectResult,
    EffectState,
    downstream_key,
    proxied_key,
)
from gateway.runtime.metrics import Metrics
from gateway.store.keys import JobKeys
from gateway.store.store import Store, new_request_id

log = structlog.get_logger("fencegate.service")

# Record retries when Redis blips right after a dispatch: the effect happened,
# so try hard to write it down before giving up to `unknown`.
_RECORD_BACKOFF = (0.05, 0.1, 0.2, 0.4, 0.8)
# A relay dispatch that ended released (known not delivered) is due again after this: written
# with its record, and the relay's hint when it re-queues the step.
RELAY_RETRY_MS = 1000


class Dispatcher:
    """Performs admitted steps and records their outcomes."""

    def __init__(
        self,
        store: Store,
        adapters: Mapping[str, Adapter],
        metrics: Metrics,
        *,
        dispatch_timeout_seconds: float,
        tenant_keyed: frozenset[str] = frozenset(),
        adapter_tenants: Mapping[str, frozenset[str] | None] | None = None,
        crash_hook: Callable[[str], None] | None = None,
    ) -> None:
        self._store = store
        self._adapters = adapters
        self._tenant_keyed = tenant_keyed
        # adapter -> the tenants that may use it (None or absent: every tenant)
        self._adapter_tenants = adapter_tenants or {}
        # Chaos testing only (serve --chaos-crash-at): may SIGKILL this process at a point.
        self._crash = crash_hook or (lambda point: None)
        self._metrics = metrics
        self._timeout = dispatch_timeout_seconds
        # in-flight dispatch -> what to record if shutdown cuts it short
        self._inflight: dict[asyncio.Task[EffectResult], tuple[JobKeys, str, str]] = {}
        # admits whose reply never came and that Redis could not be told to give up yet:
        # (job, step, dispatch id, the admit's "run before" (ms, Redis's clock) or None)
        self._voids: set[tuple[JobKeys, str, str, int | None]] = set()

    def adapter(self, name: str, tenant: str) -> Adapter:
        """The adapter, if the tenant may use it: another tenant's adapter is answered
        exactly like one that is not configured (no probing other tenants' adapters)."""
        adapter = self._adapters.get(name)
        allowed = self._adapter_tenants.get(name)
        if adapter is None or (allowed is not None and tenant not in allowed):
            raise UnknownAdapter(f"no adapter named {name!r} is configured")
        return adapter

    async def void(
        self, keys: JobKeys, step: str, dispatch_id: str, run_before_ms: int | None = None
    ) -> bool:
        """Give up in Redis an admit (or a relay claim) whose reply never came: if it ran, it
        holds the step for a dispatch that never starts. False: Redis did not answer."""
        try:
            what = await self._store.void(keys, step, dispatch_id, run_before_ms)
        except StoreUnavailable:
            return False
        log.warning("admit_given_up", key=f"{keys.job_id}:{step}", found=what)
        return True

    def void_later(
        self, keys: JobKeys, step: str, dispatch_id: str, run_before_ms: int | None
    ) -> None:
        """Keep a void Redis could not be told yet, for :meth:`retry_voids`."""
        self._voids.add((keys, step, dispatch_id, run_before_ms))

    @property
    def voids_pending(self) -> bool:
        return bool(self._voids)

    async def retry_voids(self) -> None:
        """Give up, once Redis answers again, the admits whose reply never came."""
        for item in list(self._voids):
            if await self.void(*item):
                self._voids.discard(item)

    def spawn(
        self, keys: JobKeys, adapter: Adapter, request: EffectRequest, admitted: Admitted
    ) -> asyncio.Future[EffectResult]:
        """Run a dispatch in its own task, shielded from the caller, known to ``drain``."""
        task = asyncio.create_task(self._dispatch(keys, adapter, request, admitted))
        self._inflight[task] = (keys, request.step, admitted.dispatch_id)
        task.add_done_callback(lambda t: self._inflight.pop(t, None))
        return asyncio.shield(task)

    def request(
        self,
        keys: JobKeys,
        step: str,
        generation: int,
        adapter_name: str,
        operation: str,
        payload: Mapping[str, Any],
        started: float | None = None,
    ) -> EffectRequest:
        """The adapter's request; its deadline counts from ``started`` (monotonic; default
        now) plus the dispatch timeout."""
        return EffectRequest(
            tenant=keys.tenant,
            job_id=keys.job_id,
            step=step,
            generation=generation,
            idempotency_key=self._key(keys, step, adapter_name),
            operation=operation,
            payload=payload,
            deadline=(time.monotonic() if started is None else started) + self._timeout,
        )

    def _key(self, keys: JobKeys, step: str, adapter_name: str) -> str:
        """The idempotency key sent downstream (tenant-prefixed where the adapter says so)."""
        if adapter_name.startswith("proxy:"):  # gateway.proxy: shared by its tenants' workers
            return proxied_key(keys.tenant, keys.job_id, step)
        return downstream_key(
            keys.tenant, keys.job_id, step, tenant_keyed=adapter_name in self._tenant_keyed
        )

    def result(
        self,
        keys: JobKeys,
        step: str,
        generation: int,
        state: str,
        adapter_name: str,
        result: Any = None,
        *,
        replayed: bool = False,
    ) -> EffectResult:
        """The step's result as the caller is answered."""
        return EffectResult(
            job_id=keys.job_id,
            step=step,
            generation=generation,
            state=state,
            replayed=replayed,
            idempotency_key=self._key(keys, step, adapter_name),
            adapter=adapter_name,
            result=result,
        )

    def replay(self, keys: JobKeys, step: str, record: EffectRecord) -> EffectResult:
        """The answer of a step already recorded (a failure is raised again)."""
        self._metrics.effect_counter(record.adapter, "replayed").inc()
        if record.state == "failed":
            raise EffectFailed(
                "the downstream permanently refused this effect (recorded)",
                error=record.error,
                replayed=True,
                generation=record.generation,
            )
        return self.result(
            keys,
            step,
            record.generation,
            record.state,
            record.adapter,
            record.result,
            replayed=True,
        )

    async def _dispatch(
        self, keys: JobKeys, adapter: Adapter, request: EffectRequest, admitted: Admitted
    ) -> EffectResult:
        outcome: Outcome | None = None
        replayed = False
        proven_not_done = False
        if admitted.resolving:
            outcome, proven_not_done = await self._resolve(adapter, request)
            replayed = isinstance(outcome, Delivered)
        if outcome is None:
            outcome = await self._send(adapter, request)
            if admitted.resolving and isinstance(outcome, NotDelivered) and not proven_not_done:
                # This send did not reach the downstream, but an earlier one of the step may
                # have: the step is as unknown as before. Releasing it would let a re-pin
                # send a different intent under the same key.
                outcome = Unknown(f"{outcome.reason}; an earlier send's outcome is unknown")
        self._crash("after_dispatch")
        state = await self._record(keys, adapter.name, request, admitted.dispatch_id, outcome)
        self._crash("after_record")
        return self._respond(keys, request, adapter.name, state, outcome, replayed)

    async def _resolve(
        self, adapter: Adapter, request: EffectRequest
    ) -> tuple[Outcome | None, bool]:
        """An unknown step: ask the downstream (lookup), else rely on its deduplication.
        Returns (the outcome found, or None to send under the same key; whether the lookup
        proved the effect was not done)."""
        if adapter.capabilities.lookup:
            try:
                found = await adapter.lookup(request)
            except Exception:
                log.exception("lookup_failed", adapter=adapter.name, key=request.idempotency_key)
                found = None
            if isinstance(found, Delivered):
                self._metrics.effect_counter(adapter.name, "resolved_by_lookup").inc()
                return found, False
            if isinstance(found, NotDelivered):
                return None, True  # known not done: dispatch again under the same key
        if adapter.capabilities.dedupes_by_key:
            return None, False  # the downstream deduplicates by key: re-sending is safe
        return Unknown("lookup could not tell whether the effect happened"), False

    async def _send(self, adapter: Adapter, request: EffectRequest) -> Outcome:
        if request.remaining() <= 0:
            # This process stalled past the step's deadline: it must not send late.
            return NotDelivered("dispatch deadline passed before sending")
        started = time.perf_counter()
        try:
            outcome = await adapter.dispatch(request)
        except Exception as exc:
            log.exception("adapter_raised", adapter=adapter.name, key=request.idempotency_key)
            outcome = Unknown(f"adapter raised {type(exc).__name__}")
        self._metrics.dispatch_seconds.labels(adapter.name).observe(time.perf_counter() - started)
        return outcome

    async def _record(
        self,
        keys: JobKeys,
        adapter_name: str,
        request: EffectRequest,
        dispatch_id: str,
        outcome: Outcome,
    ) -> EffectState:
        state: EffectState
        result = error = None
        if isinstance(outcome, Delivered):
            state, result = "succeeded", outcome.result
        elif isinstance(outcome, Failed):
            state, error = "failed", outcome.error
        elif isinstance(outcome, NotDelivered):
            state, error = "released", {"reason": outcome.reason}
        else:
            state, error = "unknown", {"reason": outcome.reason}
        # one request id for every try: a try whose reply was lost is not applied twice
        request_id = new_request_id()
        retry_due = self._store.redis_clock_ms() + RELAY_RETRY_MS
        for delay in (0.0, *_RECORD_BACKOFF):
            if delay:
                await asyncio.sleep(delay)
            try:
                held, _ = await self._store.record(
                    keys,
                    request.step,
                    dispatch_id,
                    state,
                    result=result,
                    error=error,
                    request_id=request_id,
                    retry_due_ms=retry_due,
                )
            except StoreUnavailable:
                continue
            if not held:
                log.warning(
                    "record_lost_step",
                    key=request.idempotency_key,
                    observed=state,
                    detail="the step was resolved or re-claimed while this dispatch ran",
                )
            self._metrics.effect_counter(adapter_name, state).inc()
            return state
        log.error("record_failed", key=request.idempotency_key, observed=state)
        self._metrics.effect_counter(adapter_name, "unrecorded").inc()
        raise OutcomeUnknown(
            f"the effect was dispatched ({state}) but Redis could not record the outcome; "
            "the step will read as unknown",
            status=504,
            state="unknown",
        )

    def _respond(
        self,
        keys: JobKeys,
        request: EffectRequest,
        adapter_name: str,
        state: EffectState,
        outcome: Outcome,
        replayed: bool,
    ) -> EffectResult:
        if isinstance(outcome, Delivered):
            return self.result(
                keys,
                request.step,
                request.generation,
                "succeeded",
                adapter_name,
                outcome.result,
                replayed=replayed,
            )
        if isinstance(outcome, Failed):
            raise EffectFailed(
                "the downstream permanently refused this effect",
                error=outcome.error,
                replayed=False,
                generation=request.generation,
            )
        if isinstance(outcome, NotDelivered):
            raise AdapterUnavailable(
                f"{adapter_name}: {outcome.reason}; nothing was delivered, the step is "
                "released and may be retried",
                state=state,
            )
        raise OutcomeUnknown(
            f"{adapter_name}: {outcome.reason}; the effect may or may not have happened",
            status=504,
            state=state,
        )

    async def drain(self, within: float, cut_short: asyncio.Event | None = None) -> int:
        """Let in-flight dispatches finish and record their outcomes, for up to ``within``
        seconds or until ``cut_short`` is set (a second SIGTERM); cancel the rest and record
        them as ``unknown``. Returns how many were cut."""
        pending = dict(self._inflight)
        if not pending:
            return 0
        stop = cut_short or asyncio.Event()
        stopper = asyncio.ensure_future(stop.wait())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        still: set[asyncio.Future[Any]] = set(pending)
        while still and not stop.is_set() and (left := deadline - loop.time()) > 0:
            done, _ = await asyncio.wait(
                [*still, stopper], timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
            still -= done
        stopper.cancel()
        for task, (keys, step, dispatch_id) in pending.items():
            if task not in still:
                continue
            task.cancel()
            try:
                await self._store.record(
                    keys,
                    step,
                    dispatch_id,
                    "unknown",
                    error={"reason": "the gateway shut down before the outcome was known"},
                )
            except StoreUnavailable:
                log.error("shutdown_record_failed", key=f"{keys.job_id}:{step}")
        return len(still)
