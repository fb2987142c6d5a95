"""The audit vocabulary: every ``reason`` an audit entry can carry, defined once.

The Lua scripts write these strings into the job's audit stream (``reject('…')`` and the
``'reason', '…'`` fields of ``audit()``), the gateway writes the rest (a bad token, a
quota, an operator's resolution); the API's audit listing, the rejection metric and the
console's reason filter all take their values from here. ``tests/core/test_reasons.py``
reads every script and fails when one can write a reason missing here.

- :data:`REFUSALS`: a call refused under the fence (409/422/400/429), each the problem
  ``code`` of the error raised for it, plus ``superseded`` (a queued step of an older
  generation that the new one replaced, or the relay found below the fence: nothing sent).
- :data:`RESOLUTIONS`: an operator's finding for an ``unknown`` step.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

__all__ = [
    "REASONS",
    "REFUSALS",
    "RESOLUTIONS",
    "Reason",
    "resolution",
]

Reason = Literal[
    "stale_generation",
    "unregistered_generation",
    "lease_expired",
    "job_cancelled",
    "job_completed",
    "generation_regression",
    "generation_exhausted",
    "intent_mismatch",
    "superseded",
    "bad_token",
    "quota_exceeded",
    "operator_resolved_delivered",
    "operator_resolved_not_delivered",
]

REASONS: Final[tuple[str, ...]] = get_args(Reason)
RESOLUTIONS: Final[tuple[str, ...]] = tuple(r for r in REASONS if r.startswith("operator_"))
REFUSALS: Final[tuple[str, ...]] = tuple(r for r in REASONS if r not in RESOLUTIONS)


def resolution(delivered: bool) -> str:
    """The reason of an operator's resolution (``resolve-6.lua`` writes the same string)."""
    return "operator_resolved_delivered" if delivered else "operator_resolved_not_delivered"
