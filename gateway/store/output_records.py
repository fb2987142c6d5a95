"""The outputs' records in Redis: the jobs' outputs hashes as the outputs read them, and the
output ledger's counters (what each tenant has in the output store).

The fenced decisions on outputs (stage, record) are scripts of the store itself
(:meth:`gateway.store.store.Store.output_stage`, :meth:`~gateway.store.store.Store.output_record`);
this module holds what :mod:`gateway.fencing.outputs`, :mod:`gateway.fencing.output_ledger` and
the sweeper (:mod:`gateway.fencing.outputs_sweep`) read and count:

* a job's outputs hash ``fg:{t/j}:outputs`` (``<generation>/<name>`` -> the entry's JSON) and
  what its job hash says of the fence (``fence``, ``cancelled``, ``completed``);
* the ledger, per tenant: ``fg:quota:{<tenant>}:out`` (object key -> bytes stored there),
  ``…:out_up`` (``"<object key> <upload id>"`` -> bytes reserved while that upload runs) and
  ``…:out_bytes`` (their sum), changed only by its three plain scripts (``lua/plain/ledger-*.lua``).

Every call maps Redis's errors in one place (:mod:`gateway.store.failures`): Redis not serving
is ``StoreUnavailable``; an error reply (a script's own) is a bug and raised as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from gateway.store.batching import Batcher
from gateway.store.failures import redis_errors
from gateway.store.keys import MARKER, JobKeys, quota_prefix
from gateway.store.router import ClusterRouter
from gateway.store.scripts import PlainScript

__all__ = ["FenceState", "JobOutputs", "LedgerReply", "OutputRecords"]

# the ledger's scripts (lua/plain/: no prelude), its only writes
RESERVE = PlainScript.load("ledger-reserve-3")
SETTLE = PlainScript.load("ledger-settle-3")
FIX = PlainScript.load("ledger-fix-3")


class LedgerReply(IntEnum):
    """``ledger-reserve-3``'s refusals (any other reply: the tenant's bytes with the
    reservation)."""

    OVER_BYTES = -1
    OVER_OBJECTS = -2


@dataclass(frozen=True, slots=True)
class FenceState:
    """What a job hash says of the fence: its value (None: no fence), cancelled, completed
    (the completion's JSON, '' when not completed)."""

    fence: int | None
    cancelled: bool
    completed: str


@dataclass(frozen=True, slots=True)
class JobOutputs:
    """One job as the sweeper reads it, in one round trip: whether its slot's durability
    marker is there, its fence, and its outputs hash (field -> the entry's JSON)."""

    marker: bool
    fence: FenceState
    entries: dict[str, str]


def _fence(fence: str | None, cancelled: str | None, completed: str | None) -> FenceState:
    return FenceState(None if fence is None else int(fence), cancelled == "1", completed or "")


class OutputRecords:
    """The outputs hashes and the output ledger (module docstring), on the gateway's client
    (reads) and auto-pipeline (the ledger's scripts)."""

    def __init__(self, client: Any, batcher: Batcher | ClusterRouter) -> None:
        self._client = client
        self._batcher = batcher

    # -- a job's outputs -------------------------------------------------------------

    async def entries(self, keys: JobKeys) -> dict[str, str]:
        """The job's outputs hash (``<generation>/<name>`` -> the entry's JSON)."""
        with redis_errors():
            raw: dict[str, str] = await self._client.hgetall(keys.outputs)
        return raw

    async def entry(self, keys: JobKeys, field: str) -> str | None:
        """One entry's JSON (``field``: ``<generation>/<name>``); None: there is none."""
        with redis_errors():
            raw: str | None = await self._client.hget(keys.outputs, field)
        return raw

    async def entries_of(self, tenant: str, asked: Sequence[tuple[str, str]]) -> list[str | None]:
        """The entries ``(job, field)`` of the tenant's jobs, in one round trip."""
        with redis_errors():
            async with self._client.pipeline(transaction=False) as pipe:
                for job, field in asked:
                    pipe.hget(JobKeys(tenant, job).outputs, field)
                found: list[str | None] = await pipe.execute()
        return found

    async def fence(self, keys: JobKeys) -> FenceState:
        """The job's fence, cancel flag and completion."""
        with redis_errors():
            fence, cancelled, completed = await self._client.hmget(
                keys.job, "fence", "cancelled", "completed"
            )
        return _fence(fence, cancelled, completed)

    async def completion(self, keys: JobKeys) -> str | None:
        """The job's completion (its JSON); None before it completed."""
        with redis_errors():
            raw: str | None = await self._client.hget(keys.job, "completed")
        return raw

    async def job(self, keys: JobKeys) -> JobOutputs:
        """The job as the sweeper judges its objects (:class:`JobOutputs`)."""
        with redis_errors():
            pipe = self._client.pipeline(transaction=False)
            pipe.exists(keys.marker)
            pipe.hmget(keys.job, "fence", "cancelled", "completed")
            pipe.hgetall(keys.outputs)
            marker, (fence, cancelled, completed), raw = await pipe.execute()
        return JobOutputs(bool(marker), _fence(fence, cancelled, completed), dict(raw))

    async def initialised(self) -> bool:
        """Whether Redis holds fencegate's durability marker (``fencegate init`` ran)."""
        with redis_errors():
            return bool(await self._client.exists(MARKER))

    # -- the output ledger -----------------------------------------------------------

    @staticmethod
    def ledger_keys(tenant: str) -> list[str]:
        p = quota_prefix(tenant)
        return [f"{p}:out", f"{p}:out_up", f"{p}:out_bytes"]

    async def _ledger(self, script: PlainScript, tenant: str, args: Sequence[Any]) -> int:
        with redis_errors():
            reply = await self._batcher.evalsha(
                script.sha, script.source, self.ledger_keys(tenant), [str(a) for a in args]
            )
        return int(reply)

    async def reserve(
        self,
        tenant: str,
        *,
        key: str,
        upload: str,
        amount: int,
        byte_cap: int,
        object_cap: int,
        replaces: str,
    ) -> int:
        """``ledger-reserve-3``: a :class:`LedgerReply` refusal, else the tenant's bytes with it."""
        return await self._ledger(
            RESERVE,
            tenant,
            (
                key,
                upload,
                amount,
                byte_cap,
                object_cap,
                f"{key} {replaces}" if replaces else "",
            ),
        )

    async def settle(self, tenant: str, *, key: str, upload: str, size: int | None) -> None:
        """``ledger-settle-3``: ``upload`` ended with ``size`` bytes at ``key`` (None: nothing)."""
        await self._ledger(SETTLE, tenant, (key, upload, "" if size is None else size))

    async def fix(self, tenant: str, ops: Sequence[str]) -> int:
        """``ledger-fix-3``: the ``(op, field, value)`` triples, flat; the bytes' change."""
        return await self._ledger(FIX, tenant, ops)

    async def charges(self, tenant: str) -> tuple[dict[str, str], dict[str, str]]:
        """The ledger's two hashes: (object key -> bytes, ``"<key> <upload>"`` -> reserved)."""
        out_key, up_key, _ = self.ledger_keys(tenant)
        with redis_errors():
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.hgetall(out_key)
                pipe.hgetall(up_key)
                charged, reserved = await pipe.execute()
        return dict(charged), dict(reserved)
