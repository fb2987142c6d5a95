"""The rejections budget: the seam through which the fenced scripts learn whether a tenant's
rejections may still be audited one by one, and report each rejection they answered.

The store calls it; :class:`gateway.fencing.quotas.Quotas` implements it
(``quotas.rejections_per_window``). Without one, every rejection is audited.
"""

from __future__ import annotations

from typing import Protocol

from gateway.store.keys import JobKeys

__all__ = ["RejectionBudget"]


class RejectionBudget(Protocol):
    def closed(self, tenant: str) -> bool:
        """The tenant's audited rejections of this window are used up, as far as this
        process knows without a round trip: a rejection is then answered, not audited."""

    def counter(self, tenant: str) -> str:
        """The tenant's rejections window for the fenced scripts to count themselves, as
        ``'<cap> <ttl> <key>'`` (a standalone Redis: the counter may be written by a job's
        script), or ``''``: the scripts count nothing (no cap, or a Cluster)."""

    def spent(
        self, keys: JobKeys, step: str, *, audited: bool, worker_id: str, counted: bool
    ) -> None:
        """A fenced call was rejected (``audited``: its entry is in the job's chain;
        ``counted``: its script counted it). Counted without waiting, when its script did
        not; past the cap a summary entry goes to the tenant's feed (at most one a second)."""
