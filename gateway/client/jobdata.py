"""The SDK's job data: checkpoints, attempt-scoped outputs and the fenced completion.

:class:`JobData` is mixed into :class:`gateway.client.api.FencedJob`; its methods use the
job's token like :meth:`~gateway.client.api.FencedJob.effect`. A stale generation raises
:class:`~gateway.core.errors.StaleGeneration` here too (and marks the job superseded).
Nothing in the SDK deletes anything: an output it uploaded and never completed is the
gateway's orphan to sweep, never the SDK's to remove.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from gateway.core.errors import (
    FencegateError,
    NotFound,
    Superseded,
)

__all__ = ["SUPERSEDED", "CheckpointValue", "Completion", "JobData", "OutputData", "OutputUploaded"]

# The answers after which a worker must stop working on the job (a completed job: the
# heartbeat stops quietly, the work is over; see FencedJob._beat).
SUPERSEDED = (Superseded,)  # stale, cancelled, lease expired, unregistered, completed

OutputData = bytes | bytearray | memoryview | IO[bytes] | os.PathLike[str]


@dataclass(frozen=True, slots=True)
class CheckpointValue:
    """A checkpoint as stored: its value and the generation that wrote it."""

    name: str
    value: Any
    generation: int
    worker_id: str | None
    at: str | None


@dataclass(frozen=True, slots=True)
class Completion:
    """The job's completion: by which generation, its result and promoted outputs."""

    generation: int
    completed_at: str | None
    result: Any
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class OutputUploaded:
    """An attempt-scoped output written and recorded (not promoted until completion)."""

    name: str
    generation: int
    size: int
    sha256: str


def _checkpoint(out: Mapping[str, Any]) -> CheckpointValue:
    return CheckpointValue(
        name=out["name"],
        value=out.get("value"),
        generation=out["generation"],
        worker_id=out.get("worker_id"),
        at=out.get("at"),
    )


class JobData:
    """Checkpoints, outputs and completion of a :class:`~gateway.client.api.FencedJob`."""

    job_id: str
    superseded: FencegateError | None
    completion: Completion | None
    _heartbeat: asyncio.Task[None] | None

    async def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
        data: Any = None,
    ) -> tuple[int, Any]:
        raise NotImplementedError  # the client's (gateway.client.api._Client)

    def _fence_headers(self) -> dict[str, str]:
        raise NotImplementedError  # FencedJob's

    async def _hold_heartbeats(self, held: bool) -> None:
        """Held: no heartbeat starts, and one on its way has been answered (FencedJob's)."""

    def _stale(self, err: FencegateError) -> None:
        if isinstance(err, SUPERSEDED):
            self.superseded = self.superseded or err

    async def checkpoint(self, name: str, value: Any) -> CheckpointValue:
        """Store ``value`` (any JSON value) as checkpoint ``name`` under the fence."""
        body = jsonlib.dumps(value, separators=(",", ":"), allow_nan=False).encode()
        try:
            _, out = await self._call(
                "PUT",
                f"/v1/jobs/{self.job_id}/checkpoints/{name}",
                data=body,
                headers={**self._fence_headers(), "Content-Type": "application/json"},
            )
        except FencegateError as err:
            self._stale(err)
            raise
        return _checkpoint(out)

    async def load_checkpoint(self, name: str) -> CheckpointValue | None:
        """The last value stored as ``name`` by any generation of this job (None: none yet).
        ``.generation`` says which generation wrote it."""
        try:
            _, out = await self._call("GET", f"/v1/jobs/{self.job_id}/checkpoints/{name}")
        except NotFound:
            return None
        return _checkpoint(out)

    async def put_output(
        self, name: str, data: OutputData, *, content_type: str = "application/octet-stream"
    ) -> OutputUploaded:
        """Upload an output to this generation's own location (streamed; a path or a binary
        file is read in chunks). It becomes the job's official output only when
        :meth:`complete` names it."""
        headers = {**self._fence_headers(), "Content-Type": content_type}
        path = f"/v1/jobs/{self.job_id}/outputs/{name}"
        try:
            if isinstance(data, os.PathLike):
                with open(data, "rb") as fh:  # noqa: ASYNC230 - aiohttp reads it in chunks
                    _, out = await self._call("PUT", path, data=fh, headers=headers)
            else:
                _, out = await self._call("PUT", path, data=data, headers=headers)
        except FencegateError as err:
            self._stale(err)
            raise
        return OutputUploaded(
            name=out["name"], generation=out["generation"], size=out["size"], sha256=out["sha256"]
        )

    async def complete(self, *, result: Any = None, outputs: Sequence[str] = ()) -> Completion:
        """Complete the job under the fence, promoting ``outputs`` (uploaded by this
        generation). Sent again after a lost answer, the same completion replays. A stale
        generation raises :class:`StaleGeneration`, like an effect; heartbeats stop after."""
        body = {"outputs": list(outputs), "result": result}
        # a heartbeat the gateway handled after the completion would be refused (and audited)
        # as job_completed: none is on its way while the completion is
        await self._hold_heartbeats(True)
        try:
            _, out = await self._call(
                "POST",
                f"/v1/jobs/{self.job_id}/complete",
                json=body,
                headers=self._fence_headers(),
            )
        except BaseException as err:
            if isinstance(err, FencegateError):
                self._stale(err)
            await self._hold_heartbeats(False)  # not completed: the lease is renewed again
            raise
        self.completion = Completion(
            generation=out["generation"],
            completed_at=out["completed_at"],
            result=out["result"],
            outputs=dict(out["outputs"]),
            replayed=out["replayed"],
        )
        if self._heartbeat is not None:
            self._heartbeat.cancel()  # the job is over: nothing to renew
        return self.completion
