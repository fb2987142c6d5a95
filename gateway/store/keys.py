"""Every Redis key name fencegate uses, built in one place.

All keys of one job share the hash tag ``{<tenant>/<job_id>}``, so every script
touches exactly one slot and runs unchanged on Redis Cluster. Neither tenant nor
job id can contain ``{``, ``}`` or ``:`` (see :data:`gateway.core.names.NAME`),
so the tag is unambiguous.

======================  =====================================================
``fg:{t/j}:job``        hash: fence, lease_ms, lease_exp, cancelled. No TTL, ever.
``fg:{t/j}:fx:<step>``  hash: one effect record. TTL = retention.
``fg:{t/j}:steps``      set of the job's step names (for the job view). TTL = retention.
``fg:{t/j}:audit``      stream: the job's rejections, written atomically by the
                        deciding script. TTL = retention.
``fg:{t/j}:ckpt``       hash: the job's checkpoints, ``<name>`` → JSON ``{generation,
                        value, worker, at_ms}``. TTL = retention.
``fg:{t/j}:outputs``    hash: the job's attempt-scoped outputs, ``<generation>/<name>`` →
                        JSON ``{state: staged|recorded, key, size, sha256, content_type,
                        staged_ms, recorded_ms, presigned}`` (written by
                        gateway.fencing.outputs; no TTL). The job hash's ``completed``
                        field holds the promoted ones.
``fg:audit:<t>``        stream: the tenant-wide audit feed (a copy of each entry,
                        appended right after the deciding script), trimmed by age.
``fg:marker``           the durability marker written by ``fencegate init``.
``fg:{t/j}:req:<id>``   a deciding script's remembered reply, for a re-send of the same
                        request (TTL: ``redis.request_memory_seconds``).
``fg:rq:{<s>}``         the relay queue of one slot: sorted set of ``[tenant, job, step]``
                        scored by due time (ms). Written by the admit that queues the
                        step, atomically with it; left by the outcome. The truth.
``fg:relay:t:<t>``      per tenant: a hint of the same members, read by the relay
                        (fair across tenants): written by the same scripts on a
                        standalone Redis (includes/relayq); on a Cluster after the
                        script, where a hint lost in a crash is found again by the
                        sweep of every slot queue.
``fg:relay:tenants``    set of the tenants that have hints.
``fg:nd:{<s>}``         the attention index of one slot (``nd``: "needs a decision";
                        the code's name is attention, :mod:`gateway.store.attention`,
                        the ``fg:nd:`` prefix stays: it names stored data): sorted set
                        of ``[tenant, job, step]``; a step whose outcome is unknown
                        (score: when it became unknown) or that is dispatching
                        (score: its deadline). Written by every script that changes
                        a step's state, atomically with it. The truth.
``fg:nd:t:<t>``         per tenant: the attention hint, the entries of every slot that
                        need a decision now (unknown, or dispatching past the
                        deadline); written after the verdict, rebuilt by the
                        reconciler from the slots' indexes. Read by
                        ``GET /v1/attention`` and the console.
``fg:nd:tenants``       set of the tenants that have attention hints.
``fg:nd:turn``          the gateway that reconciles the attention hints this interval
                        (SET NX PX).
``fg:chain:t:<t>``      per tenant: the summary of the last audit chain check (JSON).
``fg:con:rv:<sid>``     a console session logged out (gateway.store.consolestate); TTL =
                        what was left of its cookie's life.
``fg:con:lf:<peer>``    failed console logins of one peer in the current window (TTL).
``fg:con:lf``           failed console logins of every peer in the current window (TTL).
``fg:epoch``            a counter every gateway bumps; a Redis whose epoch is below
                        the one a gateway last saw came back from an older snapshot.
``fg:quarantine``       why Redis was quarantined (JSON: when, by which gateway, the
                        slot and counters): written with the quarantine, read by
                        every gateway's ``/readyz`` and logs; removed by init.
``fg:witness:<b>:<h>``  one counter per data dir ``<h>`` (a host's gateways) and
                        baseline ``<b>`` (the marker's id): only that data dir's
                        processes raise it, each time comparing the answer with
                        the highest they recorded (see gateway.store.link);
                        TTL 7 days from its data dir's last tick.
``fg:quota:{<t>}:…``    a tenant's quota counters (windows, held payloads, checkpoints,
                        outputs) and a reserve's or settle's re-send memory
                        (:mod:`gateway.store.quota_counters`,
                        :mod:`gateway.store.output_records`).
``fg:marker:{<s>}``     one marker per cluster slot (16384), also written by
                        init. Every deciding script checks the marker of its
                        own job's slot, so a wiped (or partly lost) Redis fails
                        closed atomically, without a script touching a second
                        slot. ``<s>`` is a short string whose CRC16 lands in
                        that slot (:func:`slot_tags`).
======================  =====================================================
"""

from __future__ import annotations

import functools
import json
from binascii import crc_hqx
from dataclasses import dataclass

