"""The orphan sweeper: deletes output objects that can never be promoted, counts the rest.

It lists the object store (every key ``<tenant>/<job>/g<gen>/<name>`` under the prefix,
and the local store's staging files ``<key>#<n>`` that its listing hides: a put killed
half-way leaves one, :func:`classify_staging`),
reads each job's fence, cancel flag, completion and outputs hash from Redis, and gives
every object one class:

==============  ==================================================  ============
reason          the object                                          deleted?
==============  ==================================================  ============
(kept)          the promoted output of a completed job; a recorded  never
                or in-flight output of the current generation
``completed``   of a completed job, not the promoted one            after grace
``cancelled``   of a cancelled job                                  after grace
``stale``       of a generation below the fence                     after grace
``unrecorded``  of the current generation, staged and never         counted only
                recorded (a crash between write and record)
``unknown``     Redis knows no fence for its job or generation      counted only
==============  ==================================================  ============

A pre-signed URL's staging object (``<tenant>/<job>/g<gen>/.signed/<upload>/<name>``,
:func:`classify_signed`) is never promoted itself: the completion copies it to the output's
key and deletes it. It is judged like any object of its generation (``completed``,
``cancelled``, ``stale`` whatever its URL may still do: the next sweep deletes what the URL
writes again), and of the current generation it is kept while its URL may still write
(:func:`gateway.fencing.output_ledger.url_valid_until`), ``unrecorded`` after that (its
completion may still copy it; a completion or a moved fence makes it deletable).

Only the first three classes are deleted, and they are terminal: a completion, a
cancellation and a fence never go back (a Redis that lost data fails closed: a missing
durability marker stops the sweep), so once an object is in one of them no later
decision can make it promotable. That is why several gateways may sweep at the same
time without a lease: each deletes only what every one of them would delete, deletes are
idempotent, and an object written after the listing is simply found by the next sweep.
``unrecorded`` objects are not deleted while their generation is current, because that
generation may retry and write the same key right now; the moment the fence moves past
it or the job completes or is cancelled, they fall into a deletable class. ``unknown``
ones are left for an operator (docs/outputs.md). Every orphan is either deleted or
counted in ``fencegate_output_orphans``.

What it deletes leaves the tenant's output quotas (:class:`gateway.fencing.output_ledger.
OutputLedger`): an object's charge and the reservation of the upload its entry names, a
staging file's upload reservation, and a pre-signed URL's reservation once the URL has
expired (before that, the URL may write again).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import structlog

from gateway.core.errors import StoreUnavailable
from gateway.core.records import OutputRecord
from gateway.fencing.output_ledger import url_valid_until
from gateway.fencing.outputs import OutputService
from gateway.objects import (
    ObjectInfo,
    ObjectStoreError,
    parse_output_key,
    parse_signed_key,
    staged_key,
)
from gateway.runtime.metrics import Metrics
from gateway.store.keys import JobKeys

__all__ = ["DELETED_REASONS", "REASONS", "Orphan", "SweepReport", "sweep"]

log = structlog.get_logger("fencegate.outputs.sweep")

REASONS = ("completed", "cancelled", "stale", "unrecorded", "unknown")
DELETED_REASONS = frozenset({"completed", "cancelled", "stale"})


@dataclass(frozen=True, slots=True)
class Orphan:
    key: str
    reason: str
    size: int
    age_seconds: float
    deletable: bool  # its class is deletable and it is older than the grace
    upload: str = ""  # the upload its output's entry names, if the entry is of this key


@dataclass
class SweepReport:
    orphans: list[Orphan] = field(default_factory=list)
    deleted: list[Orphan] = field(default_factory=list)
    kept: int = 0  # promoted, recorded or in-flight objects
    foreign: int = 0  # keys under the prefix that no output of fencegate's could have
    failed: int = 0  # deletes the store refused (tried again next sweep)

    def by_reason(self) -> dict[str, tuple[int, int]]:
        out = {reason: (0, 0) for reason in REASONS}
        for o in self.orphans:
            n, b = out[o.reason]
            out[o.reason] = (n + 1, b + o.size)
        return out


@dataclass(frozen=True, slots=True)
class _JobState:
    marker: bool
    fence: int | None
    cancelled: bool
    completed: dict[str, Any] | None
    entries: dict[str, OutputRecord]


async def _job_state(outputs: OutputService, keys: JobKeys) -> _JobState:
    job = await outputs.records.job(keys)
    return _JobState(
        marker=job.marker,
        fence=job.fence.fence,
        cancelled=job.fence.cancelled,
        completed=json.loads(job.fence.completed) if job.fence.completed else None,
        entries={f: OutputRecord.parse(f, v) for f, v in job.entries.items()},
    )


def classify(gen: int, name: str, info: ObjectInfo, job: _JobState, now_ms: int) -> str | None:
    """The orphan reason of one object, or None when it is kept (module docstring)."""
    if not job.marker:
        return "unknown"  # the slot lost its data: decide nothing
    if job.completed is not None:
        promoted = (job.completed.get("outputs") or {}).get(name) or {}
        if int(promoted.get("generation", -1)) == gen and promoted.get("key") == info.key:
            return None
        return "completed"
    if (reason := _past(gen, job)) is not None:
        return reason
    entry = job.entries.get(f"{gen}/{name}")
    if entry is not None and entry.key == info.key:
        if entry.state == "recorded":
            return None
        if max(entry.deadline_ms, entry.copy_deadline_ms) > now_ms:
            return None  # an upload in flight (or a completion copying a presigned one)
    return "unrecorded"


def classify_signed(gen: int, job: _JobState, now_ms: int, valid_until_ms: int) -> str | None:
    """A pre-signed URL's staging object (module docstring): never the promoted one; of the
    current generation kept until ``valid_until_ms`` (its URL may still write), then
    ``unrecorded``."""
    if not job.marker:
        return "unknown"
    if job.completed is not None:
        return "completed"
    if (reason := _past(gen, job)) is not None:
        return reason
    return None if valid_until_ms > now_ms else "unrecorded"


def _past(gen: int, job: _JobState) -> str | None:
    """What an object of generation ``gen`` of a job not completed is by the job alone:
    ``cancelled``, ``unknown`` (a generation the fence never reached), ``stale``; None for the
    current generation."""
    if job.cancelled:
        return "cancelled"
    if job.fence is None or gen > job.fence:
        return "unknown"
    if gen < job.fence:
        return "stale"
    return None


def classify_staging(
    gen: int, name: str, info: ObjectInfo, job: _JobState, now_ms: int
) -> str | None:
    """A local store's staging file (a put not ended, or killed): kept only while an upload
    of its output by the current generation is in flight; a completed or cancelled job's
    and a stale generation's are deleted like objects; any other one is counted
    (``unrecorded``: a put that died, of the current generation)."""
    if job.marker and job.completed is not None:
        return "completed"  # nothing is staged after a completion: no put can end well
    final = ObjectInfo(staged_key(info.key) or info.key, info.size, info.last_modified, "")
    reason = classify(gen, name, final, job, now_ms)
    if reason in DELETED_REASONS or reason == "unknown":
        return reason
    entry = job.entries.get(f"{gen}/{name}")
    if entry is not None and entry.state == "staged" and entry.deadline_ms > now_ms:
        return None  # an upload in flight writes it
    return "unrecorded"


async def sweep(
    outputs: OutputService,
    *,
    grace_seconds: float,
    dry_run: bool = False,
    metrics: Metrics | None = None,
    now: datetime | None = None,
) -> SweepReport:
    """One sweep of the whole store (see the module docstring)."""
    now = now or datetime.now(UTC)
    now_ms = int(now.timestamp() * 1000)
    if not await outputs.records.initialised():
        raise StoreUnavailable(
            "Redis has no fencegate durability marker: it may have lost fences and "
            "completions, so the sweeper deletes nothing (fencegate init first)"
        )
    report = SweepReport()
    jobs: dict[tuple[str, str], list[tuple[int, str, ObjectInfo]]] = defaultdict(list)
    try:
        async for info in outputs.objects.list():
            parsed = parse_output_key(info.key)
            signed = parse_signed_key(info.key) if parsed is None else None
            if signed is not None:
                tenant, job, gen, _, name = signed
            elif parsed is not None:
                tenant, job, gen, name = parsed
            else:
                report.foreign += 1
                continue
            jobs[(tenant, job)].append((gen, name, info))
        for info in await outputs.objects.staging():
            parsed = parse_output_key(staged_key(info.key) or "")
            if parsed is not None:
                tenant, job, gen, name = parsed
                jobs[(tenant, job)].append((gen, name, info))
    except ObjectStoreError as exc:
        log.error("output_sweep_list_failed", error=str(exc))
        raise
    for (tenant, job), objects in jobs.items():
        state = await _job_state(outputs, JobKeys(tenant, job))
        for gen, name, info in objects:
            signed = parse_signed_key(info.key)
            if signed is not None:
                valid_until = url_valid_until(signed[3], outputs.ledger.url_ms)
                reason = classify_signed(gen, state, now_ms, valid_until)
            else:
                judge = classify_staging if "#" in info.key else classify
                reason = judge(gen, name, info, state, now_ms)
            if reason is None:
                report.kept += 1
                continue
            age = max(0.0, (now - info.last_modified).total_seconds())
            deletable = reason in DELETED_REASONS and age >= grace_seconds
            entry = state.entries.get(f"{gen}/{name}")
            target = staged_key(info.key) or info.key
            upload = entry.upload if entry is not None and entry.key == target else ""
            if signed is not None:  # its URL's reservation, once the URL cannot write again
                upload = signed[3] if valid_until <= now_ms else ""
            report.orphans.append(Orphan(info.key, reason, info.size, age, deletable, upload))
    if not dry_run:
        await _delete(outputs, [o for o in report.orphans if o.deletable], report, metrics)
    if metrics is not None:
        _export(metrics, report)
    return report


async def _delete(
    outputs: OutputService, doomed: Iterable[Orphan], report: SweepReport, metrics: Metrics | None
) -> None:
    freed: dict[str, tuple[list[str], list[str]]] = defaultdict(lambda: ([], []))
    for orphan in doomed:
        try:
            if "#" in orphan.key:  # a local staging file (never a key of an object)
                await outputs.objects.delete_staging(orphan.key)
            else:  # idempotent: another gateway may win
                await outputs.objects.delete(orphan.key)
        except ObjectStoreError as exc:
            report.failed += 1
            log.warning("output_orphan_delete_failed", key=orphan.key, error=str(exc))
            continue
        report.deleted.append(orphan)
        key = staged_key(orphan.key) or orphan.key
        parsed = parse_output_key(key) or parse_signed_key(key)
        if parsed is not None:
            objects, uploads = freed[parsed[0]]
            if "#" not in orphan.key:
                objects.append(key)
            if orphan.upload:
                uploads.append(f"{key} {orphan.upload}")
        log.info(
            "output_orphan_deleted",
            key=orphan.key,
            reason=orphan.reason,
            bytes=orphan.size,
            age_seconds=round(orphan.age_seconds, 3),
        )
        if metrics is not None:
            metrics.orphans_deleted.labels(orphan.reason).inc()
            metrics.orphan_age_seconds.observe(orphan.age_seconds)
    for tenant, (objects, uploads) in freed.items():
        await outputs.ledger.released(tenant, objects, uploads)


def _export(metrics: Metrics, report: SweepReport) -> None:
    """The gauges: orphans left in the store after this sweep, by reason."""
    gone = {o.key for o in report.deleted}
    left: dict[str, tuple[int, int]] = {reason: (0, 0) for reason in REASONS}
    for o in report.orphans:
        if o.key not in gone:
            n, b = left[o.reason]
            left[o.reason] = (n + 1, b + o.size)
    for reason, (n, b) in left.items():
        metrics.orphans.labels(reason).set(n)
        metrics.orphan_bytes.labels(reason).set(b)
