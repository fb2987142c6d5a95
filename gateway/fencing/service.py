"""The effect flow: admit under the fence → adapter → record. No HTTP, no Redis here.

The admit and the record are one Lua script each (see :mod:`gateway.store.store`).
Between them the gateway holds the step with a deadline. The process re-checks
its own monotonic deadline right before sending, so a gateway that stalled
past it never sends late: the gateway can be the zombie too.

:class:`EffectService` decides a call's admit (re-sent when its reply is lost, given up
when Redis does not answer) and holds its collaborators, each owning its own state:

* :attr:`~EffectService.dispatcher` (:class:`~gateway.fencing.dispatch.Dispatcher`): the
  adapters, each dispatch in its own task shielded from the request (a client that hangs up
  does not stop the outcome from being recorded), the record, the pending voids, the drain
  at shutdown (:meth:`Dispatcher.drain`);
* :attr:`~EffectService.relay` (:class:`~gateway.fencing.relay.Relay`): the async relay's
  loop and sweep (:meth:`Relay.run`, :meth:`Relay.stop`), woken when a call is queued or a
  void is left pending;
* :attr:`~EffectService.admission` (:class:`~gateway.fencing.admission.Admission`, or None):
  the hook consulted around every admit.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from adapters.base import Adapter, InvalidPayload
from gateway.core.errors import (
    EffectInProgress,
    InvalidRequest,
    OutcomeUnknown,
    StoreUnavailable,
)
from gateway.core.intents import intent_digest
from gateway.core.records import (
    Admitted,
    AdmitVerdict,
    EffectResult,
    InProgress,
    OverQuota,
    Queued,
    Replay,
)
from gateway.fencing.admission import OPEN, Admission, AdmitCall, Gate
from gateway.fencing.dispatch import Dispatcher
from gateway.fencing.relay import Relay
from gateway.runtime.metrics import Metrics
from gateway.store.keys import JobKeys
from gateway.store.store import Store, new_request_id

__all__ = ["EffectResult", "EffectService"]

log = structlog.get_logger("fencegate.service")


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
        admission: Admission | None = None,
    ) -> None:
        self._store = store
        self._metrics = metrics
        # Chaos testing only (serve --chaos-crash-at): may SIGKILL this process at a point.
        self._crash = crash_hook or (lambda point: None)
        self.dispatcher = Dispatcher(
            store,
            adapters,
            metrics,
            dispatch_timeout_seconds=dispatch_timeout_seconds,
            tenant_keyed=tenant_keyed,
            adapter_tenants=adapter_tenants,
            crash_hook=crash_hook,
        )
        self.relay = Relay(store, self.dispatcher, metrics)
        # consulted around every effect call's admit (gateway.fencing.admission); None: nothing
        self.admission = admission

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
        by: str = "",
    ) -> EffectResult:
        """Perform a step now, or (``respond_async``) record it for the relay and return.
        ``by``: who calls (the key's name, else its role), recorded with an implicit
        registration."""
        adapter = self.dispatcher.adapter(adapter_name, keys.tenant)
        try:
            adapter.validate(operation, payload)
        except InvalidPayload as exc:
            raise InvalidRequest(f"payload does not fit {adapter_name}.{operation}: {exc}") from exc
        digest = intent_digest(adapter_name, operation, payload)
        return await self._perform(
            keys,
            step,
            adapter,
            adapter_name,
            generation=generation,
            operation=operation,
            payload=payload,
            digest=digest,
            worker_id=worker_id,
            respond_async=respond_async,
            by=by,
        )

    async def perform_with(
        self,
        keys: JobKeys,
        step: str,
        adapter: Adapter,
        *,
        generation: int,
        operation: str,
        payload: Mapping[str, Any],
        intent_sha256: str,
        worker_id: str | None,
        by: str = "",
    ) -> EffectResult:
        """Perform a step now through an adapter the caller holds, under the intent digest the
        caller computed: the proxy's upstreams (``proxy:<name>``, gateway.proxy), which no
        effect call can name. The same admit, dispatch and record as :meth:`perform`."""
        return await self._perform(
            keys,
            step,
            adapter,
            adapter.name,
            generation=generation,
            operation=operation,
            payload=payload,
            digest=intent_sha256,
            worker_id=worker_id,
            respond_async=False,
            by=by,
        )

    async def _perform(
        self,
        keys: JobKeys,
        step: str,
        adapter: Adapter,
        adapter_name: str,
        *,
        generation: int,
        operation: str,
        payload: Mapping[str, Any],
        digest: str,
        worker_id: str | None,
        respond_async: bool,
        by: str,
    ) -> EffectResult:
        started = time.monotonic()
        payload_json = json.dumps(payload, separators=(",", ":")) if respond_async else ""
        self._crash("before_admit")
        admission, gate = self.admission, OPEN
        if admission is not None:
            call = AdmitCall(keys, step, worker_id or "", adapter_name, len(payload_json))
            gate = await admission.before(call)
        fields: dict[str, Any] = {
            "generation": generation,
            "intent_sha256": digest,
            "adapter": adapter_name,
            "operation": operation,
            "worker_id": worker_id or "",
            "resolvable": adapter.capabilities.can_resolve,
            "by": by,
        }
        try:
            verdict = await self._admit(
                keys, step, payload_json=_sent(payload_json, gate), **_gated(gate), **fields
            )
            if (
                admission is not None
                and gate.charges
                and isinstance(verdict, OverQuota)
                and verdict.quota == "payload_bytes"
            ):  # over the cap in the script: once more, after the hook made what room it can
                await admission.make_room(call)
                verdict = await self._admit(
                    keys, step, payload_json=_sent(payload_json, gate), **_gated(gate), **fields
                )
        except BaseException as exc:
            if admission is not None:
                await admission.after(call, gate, exc)
            raise
        if admission is not None:
            await admission.after(call, gate, verdict)  # raises for an OverQuota verdict
        self._crash("after_admit")
        if isinstance(verdict, Queued):
            # the queue entry was written with the step; the hint only makes it prompt
            await self._store.relay_queued(keys, step, self._store.redis_clock_ms())
            self.relay.wake()
            return self.dispatcher.result(
                keys, step, verdict.generation, verdict.state, adapter_name
            )
        if isinstance(verdict, Replay):
            return self.dispatcher.replay(keys, step, verdict.record)
        if isinstance(verdict, InProgress):
            # Retry-After is a hint (most dispatches take milliseconds); the hold's
            # hard limit is reported separately.
            raise EffectInProgress(
                "another request is dispatching this step",
                retry_after=1,
                dispatch_deadline_in_ms=verdict.retry_after_ms,
            )
        if isinstance(verdict, OverQuota):  # only with a hook, and it raised
            raise AssertionError("an OverQuota verdict without an admission hook")
        if not isinstance(verdict, Admitted):
            self._metrics.effect_counter(adapter_name, "unknown_refused").inc()
            raise OutcomeUnknown(
                "an earlier dispatch of this step has an unknown outcome and the adapter "
                "cannot resolve it; an operator must resolve it",
                state="unknown",
            )
        # The deadline is monotonic and counted from before the admit: never later than Redis's.
        request = self.dispatcher.request(
            keys, step, generation, adapter_name, operation, payload, started
        )
        return await self.dispatcher.spawn(keys, adapter, request, verdict)

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
        never started); an async call may have been queued, and the caller is told so. A
        request cancelled meanwhile gives a synchronous admit up the same way.
        """
        dispatch_id = new_request_id()
        try:
            return await self._admit_or_give_up(keys, step, payload_json, dispatch_id, kwargs)
        except asyncio.CancelledError:
            # the request was cancelled (a client gone, a shutdown) while the admit was on its
            # way: if it ran, it holds the step for a dispatch that never starts. A sync call
            # is given up as for a lost reply (an async one stays queued for the relay); the
            # void's mark outlives any copy of the admit still on the wire (void-5).
            if not payload_json:
                self.dispatcher.void_later(keys, step, dispatch_id, None)
                self.relay.wake()
            raise

    async def _admit_or_give_up(
        self,
        keys: JobKeys,
        step: str,
        payload_json: str,
        dispatch_id: str,
        kwargs: dict[str, Any],
    ) -> AdmitVerdict:
        try:
            return await self._store.admit(
                keys, step, payload_json=payload_json, dispatch_id=dispatch_id, **kwargs
            )
        except StoreUnavailable as exc:
            if not exc.maybe_applied:
                raise
            failure = exc
        # The admit was sent and not answered: it may have run. Once more, same request id and
        # the same bound (not when it ran and only its replicas did not acknowledge: that would
        # only wait again). No copy of it runs after that bound (admit-8 ARGV[18]).
        run_before = failure.run_before_ms
        if not failure.unacknowledged:
            await asyncio.sleep(0.05)
            try:
                return await self._store.admit(
                    keys,
                    step,
                    payload_json=payload_json,
                    dispatch_id=dispatch_id,
                    run_before_ms=run_before,
                    **kwargs,
                )
            except StoreUnavailable as again:  # the first one may still have run
                run_before = max(run_before or 0, again.run_before_ms or 0) or None
        if payload_json:
            raise StoreUnavailable(
                "Redis did not answer the admit: the call may have been queued for the relay. "
                "Send the same call again (it is safe): it answers the step's true state.",
                may_have_been_queued=True,
            ) from failure
        # given up: if the admit ran, it holds the step for a dispatch that never starts;
        # the relay loop voids it in Redis as soon as Redis answers again
        self.dispatcher.void_later(keys, step, dispatch_id, run_before)
        self.relay.wake()
        raise StoreUnavailable(
            "Redis did not answer the admit; nothing was sent for this call. If the admit ran, "
            "the step is released as soon as Redis answers again.",
        ) from failure


def _sent(payload_json: str, gate: Gate) -> str:
    """The payload the admit is sent: a placeholder when it would only be refused there (no
    new queue entry: the tenant's payload bytes are used up)."""
    return "-" if "p" in gate.closed else payload_json


def _gated(gate: Gate) -> dict[str, Any]:
    """The admit's arguments from the admission's gate."""
    return {"closed": gate.closed, "charges": gate.charges}
