"""Durability checks around the store: the init markers, the Redis epoch, the audit chain.

- ``initialize`` writes the durability markers (one per Cluster slot and a global
  one) when that is safe: on a Redis with no fencegate data that this gateway has
  never initialised, or when an operator confirms the data loss.
- The epoch counter lives in Redis (``fg:epoch``) and, as last seen, in the
  gateway's state file. A Redis whose epoch is below what this gateway saw was
  restored from an older snapshot: it is quarantined (markers removed, so every
  script fails closed) until ``fencegate init --confirm-data-loss``.
- The per-slot high-water marks (the highest value of each slot's marker, its write
  counter, seen in a reply) are kept in the state file too (:mod:`gateway.store.statefile`);
  ``marks_check`` compares them with Redis's markers and quarantines a Redis with any slot
  below its mark: writes the gateway saw acknowledged are gone (a restored backup).
- ``verify_audit`` recomputes every job's audit hash chain and checks its anchors.

On Redis/Valkey Cluster (:mod:`gateway.store.cluster`) the markers are written and read one
command per slot, pipelined per node (never a multi-slot ``MSET``/``MGET``: ``CROSSSLOT``), and
``fg:epoch`` is not used: one key lives on one shard, so it could only say that *that* shard
went back. The per-slot markers already are per-slot epochs (each is its slot's write counter
and only rises): the gateway's periodic check reads all 16,384 of them through the router
(:meth:`gateway.store.link.RedisLink.heartbeat_epoch`), compares them with its marks and then
records them as marks, so every slot — of every shard, written by any gateway — is checked
against the highest counter seen, not only the slots this gateway wrote.

Callers wrap these in :meth:`gateway.store.link.RedisLink.guard` (Redis errors → 503).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from gateway.store import anchor_check, statefile
from gateway.store.anchor_check import AnchorCheck
from gateway.store.cluster import delete_slots, is_cluster, mget_slots, mset_slots
from gateway.store.keys import EPOCH, MARKER, PREFIX, QUARANTINE, SLOTS, slot_marker

__all__ = [
    "MARKER_STATES",
    "compare_marks",
    "epoch_check",
    "initialize",
    "marker_state",
    "marks_check",
    "quarantine",
    "verify_audit",
]

log = structlog.get_logger("fencegate.durability")
Bump = Callable[[], Awaitable[Any]]  # increments fg:epoch, answers the new value
Reread = Callable[[Sequence[int]], Awaitable[Sequence[str | None]]]  # slots -> their markers


# the keys of a job's slot (fences, effect records, audit chains: gateway.store.keys)
JOB_DATA = PREFIX + "{*"


async def has_fencegate_data(client: aioredis.Redis) -> bool:
    """Does Redis hold jobs' data (any key of a job's slot, ``fg:{<t>/<j>}:…``: fences,
    effect records, audit chains) or a quarantine record? Keys the gateways write on their
    own whatever Redis holds (the attention turn, quota counters and their re-send memory,
    relay and attention hints, the tenant feed, the epoch, witness counters) do not count:
    they come back on a wiped Redis within seconds, and a wiped Redis must read as wiped
    (and a new one stay initialisable) while gateways run against it."""
    if await client.exists(QUARANTINE):
        return True
    async for _ in client.scan_iter(match=JOB_DATA, count=1000):
        return True
    return False


async def initialize(
    client: aioredis.Redis,
    state_file: Path | None,
    *,
    auto: bool,
    confirm_data_loss: bool = False,
    write: bool = True,
    seen: Mapping[int, int] | None = None,
    bump: Bump | None = None,
) -> str:
    """Write the durability marker when it is safe; return what happened.

    It only writes the marker on a Redis with no fencegate data when no earlier
    initialisation is recorded in the state file; otherwise ``confirm_data_loss`` is
    needed. ``write=False`` (a gateway starting on an external Redis without
    ``redis.auto_init``) never writes: such a Redis answers ``"uninitialised"`` until an
    operator runs ``fencegate init``. A Redis with its marker is checked against the
    slot marks (the state file's and ``seen``) and the epoch: ``"stale_snapshot"`` when
    it went back in time (it is then quarantined).
    """

    if await client.get(MARKER) is not None and not confirm_data_loss:
        if not await marks_check(client, state_file, seen):
            return "stale_snapshot"
        if not await epoch_check(client, state_file, bump):
            return "stale_snapshot"
        return "present"
    if (
        initialised_before(state_file) or await has_fencegate_data(client)
    ) and not confirm_data_loss:
        return "refused"
    if not write:
        return "uninitialised"
    value = json.dumps({"id": secrets.token_hex(8), "created_at": time.time()})
    # Slot markers first, the global one last: readiness means all are there.
    # (MSET in chunks: 16384 keys in ~30 ms with appendfsync always.)
    # A slot marker is also the slot's write counter (it only rises; see the scripts'
    # prelude). It starts at the clock in microseconds, so after an init that confirmed a
    # data loss every counter is above anything a gateway saw before it.
    # (Above every mark this data dir recorded too, should this host's clock be behind.)
    highest = max(max(read_marks(state_file).values(), default=0), max_mark(seen))
    counter = str(max(time.time_ns() // 1000, highest + 1))
    markers = [slot_marker(slot) for slot in range(SLOTS)]
    for i in range(0, SLOTS, 2048):
        await mset_slots(client, dict.fromkeys(markers[i : i + 2048], counter))
    await client.delete(QUARANTINE)
    # a fresh start: this Redis's epoch is the new baseline, and the old marks are void
    # (Cluster: no global epoch, the slot markers are the per-slot epochs). It starts at the
    # counters' clock value too: above the epoch any other data dir (another host's gateway,
    # whose state file this init does not reset) recorded before, so their next epoch check
    # does not take the new baseline for a restored snapshot and quarantine it again. Written
    # before the global marker: a gateway's check that sees the marker sees this epoch.
    epoch = 0
    if not is_cluster(client):
        epoch = max(int(counter), read_state(state_file) + 1, int(await client.get(EPOCH) or 0))
        await client.set(EPOCH, str(epoch))
    await client.set(MARKER, value)
    if state_file is not None:
        statefile.update(state_file, epoch=epoch, initialised=True, reset=True)
    return "written"


def settings_problems(aof: str | None, fsync: str | None, policy: str | None) -> list[str]:
    """What keeps a Redis from keeping fences across restarts: its ``appendonly``,
    ``appendfsync`` and ``maxmemory-policy`` (checked at start and every epoch interval)."""
    problems = []
    if aof != "yes":
        problems.append(f"appendonly is {aof!r} (need 'yes')")
    if fsync != "always":
        # everysec: an acknowledged write (a registration, a recorded outcome) can be lost
        # in the last second before a crash of the host
        problems.append(f"appendfsync is {fsync!r} (need 'always')")
    if policy != "noeviction":
        problems.append(f"maxmemory-policy is {policy!r} (need 'noeviction')")
    return problems


async def durability_settings(client: aioredis.Redis) -> list[str] | None:
    """:func:`settings_problems` of this Redis now; None when ``CONFIG GET`` is not permitted."""
    try:
        values = {}
        for name in ("appendonly", "appendfsync", "maxmemory-policy"):
            values[name] = (await client.config_get(name)).get(name)
    except ResponseError:
        return None
    return settings_problems(
        values["appendonly"], values["appendfsync"], values["maxmemory-policy"]
    )


def max_mark(seen: Mapping[int, int] | None) -> int:
    return max((mark for _, mark in (seen or {}).items()), default=0)


# What a missing durability marker means, by what else is in Redis and the data dir
# (:func:`marker_state`); /readyz's ``marker`` and the `redis_marker_missing` log line
MARKER_STATES = {
    "uninitialised": "Redis has no fencegate data and this data dir never initialised one: "
    "run `fencegate init` once (a new deployment)",
    "wiped": "Redis has no fencegate data but this data dir initialised it before: it was "
    "restarted without its data, flushed or replaced; fences may be gone: "
    "`fencegate init --confirm-data-loss`, then re-register current generations",
    "quarantined": "Redis holds job data without its markers: a gateway found it had "
    "lost acknowledged writes and quarantined it (logged there as `redis_slots_went_back` or "
    "`redis_older_than_last_seen`), or they were removed by hand; "
    "`fencegate init --confirm-data-loss`, then re-register current generations",
    "slot_marker_missing": "the global marker is there but this slot's marker is not: the "
    "slot (on Cluster: its shard) lost its data; `fencegate init --confirm-data-loss`, then "
    "re-register current generations",
}


async def marker_state(client: aioredis.Redis, state_file: Path | None) -> str:
    """Why the global marker is missing (a key of :data:`MARKER_STATES`): ``quarantined`` when
    Redis still holds fencegate data, else ``wiped`` or ``uninitialised`` by the data dir."""
    if await has_fencegate_data(client):
        return "quarantined"
    return "wiped" if initialised_before(state_file) else "uninitialised"


def initialised_before(state_file: Path | None) -> bool:
    """Has this gateway (its data dir) initialised a Redis before? (a small local read)"""
    return state_file is not None and state_file.exists()


def read_state(state_file: Path | None) -> int:
    """The highest Redis epoch this gateway has seen (0: none recorded)."""
    return statefile.read(state_file).epoch


def read_marks(state_file: Path | None) -> dict[int, int]:
    """The highest value of each slot's marker recorded in the state file."""
    return statefile.read(state_file).slots


def write_state(state_file: Path | None, epoch: int) -> None:
    """Record an epoch seen (merged: the file keeps the highest; safe with several workers)."""
    if state_file is not None:
        statefile.update(state_file, epoch=epoch, initialised=True)


async def marks_check(
    client: aioredis.Redis, state_file: Path | None, seen: Mapping[int, int] | None = None
) -> bool:
    """Compare the slot marks (the state file's, and ``seen``: a process's own) with Redis.

    A slot whose marker is below its mark lost writes a gateway saw acknowledged: Redis
    was restored from a backup, or lost a tail of writes. Every slot may have, including
    slots no gateway touched since: the whole Redis is quarantined (markers removed, every
    script fails closed) until ``fencegate init --confirm-data-loss``. A missing slot marker
    is left to the scripts (that slot alone fails closed). The marks are read before the
    markers, so a write landing meanwhile can only raise a marker.
    """
    marks = read_marks(state_file)
    for slot, mark in (seen or {}).items():
        if mark > marks.get(slot, 0):
            marks[slot] = mark
    if not marks:
        return True
    slots = sorted(marks)
    current = dict(zip(slots, await _reader(client)(slots), strict=True))
    return await compare_marks(client, marks, current)


def _reader(client: aioredis.Redis) -> Reread:
    """Reads slots' markers: MGET across slots, 2,048 at a time, as init's MSET (one reply to
    parse, not 2,048: ~40x faster); on Cluster one GET per slot, pipelined per node."""

    async def read(slots: Sequence[int]) -> list[str | None]:
        values: list[str | None] = []
        for i in range(0, len(slots), 2048):
            values += await mget_slots(client, [slot_marker(slot) for slot in slots[i : i + 2048]])
        return values

    return read


def counter_of(value: str | None) -> int | None:
    """A marker's counter (None: no marker; 0: a marker from before the counters)."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:  # a marker from before the counters: the scripts count it as 0
        return 0


async def compare_marks(
    client: aioredis.Redis,
    marks: Mapping[int, int],
    current: Mapping[int, str | None],
    *,
    reread: Reread | None = None,
) -> bool:
    """Quarantine Redis if any slot's marker (``current``) is below its mark (see
    :func:`marks_check`); a missing marker is left to the scripts.

    ``marks`` must be taken before ``current`` was read. A slot found below its mark is read
    again (``reread``; default: :func:`~gateway.store.cluster.mget_slots` on ``client``) and
    counts as behind only if it still is: a marker only rises, so a second read below the mark
    cannot come from a write that raced the first one. A false quarantine stops a healthy
    deployment until an operator confirms a data loss that did not happen."""
    flagged = [
        slot
        for slot, value in current.items()
        if (counter := counter_of(value)) is not None and counter < marks.get(slot, 0)
    ]
    if not flagged:
        return True
    again = await (reread or _reader(client))(flagged)
    behind: list[tuple[int, int, int]] = []
    for slot, value in zip(flagged, again, strict=True):
        counter = counter_of(value)
        if counter is not None and counter < marks[slot]:
            behind.append((slot, counter, marks[slot]))
    if not behind:
        log.warning(
            "redis_marks_reread",
            slots_flagged=len(flagged),
            example_slot=flagged[0],
            detail="a slot's marker read below its mark was at or above it when read again: "
            "not a loss, nothing quarantined",
        )
        return True
    slots = sorted(current)
    slot, counter, mark = behind[0]
    await quarantine(
        client,
        cause="slots_went_back",
        slot=slot,
        counter=counter,
        seen=mark,
        slots_behind=len(behind),
    )
    log.error(
        "redis_slots_went_back",
        slots_behind=len(behind),
        slots_checked=len(slots),
        example_slot=slot,
        counter=counter,
        seen=mark,
        detail="Redis has lost writes fencegate saw acknowledged (restored from a backup, or "
        "a lost tail of writes): it is quarantined and nothing is dispatched until an "
        "operator runs `fencegate init --confirm-data-loss` and re-registers current "
        "generations",
    )
    return False


async def epoch_check(
    client: aioredis.Redis, state_file: Path | None, bump: Bump | None = None
) -> bool:
    """Detect a Redis restored from an older snapshot; bump the epoch otherwise.

    The epoch counter lives in Redis and, as last seen, in the state file. A
    Redis whose epoch is below what this gateway saw went back in time: fences
    and outcomes written since may be gone. It is quarantined (its markers
    removed, so every script fails closed) until ``init --confirm-data-loss``.

    ``bump`` increments the epoch instead of a plain ``INCR`` (with ``redis.replicas_acked``:
    through the acknowledged auto-pipeline, so a bump a failover then loses is never written
    to the state file, which would make the promoted replica look restored from a backup).
    Not on Cluster (see the module's docstring): always True there.
    """
    if is_cluster(client):
        return True
    seen = read_state(state_file)
    current = int(await client.get(EPOCH) or 0)
    if current < seen:
        await quarantine(client, cause="epoch_went_back", counter=current, seen=seen)
        log.error(
            "redis_older_than_last_seen",
            redis_epoch=current,
            last_seen_epoch=seen,
            detail="Redis was restored from an older snapshot: dispatching is refused until "
            "`fencegate init --confirm-data-loss`",
        )
        return False
    write_state(state_file, int(await (bump() if bump is not None else client.incr(EPOCH))))
    return True


async def quarantine(client: aioredis.Redis, *, cause: str = "operator", **facts: Any) -> None:
    """Remove every marker (on Cluster one ``DEL`` per slot, pipelined per node), then say
    why in ``fg:quarantine`` (read by every gateway's ``/readyz`` and its log of a refusal).
    The global marker goes first: a gateway that finds it missing knows at once. The record
    goes last: once it is there, every slot's script refuses (its marker is gone), so nothing
    that reads the record can still be admitted anywhere."""
    record = {"cause": cause, "at_ms": int(time.time() * 1000), **facts}
    await client.delete(MARKER)
    markers = [slot_marker(slot) for slot in range(SLOTS)]
    for i in range(0, SLOTS, 2048):
        await delete_slots(client, markers[i : i + 2048])
    await client.set(QUARANTINE, json.dumps(record))


async def verify_audit(
    client: aioredis.Redis,
    *,
    keys: Sequence[str] = (),
    anchor_files: Sequence[Path] = (),
    retention_seconds: int = 604_800,
) -> AnchorCheck:
    """Recompute every job's audit hash chain, with the audit key(s) when given, and check the
    anchors of chain heads kept outside Redis (``fencegate audit verify``; see
    :func:`gateway.store.anchors.verify` for what is and is not detected)."""
    return await anchor_check.verify(
        client, keys=keys, anchor_files=anchor_files, retention_seconds=retention_seconds
    )
