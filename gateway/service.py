"""The effect flow: admit under the fence → adapter → record. No HTTP, no Redis here.

The admit and the record are one Lua script each (see :mod:`gateway.store`).
Between them the gateway holds the step with a deadline. The process re-checks
its own monotonic deadline right before sending, so a gateway that stalled
past it never sends late: the gateway can be the zombie too.

A dispatch runs in its own task, shielded from the request: a client that hangs
up does not stop the outcome from being recorded, and shutdown waits for
in-flight dispatches (:meth:`EffectService.drain`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from adapters.base import (
    Adapter,
    Delivered,
    EffectRequest,
    Failed,
    InvalidPayload,
    NotDelivered,
    Outcome,
    Unknown,
)
from gateway.errors import (
    AdapterUnavailable,
    EffectFailed,
    EffectInProgress,
    FencegateError,
    InvalidRequest,
    OutcomeUnknown,
    StoreUnavailable,
    UnknownAdapter,
)
from gateway.intents import intent_digest
from gateway.keys import JobKeys
from gateway.metrics import Metrics
from gateway.records import (
    Admitted,
    AdmitVerdict,
    EffectRecord,
    EffectResult,
    EffectState,
    InProgress,
    Queued,
    RelayClaim,
    Replay,
)
from gateway.store import Store, new_request_id

__all__ = ["EffectResult", "EffectService"]

log = structlog.get_logger("fencegate.service")

# Record retries when Redis blips right after a dispatch: the effect happened,
# so try hard to write it down before giving up to `unknown`.
_RECORD_BACKOFF = (0.05, 0.1, 0.2, 0.4, 0.8)
# A relay dispatch that ended released (known not delivered) is tried again after this.
_RELAY_RETRY_MS = 1000


class EffectService:
    """Performs effects under the fence."""

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
        self.relay_wakeup = asyncio.Event()
        self._relay_stopping = False
        # admits whose reply never came and that Redis could not be told to give up yet
        self._voids: set[tuple[JobKeys, str, str]] = set()

    def stop_relay(self) -> None:
        """Ask :meth:`relay_forever` to return at its next turn (shutdown)."""
        self._relay_stopping = True
        self.relay_wakeup.set()

    def adapter(self, name: str, tenant: str) -> Adapter:
        """The adapter, if the tenant may use it: another tenant's adapter is answered
        exactly like one that is not configured (no probing other tenants' adapters)."""
        adapter = self._adapters.get(name)
        allowed = self._adapter_tenants.get(name)
        if adapter is None or (allowed is not None and tenant not in allowed):
            raise UnknownAdapter(f"no adapter named {name!r} is configured")
        return adapter

    async def perform(
        self,
        keys: JobKeys,
        step: str,
        *,
        generation: int,
        adapter_name: str,
        operation: str,
        payload: Mapping[str, Any],
        worker_id: str | None,
        respond_async: bool = False,
    ) -> EffectResult:
        """Perform a step now, or (``respond_async``) record it for the relay and return."""
        adapter = self.adapter(adapter_name, keys.tenant)
        try:
            adapter.validate(operation, payload)
        except InvalidPayload as exc:
            raise InvalidRequest(f"payload does not fit {adapter_name}.{operation}: {exc}") from exc
        digest = intent_digest(adapter_name, operation, payload)
        started = time.monotonic()
        payload_json = json.dumps(payload, separators=(",", ":")) if respond_async else ""
        self._crash("before_admit")
        verdict = await self._admit(
            keys,
            step,
            generation=generation,
            intent_sha256=digest,
            adapter=adapter_name,
            operation=operation,
            worker_id=worker_id or "",
            resolvable=adapter.capabilities.can_resolve,
            payload_json=payload_json,
        )
        self._crash("after_admit")
        if isinstance(verdict, Queued):
            # the queue entry was written with the step; this hint only makes it prompt
            await self._store.relay_hint(keys, step, int(time.time() * 1000))
            self.relay_wakeup.set()
            return self._result(keys, step, verdict.generation, verdict.state, adapter_name)
        if isinstance(verdict, Replay):
            return self._replay(keys, step, verdict.record)
        if isinstance(verdict, InProgress):
            # Retry-After is a hint (most dispatches take milliseconds); the hold's
            # hard limit is reported separately.
            raise EffectInProgress(
                "another request is dispatching this step",
                retry_after=1,
                dispatch_deadline_in_ms=verdict.retry_after_ms,
            )
        if not isinstance(verdict, Admitted):
            self._metrics.effect_counter(adapter_name, "unknown_refused").inc()
            raise OutcomeUnknown(
                "an earlier dispatch of this step has an unknown outcome and the adapter "
                "cannot resolve it; an operator must resolve it",
                state="unknown",
            )
        # The deadline is monotonic and counted from before the admit: never later than Redis's.
        request = self._request(keys, step, generation, adapter_name, operation, payload, started)
        return await self._spawn(keys, adapter, request, verdict)

    async def _admit(
        self,
        keys: JobKeys,
        step: str,
        *,
        payload_json: str,
        **kwargs: Any,
    ) -> AdmitVerdict:
        """The admit, safe when its reply is lost.

        A script that was sent but not answered may have run. It is sent again with the same
        request id (the script answers what it answered the first time, or runs now), for up
        to the admit grace. If Redis still does not answer, a synchronous call is given up in
        Redis (:meth:`Store.void`: the admit, if it ran, held the step for a dispatch that
        never started); an async call may have been queued, and the caller is told so.
        """
        dispatch_id = new_request_id()
        try:
            return await self._store.admit(
                keys, step, payload_json=payload_json, dispatch_id=dispatch_id, **kwargs
            )
        except StoreUnavailable as exc:
            if not exc.maybe_applied:
                raise
            failure = exc
        # The admit was sent and not answered: it may have run. Once more, same request id
        # (not when it ran and only its replicas did not acknowledge: that would only wait again).
        if not failure.unacknowledged:
            await asyncio.sleep(0.05)
            try:
                return await self._store.admit(
                    keys, step, payload_json=payload_json, dispatch_id=dispatch_id, **kwargs
                )
            except StoreUnavailable:
                pass  # the first one may still have run
        if payload_json:
            raise StoreUnavailable(
                "Redis did not answer the admit: the call may have been queued for the relay. "
                "Send the same call again (it is safe): it answers the step's true state.",
                may_have_been_queued=True,
            ) from failure
        # given up: if the admit ran, it holds the step for a dispatch that never starts;
        # the relay loop voids it in Redis as soon as Redis answers again
        self._voids.add((keys, step, dispatch_id))
        self.relay_wakeup.set()
        raise StoreUnavailable(
            "Redis did not answer the admit; nothing was sent for this call. If the admit ran, "
            "the step is released as soon as Redis answers again.",
        ) from failure

    async def _void(self, keys: JobKeys, step: str, dispatch_id: str) -> bool:
        try:
            what = await self._store.void(keys, step, dispatch_id)
        except StoreUnavailable:
            return False
        log.warning("admit_given_up", key=f"{keys.job_id}:{step}", found=what)
        return True

    async def retry_voids(self) -> None:
        """Give up, once Redis answers again, the admits whose reply never came."""
        for item in list(self._voids):
            if await self._void(*item):
                self._voids.discard(item)

    def _spawn(
        self, keys: JobKeys, adapter: Adapter, request: EffectRequest, admitted: Admitted
    ) -> asyncio.Future[EffectResult]:
        """Run a dispatch in its own task, shielded from the caller, known to ``drain``."""
        task = asyncio.create_task(self._dispatch(keys, adapter, request, admitted))
        self._inflight[task] = (keys, request.step, admitted.dispatch_id)
        task.add_done_callback(lambda t: self._inflight.pop(t, None))
        return asyncio.shield(task)

    def _request(
        self,
        keys: JobKeys,
        step: str,
        generation: int,
        adapter_name: str,
        operation: str,
        payload: Mapping[str, Any],
        started: float | None = None,
    ) -> EffectRequest:
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
        key = f"{keys.job_id}:{step}"
        return f"{keys.tenant}/{key}" if adapter_name in self._tenant_keyed else key

    def _result(
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

    def _replay(self, keys: JobKeys, step: str, record: EffectRecord) -> EffectResult:
        self._metrics.effect_counter(record.adapter, "replayed").inc()
        if record.state == "failed":
            raise EffectFailed(
                "the downstream permanently refused this effect (recorded)",
                error=record.error,
                replayed=True,
                generation=record.generation,
            )
        return self._result(
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
        retry_due = int(time.time() * 1000) + _RELAY_RETRY_MS
        for delay in (0.0, *_RECORD_BACKOFF):
            if delay:
                await asyncio.sleep(delay)
            try:
                held, _ = await self._store.record(
                    keys, request.step, dispatch_id, state, result=result, error=error,
                    request_id=request_id, retry_due_ms=retry_due,
                )  # fmt: skip
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
            return self._result(
                keys, request.step, request.generation, "succeeded", adapter_name, outcome.result,
                replayed=replayed,
            )  # fmt: skip
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

    # -- the async relay -------------------------------------------------------

    async def relay_forever(
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

        Stopped by :meth:`stop_relay` (checked every turn), not only by cancellation:
        a cancellation can be swallowed on its way (Python 3.11's ``wait_for`` turned
        one that landed as it timed out into ``TimeoutError``; an ``asyncio.Condition``
        waiter re-acquires its lock before it lets a cancellation through), and the
        app's cleanup must never wait forever for this loop. At the stop, steps being
        claimed get ``stop_grace`` seconds to finish (a claim cut off may have run: its step
        would then read ``unknown`` with nothing sent); their dispatches are the drain's."""
        sweeper = asyncio.create_task(self._sweep_forever(sweep_seconds))
        running: dict[str, asyncio.Task[bool]] = {}  # queue member -> its task
        per: dict[str, int] = {}  # tenant -> steps running

        def finished(member: str, tenant: str, _task: asyncio.Task[bool]) -> None:
            running.pop(member, None)
            per[tenant] -= 1
            self.relay_wakeup.set()

        try:
            while not self._relay_stopping:
                started = 0
                try:
                    if self._voids:
                        await self.retry_voids()
                    due = await self._store.relay_due(int(time.time() * 1000), per_tenant)
                except StoreUnavailable:
                    due = []
                for keys, step, _ in due:
                    member = keys.member(step)
                    if member in running or per.get(keys.tenant, 0) >= per_tenant:
                        continue
                    task = asyncio.create_task(self._relay_one(keys, step))
                    running[member] = task
                    per[keys.tenant] = per.get(keys.tenant, 0) + 1
                    task.add_done_callback(functools.partial(finished, member, keys.tenant))
                    started += 1
                if not started:
                    self.relay_wakeup.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(interval):
                            await self.relay_wakeup.wait()
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
        while not self._relay_stopping:
            try:
                found = await self._store.sweep(int(time.time() * 1000))
            except StoreUnavailable:
                found = 0
            except Exception:
                log.exception("relay_sweep_failed")
                found = 0
            if found:
                self.relay_wakeup.set()
            await asyncio.sleep(every)

    async def _claim(self, keys: JobKeys, step: str) -> RelayClaim | int | str | None:
        """The relay's claim, safe when its reply is lost (sent again with the same request
        id; given up in Redis if that fails too). None: no verdict, look again later."""
        dispatch_id = new_request_id()
        maybe = False  # an attempt may have run: then the claim must be given up in Redis
        for delay in (0.0, 0.05, 0.2):
            if delay:
                await asyncio.sleep(delay)
            try:
                return await self._store.relay_claim(keys, step, dispatch_id)
            except StoreUnavailable as exc:
                maybe = maybe or exc.maybe_applied
                if not maybe:
                    return None
                if exc.unacknowledged:  # it ran; its replicas lag: sending again only waits
                    break
        if not await self._void(keys, step, dispatch_id):
            self._voids.add((keys, step, dispatch_id))
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
            if claim in ("superseded", "lease_expired", "cancelled", "unbound"):
                self._metrics.relay_not_sent.labels(claim).inc()
                log.info("relay_not_sent", key=f"{keys.job_id}:{step}", why=claim)
            await self._store.relay_unhint(keys, step)
            return True
        if isinstance(claim, int):  # someone is dispatching it: look again after its deadline
            await self._store.relay_hint(keys, step, claim + 50)
            return True
        adapter = self._adapters.get(claim.adapter)
        allowed = self._adapter_tenants.get(claim.adapter)
        if adapter is None or (allowed is not None and keys.tenant not in allowed):
            log.error("relay_unknown_adapter", adapter=claim.adapter, key=f"{keys.job_id}:{step}")
            reason = {"reason": f"adapter {claim.adapter!r} is not configured"}
            await self._store.record(keys, step, claim.dispatch_id, "failed", error=reason)
            await self._store.relay_unhint(keys, step)
            return True
        request = self._request(
            keys, step, claim.generation, claim.adapter, claim.operation, claim.payload, started
        )
        admitted = Admitted(claim.dispatch_id, claim.generation, claim.deadline_ms, resolving=False)
        try:
            await self._spawn(keys, adapter, request, admitted)
        except AdapterUnavailable:  # released, still queued: try again later (re-claimed)
            await self._store.relay_hint(keys, step, int(time.time() * 1000) + _RELAY_RETRY_MS)
            return True
        except FencegateError:
            pass  # failed or unknown: recorded; nothing more for the relay to do
        await self._store.relay_unhint(keys, step)
        return True

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
                    keys, step, dispatch_id, "unknown",
                    error={"reason": "the gateway shut down before the outcome was known"},
                )  # fmt: skip
            except StoreUnavailable:
                log.error("shutdown_record_failed", key=f"{keys.job_id}:{step}")
        return len(still)
