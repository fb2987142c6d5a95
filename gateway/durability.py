"""Durability checks around the store: the init markers, the Redis epoch, the audit chain.

- ``initialize`` writes the durability markers (one per Cluster slot and a global
  one) when that is safe: on a Redis with no fencegate data that this gateway has
  never initialised, or when an operator confirms the data loss.
- The epoch counter lives in Redis (``fg:epoch``) and, as last seen, in the
  gateway's state file. A Redis whose epoch is below what this gateway saw was
  restored from an older snapshot: it is quarantined (markers removed, so every
  script fails closed) until ``fencegate init --confirm-data-loss``.
- ``verify_audit`` recomputes every job's audit hash chain and checks its anchors.

Callers wrap these in :meth:`gateway.store.Store._guard` (Redis errors → 503).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from pathlib import Path

import redis.asyncio as aioredis
import structlog

from gateway import audit_anchor
from gateway.audit_anchor import AnchorCheck
from gateway.keys import EPOCH, MARKER, PREFIX, SLOTS, slot_marker

__all__ = ["epoch_check", "initialize", "quarantine", "verify_audit"]

log = structlog.get_logger("fencegate.durability")


async def has_fencegate_data(client: aioredis.Redis) -> bool:
    async for _ in client.scan_iter(match=PREFIX + "*", count=1000):
        return True
    return False


async def initialize(
    client: aioredis.Redis, state_file: Path | None, *, auto: bool, confirm_data_loss: bool = False
) -> str:
    """Write the durability marker when it is safe; return what happened.

    ``auto`` is the implicit init at first start: it only writes the marker
    on a Redis with no fencegate data when no earlier initialisation is
    recorded in the state file. Otherwise ``confirm_data_loss`` is needed.
    """

    if await client.get(MARKER) is not None and not confirm_data_loss:
        if not await epoch_check(client, state_file):
            return "stale_snapshot"
        return "present"
    if (
        initialised_before(state_file) or await has_fencegate_data(client)
    ) and not confirm_data_loss:
        return "refused"
    value = json.dumps({"id": secrets.token_hex(8), "created_at": time.time()})
    # Slot markers first, the global one last: readiness means all are there.
    # (MSET in chunks: 16384 keys in ~30 ms with appendfsync always.)
    # A slot marker is also the slot's write counter (it only rises; see the scripts'
    # prelude). It starts at the clock in microseconds, so after an init that confirmed a
    # data loss every counter is above anything a gateway saw before it.
    counter = str(time.time_ns() // 1000)
    markers = [slot_marker(slot) for slot in range(SLOTS)]
    for i in range(0, SLOTS, 2048):
        await client.mset(dict.fromkeys(markers[i : i + 2048], counter))
    await client.set(MARKER, value)
    # a fresh start: this Redis's epoch is the new baseline
    write_state(state_file, int(await client.incr(EPOCH)))
    return "written"


def initialised_before(state_file: Path | None) -> bool:
    """Has this gateway (its data dir) initialised a Redis before? (a small local read)"""
    return state_file is not None and state_file.exists()


def read_state(state_file: Path | None) -> int:
    """The highest Redis epoch this gateway has seen (0: none recorded)."""
    if state_file is None or not state_file.exists():
        return 0
    try:
        return int(json.loads(state_file.read_text(encoding="utf-8")).get("epoch", 0))
    except (ValueError, AttributeError):
        return 0


def write_state(state_file: Path | None, epoch: int) -> None:
    if state_file is not None:
        state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"initialised": True, "epoch": epoch}), encoding="utf-8")
        tmp.replace(state_file)


async def epoch_check(client: aioredis.Redis, state_file: Path | None) -> bool:
    """Detect a Redis restored from an older snapshot; bump the epoch otherwise.

    The epoch counter lives in Redis and, as last seen, in the state file. A
    Redis whose epoch is below what this gateway saw went back in time: fences
    and outcomes written since may be gone. It is quarantined (its markers
    removed, so every script fails closed) until ``init --confirm-data-loss``.
    """
    seen = read_state(state_file)
    current = int(await client.get(EPOCH) or 0)
    if current < seen:
        await quarantine(client)
        log.error(
            "redis_older_than_last_seen",
            redis_epoch=current,
            last_seen_epoch=seen,
            detail="Redis was restored from an older snapshot: dispatching is refused until "
            "`fencegate init --confirm-data-loss`",
        )
        return False
    write_state(state_file, int(await client.incr(EPOCH)))
    return True


async def quarantine(client: aioredis.Redis) -> None:
    await client.delete(MARKER)
    markers = [slot_marker(slot) for slot in range(SLOTS)]
    for i in range(0, SLOTS, 2048):
        await client.delete(*markers[i : i + 2048])


async def verify_audit(
    client: aioredis.Redis,
    *,
    keys: Sequence[str] = (),
    anchor_files: Sequence[Path] = (),
    retention_seconds: int = 604_800,
) -> AnchorCheck:
    """Recompute every job's audit hash chain, with the audit key(s) when given, and check the
    anchors of chain heads kept outside Redis (``fencegate audit verify``; see
    :func:`gateway.audit_anchor.verify` for what is and is not detected)."""
    return await audit_anchor.verify(
        client, keys=keys, anchor_files=anchor_files, retention_seconds=retention_seconds
    )
