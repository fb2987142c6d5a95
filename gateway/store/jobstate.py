"""A job's own state in Redis: checkpoints, its fenced completion, and the job view's
records of both (and of the attempt-scoped outputs).

Every write is one Lua script in the job's slot, through the prelude
(:meth:`gateway.store.link.RedisLink.run_script`): ``checkpoint-3`` and ``complete-3``. A
rejection comes back audited and typed like an effect's
(:meth:`gateway.store.store.Decisions.rejected`).

The records (shared with the outputs module; docs/reliability.md has their invariants):

- ``fg:{t/j}:ckpt`` field ``<name>`` → ``{"generation", "value", "worker", "at_ms"}``
- ``fg:{t/j}:outputs`` field ``<generation>/<name>`` → ``{"state": "staged" | "recorded",
  "key", "size", "sha256", "content_type", "staged_ms", "recorded_ms", "presigned"}``
- ``fg:{t/j}:job`` field ``completed`` → ``{"generation", "at_ms", "result", "outputs":
  {name: {"generation", "key", "size", "sha256", "content_type"}}, "body_sha"}``
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.core import fastjson
from gateway.core.errors import OutputNotStaged
from gateway.core.records import CompletionRecord, OutputRecord, OverQuota
from gateway.store import replies
from gateway.store.keys import JobKeys
from gateway.store.link import RedisLink
from gateway.store.scripts import fenced_args
from gateway.store.store import Decisions

__all__ = [
    "CHECKPOINT_ENVELOPE",
    "Checkpoint",
    "CheckpointWritten",
    "JobState",
    "JobStateView",
    "canonical_json",
]


# The stored field's bytes around the value and the worker id: '{"generation":', ',"value":',
# ',"worker":', ',"at_ms":', '}' (43) and the two numbers (at most 16 digits each).
CHECKPOINT_ENVELOPE = 75


def canonical_json(value: Any) -> str:
    """One spelling per JSON value: sorted keys, no spaces, integers exact, UTF-8 kept."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    name: str
    generation: int
    value: Any
    worker_id: str | None
    at_ms: int

    @classmethod
    def from_json(cls, name: str, raw: str) -> Checkpoint:
        d = fastjson.loads(raw)
        return cls(name, int(d["generation"]), d["value"], d.get("worker"), int(d["at_ms"]))


@dataclass(frozen=True, slots=True)
class CheckpointWritten:
    """A checkpoint stored: when (ms, Redis's clock), and its charge and that of the
    checkpoint of the same name it replaced (0: a new name), as ``checkpoint-3`` counts them."""

    at_ms: int
    replaced: int
    charge: int


@dataclass(frozen=True, slots=True)
class JobStateView:
    """What the job view shows besides fence and effects."""

    completion: CompletionRecord | None
    checkpoints: dict[str, Checkpoint]
    outputs: list[OutputRecord]


def _output_record(field: str, raw: str) -> OutputRecord | None:
    try:
        return OutputRecord.parse(field, raw)
    except ValueError:  # not ours to judge: left out of the view
        return None


