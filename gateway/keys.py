"""Every Redis key name fencegate uses, built in one place.

All keys of one job share the hash tag ``{<tenant>/<job_id>}``, so every script
touches exactly one slot and runs unchanged on Redis Cluster. Neither tenant nor
job id can contain ``{``, ``}`` or ``:`` (see :data:`gateway.settings.NAME_RE`),
so the tag is unambiguous.

======================  =====================================================
``fg:{t/j}:job``        hash: fence, lease_ms, lease_exp, cancelled. No TTL, ever.
``fg:{t/j}:fx:<step>``  hash: one effect record. TTL = retention.
``fg:{t/j}:steps``      set of the job's step names (for the job view). TTL = retention.
``fg:{t/j}:audit``      stream: the job's rejections, written atomically by the
                        deciding script. TTL = retention.
``fg:audit:<t>``        stream: the tenant-wide audit feed (a copy of each entry,
                        appended right after the deciding script), trimmed by age.
``fg:marker``           the durability marker written by ``fencegate init``.
======================  =====================================================
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MARKER", "JobKeys", "audit_feed"]

MARKER = "fg:marker"
PREFIX = "fg:"


@dataclass(frozen=True, slots=True)
class JobKeys:
    """The keys of one job of one tenant."""

    tenant: str
    job_id: str

    @property
    def tag(self) -> str:
        return "{" + self.tenant + "/" + self.job_id + "}"

    @property
    def job(self) -> str:
        return f"fg:{self.tag}:job"

    @property
    def steps(self) -> str:
        return f"fg:{self.tag}:steps"

    @property
    def audit(self) -> str:
        return f"fg:{self.tag}:audit"

    def effect(self, step: str) -> str:
        return f"fg:{self.tag}:fx:{step}"


def audit_feed(tenant: str) -> str:
    return f"fg:audit:{tenant}"