__all__ = [
    "ATTENTION_TENANTS",
    "ATTENTION_TURN",
    "EPOCH",
    "MARKER",
    "QUARANTINE",
    "RELAY_TENANTS",
    "SLOTS",
    "JobKeys",
    "attention_hint",
    "attention_index",
    "audit_feed",
    "chain_check",
    "console_failures",
    "console_revoked",
    "key_slot",
    "quota_prefix",
    "relay_hint",
    "relay_queue",
    "slot_marker",
    "slot_tags",
    "witness",
]

MARKER = "fg:marker"
QUARANTINE = "fg:quarantine"
EPOCH = "fg:epoch"  # bumped by every gateway; also recorded in its state file
RELAY_TENANTS = "fg:relay:tenants"  # set: tenants with relay hints
# the attention index ("needs a decision"): its keys are fg:nd:*, a prefix kept (stored data)
ATTENTION_TENANTS = "fg:nd:tenants"  # set: tenants with attention hints
ATTENTION_TURN = "fg:nd:turn"  # which gateway reconciles the hints this interval (SET NX PX)
PREFIX = "fg:"
SLOTS = 16384


def key_slot(tag: str) -> int:
    """The Redis Cluster slot of a hash tag: CRC16-XMODEM (``crc_hqx`` with 0) mod 16384."""
    return crc_hqx(tag.encode(), 0) % SLOTS


@functools.cache
def slot_tags() -> tuple[str, ...]:
    """For every slot, a short tag that hashes to it (about 0.1 s to build, once)."""
    tags: list[str | None] = [None] * SLOTS
    found = i = 0
    while found < SLOTS:
        candidate = format(i, "x")
        slot = key_slot(candidate)
        if tags[slot] is None:
            tags[slot] = candidate
            found += 1
        i += 1
    return tuple(t for t in tags if t is not None)


def witness(baseline: str, host: str) -> str:
    """A data dir's witness counter in Redis (see :meth:`gateway.store.link.RedisLink.witness`)."""
    return f"fg:witness:{baseline}:{host}"


def slot_marker(slot: int) -> str:
    return "fg:marker:{" + slot_tags()[slot] + "}"


def relay_queue(slot: int) -> str:
    """The relay queue of one slot (written by the scripts of that slot's jobs)."""
    return "fg:rq:{" + slot_tags()[slot] + "}"


def relay_hint(tenant: str) -> str:
    return "fg:relay:t:" + tenant


def attention_index(slot: int) -> str:
    """The attention index ("needs a decision") of one slot, ``fg:nd:{<s>}`` (written by the
    scripts of its jobs)."""
    return "fg:nd:{" + slot_tags()[slot] + "}"


def attention_hint(tenant: str) -> str:
    """The tenant's attention hint, ``fg:nd:t:<t>`` (written by the store after a verdict)."""
    return "fg:nd:t:" + tenant


def chain_check(tenant: str) -> str:
    return "fg:chain:t:" + tenant


def console_revoked(session_id: str) -> str:
    return "fg:con:rv:" + session_id


def console_failures(peer: str | None) -> str:
    """Failed console logins of ``peer`` (None: of every peer)."""
    return "fg:con:lf" if peer is None else "fg:con:lf:" + peer


@dataclass(frozen=True, slots=True)
class JobKeys:
    """The keys of one job of one tenant."""

    tenant: str
    job_id: str

    @property
    def tag(self) -> str:
        return "{" + self.tenant + "/" + self.job_id + "}"

    @property
    def slot(self) -> int:
        return key_slot(self.tenant + "/" + self.job_id)

    @property
    def marker(self) -> str:
        """The durability marker in this job's slot."""
        return slot_marker(self.slot)

    @property
    def relayq(self) -> str:
        """The relay queue in this job's slot."""
        return relay_queue(self.slot)

    @property
    def attention(self) -> str:
        """The attention index ("needs a decision", ``fg:nd:{<s>}``) in this job's slot."""
        return attention_index(self.slot)

    def member(self, step: str) -> str:
        """This step's member in the relay queue and the tenant's hint: the compact JSON array
        ``[tenant, job, step]`` (names need no escaping: written directly, else by json)."""
        joined = self.tenant + self.job_id + step
        if joined.isascii() and joined.isprintable() and '"' not in joined and "\\" not in joined:
            return '["' + self.tenant + '","' + self.job_id + '","' + step + '"]'
        return json.dumps([self.tenant, self.job_id, step], separators=(",", ":"))

    def req(self, request_id: str) -> str:
        return f"fg:{self.tag}:req:{request_id}"

    @property
    def job(self) -> str:
        return f"fg:{self.tag}:job"

    @property
    def steps(self) -> str:
        return f"fg:{self.tag}:steps"

    @property
    def audit(self) -> str:
        return f"fg:{self.tag}:audit"

    @property
    def ckpt(self) -> str:
        return f"fg:{self.tag}:ckpt"

    @property
    def outputs(self) -> str:
        return f"fg:{self.tag}:outputs"

    def effect(self, step: str) -> str:
        return f"fg:{self.tag}:fx:{step}"


def audit_feed(tenant: str) -> str:
    return f"fg:audit:{tenant}"


def quota_prefix(tenant: str) -> str:
    """The prefix of a tenant's quota counters (``fg:quota:{<tenant>}``: the tenant's slot)."""
    return "fg:quota:{" + tenant + "}"