class JobState:
    """Checkpoints and completion of jobs: their scripts run on the store's ``link``; a
    refusal is audited and raised by the store's ``decisions``
    (:meth:`~gateway.store.store.Decisions.rejected`)."""

    def __init__(
        self,
        link: RedisLink,
        decisions: Decisions,
        *,
        registration: str,
        retention_seconds: int,
        max_checkpoints: int = 100,
        checkpoint_overhead: int = 256,
    ) -> None:
        self._link = link
        self._decisions = decisions
        self._registration = registration
        self._retention = str(retention_seconds)
        self._max_checkpoints = str(max_checkpoints)
        self._overhead = str(checkpoint_overhead)

    async def checkpoint(
        self,
        keys: JobKeys,
        name: str,
        value_json: str,
        *,
        generation: int,
        worker_id: str | None,
        by: str = "",
        closed: bool = False,
    ) -> CheckpointWritten | OverQuota:
        """Write a checkpoint under the fence. ``by``: who calls, recorded with an implicit
        registration. ``closed``: the tenant's checkpoint bytes are used up (only a write that
        does not grow the job's checkpoints is taken). Over ``max_checkpoints`` names or
        ``closed``: :class:`OverQuota` (``checkpoints_per_job`` | ``checkpoint_bytes``), nothing
        written."""
        link = self._link
        flag = link.unaudited_flag(keys.tenant)
        reply = await link.run_script(
            "checkpoint-3",
            keys,
            (keys.job, keys.ckpt, keys.audit),
            (
                *fenced_args(
                    keys, generation, self._registration, worker_id or "", self._retention, by, flag
                ),
                name,
                value_json,
                "null" if worker_id is None else json.dumps(worker_id),
                self._max_checkpoints,
                "1" if closed else "",
                self._overhead,
            ),
        )
        code = int(reply[0])
        if code == replies.CheckpointReply.WRITTEN:
            return CheckpointWritten(int(reply[2]), int(reply[3]), int(reply[4]))
        if code == replies.CheckpointReply.REFUSED:
            return OverQuota(str(reply[1]))
        link.rejection_spent(keys, f"checkpoint:{name}", flag, worker_id or "", str(reply[4]))
        raise await self._decisions.rejected(
            keys, reply, step=f"checkpoint:{name}", worker_id=worker_id or ""
        )

    async def load_checkpoint(self, keys: JobKeys, name: str) -> Checkpoint | None:
        client = self._link.client
        raw = await self._link.guard(lambda: client.hget(keys.ckpt, name))
        return None if raw is None else Checkpoint.from_json(name, str(raw))

    async def complete(
        self,
        keys: JobKeys,
        *,
        generation: int,
        result_json: str,
        outputs: Sequence[str],
        body_sha: str,
        worker_id: str | None,
        request_id: str | None = None,
        by: str = "",
    ) -> CompletionRecord:
        """The fenced completion (see ``complete-3.lua``). ``request_id``: the same one on a
        re-send of a call whose reply was lost (it answers what it answered)."""
        link = self._link
        flag = link.unaudited_flag(keys.tenant)
        reply = await link.run_script(
            "complete-3",
            keys,
            (keys.job, keys.outputs, keys.audit),
            (
                *fenced_args(
                    keys, generation, self._registration, worker_id or "", self._retention, by, flag
                ),
                body_sha,
                result_json,
                json.dumps(list(outputs)),
            ),
            request_id=request_id,
        )
        code = int(reply[0])
        if code in (replies.CompleteReply.COMPLETED, replies.CompleteReply.REPLAY):
            return CompletionRecord.from_json(
                str(reply[1]), replayed=code == replies.CompleteReply.REPLAY
            )
        if code == replies.CompleteReply.NOT_RECORDED:
            missing = json.loads(reply[1])
            raise OutputNotStaged(
                f"generation {generation} has not recorded these outputs: {', '.join(missing)}; "
                "upload them (PUT …/outputs/{name}) before completing",
                missing=missing,
                generation=generation,
            )
        link.rejection_spent(keys, "job:complete", flag, worker_id or "", str(reply[4]))
        raise await self._decisions.rejected(
            keys, reply, step="job:complete", worker_id=worker_id or ""
        )

    async def view(self, keys: JobKeys) -> JobStateView:
        """Completion, checkpoints and outputs of a job (three reads, one pipeline)."""
        client = self._link.client

        async def read() -> list[Any]:
            async with client.pipeline(transaction=False) as pipe:
                pipe.hget(keys.job, "completed")
                pipe.hgetall(keys.ckpt)
                pipe.hgetall(keys.outputs)
                return await pipe.execute()

        completed, ckpts, outputs = await self._link.guard(read)
        records = [_output_record(f, v) for f, v in sorted(outputs.items())]
        return JobStateView(
            completion=CompletionRecord.from_json(completed) if completed else None,
            checkpoints={n: Checkpoint.from_json(n, v) for n, v in sorted(ckpts.items())},
            outputs=[r for r in records if r is not None],
        )
