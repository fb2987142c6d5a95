"""An operator's resolution of a step whose outcome is unknown: one service call for every
front end (``POST /v1/jobs/{job}/effects/{step}/resolve`` and the console's form)."""

from __future__ import annotations

from typing import Any

from gateway.core.errors import InvalidRequest
from gateway.core.records import EffectRecord
from gateway.store.keys import JobKeys
from gateway.store.store import Store

__all__ = ["resolve_step"]


async def resolve_step(
    store: Store,
    keys: JobKeys,
    step: str,
    *,
    delivered: bool,
    result: Any,
    role: str,
    by: str,
) -> EffectRecord:
    """Record what the operator established (audited in the job's chain, atomically).

    ``role`` is the key's role (the entry's ``worker_id`` is ``operator:<role>``, as it always
    was); ``by`` is who resolved it, the key's name (else its role): ``resolved_by`` of the
    record and ``by`` of the audit entry. Raises ``InvalidRequest`` for a result without
    ``delivered``, ``NotFound`` / ``EffectNotUnknown`` from the store."""
    if not delivered and result is not None:
        raise InvalidRequest("a result only goes with outcome 'delivered'")
    return await store.resolve(
        keys, step, delivered=delivered, result=result, operator=f"operator:{role}", by=by or role
    )
