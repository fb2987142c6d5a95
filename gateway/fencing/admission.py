"""The effect service's admission hook: a guard consulted around the fence's decision.

The fence decides in one script (``admit-8``); an admission hook never decides instead of
it. It is asked twice per effect call:

* :meth:`Admission.before` — before the script runs. It answers a :class:`Gate`: which of
  the tenant's limits are used up (``closed``, passed to the script, which refuses only the
  calls that would pin, queue or claim a step against them — a replay, an "in progress"
  answer or a rejection is answered as without the hook). It may raise a
  :class:`~gateway.core.errors.FencegateError` only for a refusal that holds whatever the
  verdict would be.
* :meth:`Admission.make_room` — only when the gate asked the script to charge something
  itself (``Gate.charges``: an async payload's bytes, counted in the deciding script, so the
  call pays no round trip of its own for them) and the script found it over the cap: the hook
  makes what room it can, and the call is admitted once more with the same gate (the script
  checks the cap again, atomically; a second refusal writes nothing).
* :meth:`Admission.after` — with the verdict (or the error the admit raised), once, always.
  It charges what the verdict consumed, and turns an
  :class:`~gateway.core.records.OverQuota` verdict into its problem (it must raise then).

The service has no hook when nothing is configured (``admission is None``): then nothing is
built or called. :class:`gateway.fencing.quotas.Quotas` is the one implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from gateway.core.records import AdmitVerdict
from gateway.store.keys import JobKeys

__all__ = ["Admission", "AdmitCall", "Gate"]


@dataclass(frozen=True, slots=True)
class AdmitCall:
    """One effect call about to be admitted."""

    keys: JobKeys
    step: str
    worker_id: str
    adapter: str
    payload_bytes: int  # the async payload's size; 0 for a synchronous call


@dataclass(frozen=True, slots=True)
class Gate:
    """What :meth:`Admission.before` decided; handed back to :meth:`Admission.after`."""

    # the tenant's used-up quotas, letters: 'e' no new dispatch or queue entry, 'p' no new
    # queue entry (the payload is then not sent to Redis), both admit-8's ARGV[19]; 'r'
    # rejections answered but not audited (the fenced call's ARGV[8], includes/fence)
    closed: str = ""
    hold: Any = None  # the hook's own state between the two calls (a payload reservation)
    # what the script charges itself, against the tenant's caps: a payload it queues, an
    # effect call it claims or queues (admit-8's ARGV[20] to ARGV[28]); () none
    charges: tuple[str, ...] = ()


OPEN = Gate()


class Admission(Protocol):
    async def before(self, call: AdmitCall) -> Gate: ...

    async def make_room(self, call: AdmitCall) -> None: ...

    async def after(
        self, call: AdmitCall, gate: Gate, outcome: AdmitVerdict | BaseException
    ) -> None: ...
