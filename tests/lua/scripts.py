"""The deciding scripts called as the store calls them (its trailer of arguments appended), on a
real Redis, without the store's Python around them: what each script answers is what is
tested. :data:`FENCED` builds one call of each fenced script from the same few facts."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from gateway.store.keys import JobKeys
from gateway.store.scripts import SCRIPT_NAMES, fenced_args, lua_source

JOB = JobKeys("t", "j")  # the job every Lua test calls the scripts for
REQUEST_MEMORY_MS = 60_000
RETENTION = "3600"
_ids = itertools.count(1)

Call = tuple[tuple[str, ...], tuple[str, ...]]  # KEYS, ARGV (before the trailer)


class Scripts:
    """Every script loaded into one Redis; :meth:`run` sends one with the prelude's trailer."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.sources = {name: lua_source(name) for name in SCRIPT_NAMES}
        for source in self.sources.values():
            client.script_load(source)

    def run(
        self,
        name: str,
        job: JobKeys,
        call: Call,
        *,
        request_id: str | None = None,
        feed: str = "",
    ) -> list[Any]:
        """The script's reply without the slot counter (the slot's marker is created first).
        ``feed``: the trailer's tenant feed key ('' as on a Cluster: no copy by the script)."""
        self.client.set(job.marker, "1", nx=True)
        rid = request_id or f"r{next(_ids)}"
        keys, args = call
        sha = hashlib.sha1(self.sources[name].encode(), usedforsecurity=False).hexdigest()
        reply = self.client.evalsha(
            sha,
            len(keys) + 2,
            *keys,
            job.req(rid),
            job.marker,
            *args,
            rid,
            str(REQUEST_MEMORY_MS),
            "0",
            "",
            feed,
        )
        assert isinstance(reply, list)
        return reply[1:]

    def register(self, job: JobKeys, generation: int, lease_ms: int | None = None) -> list[Any]:
        lease = "" if lease_ms is None else str(lease_ms)
        return self.run(
            "register-2",
            job,
            (
                (job.job, job.audit),
                (str(generation), lease, job.job_id, job.tenant, RETENTION, str(2**53 - 1), "t"),
            ),
        )


def fenced(job: JobKeys, gen: int, mode: str) -> tuple[str, ...]:
    """ARGV[1..8] of every fenced script, as the store sends them (worker 'w', by 'tester')."""
    return fenced_args(job, gen, mode, "w", RETENTION, "tester", "")


def admit(job: JobKeys, gen: int, mode: str, run_before: str = "") -> Call:
    step = "s"
    return (
        (job.job, job.effect(step), job.audit, job.steps, job.relayq, job.attention),
        (
            *fenced(job, gen, mode),
            step,
            "a" * 64,
            "hook",
            "send",
            f"d{next(_ids)}",
            "30000",
            "0",
            "",
            job.member(step),
            run_before,
        ),
    )


def checkpoint(job: JobKeys, gen: int, mode: str) -> Call:
    return (
        (job.job, job.ckpt, job.audit),
        (*fenced(job, gen, mode), "c", "1", '"w"', "100", "", "256"),
    )


def complete(job: JobKeys, gen: int, mode: str, outputs: str = '["x"]') -> Call:
    """A completion naming an output nobody recorded: it completes nothing ({7}), but it
    passes (or fails) the fence guard like any completion. ``outputs``: the names, JSON."""
    return (
        (job.job, job.outputs, job.audit),
        (*fenced(job, gen, mode), "b" * 64, "null", outputs),
    )


def output_stage(job: JobKeys, gen: int, mode: str) -> Call:
    key = f"{job.tenant}/{job.job_id}/g{gen}/o"
    return (
        (job.job, job.outputs, job.audit),
        (*fenced(job, gen, mode), "o", key, f"u{next(_ids)}", "30000", "0", "text/plain"),
    )


def heartbeat(job: JobKeys, gen: int, mode: str) -> Call:
    return ((job.job, job.audit), fenced(job, gen, mode))


def check(job: JobKeys, gen: int, mode: str) -> Call:
    return (
        (job.job, job.audit),
        (*fenced_args(job, gen, mode, "w", RETENTION, "", ""), "s", "hook"),
    )


RECORDED_UPLOAD = "u-staged"  # the upload id of the entry :func:`stage_entry` writes


def output_record(job: JobKeys, gen: int, mode: str) -> Call:
    """The record of the upload :func:`stage_entry` staged for generation ``gen`` (the record
    never raises the fence: whatever ``mode`` says, above the fence is unregistered)."""
    return (
        (job.job, job.outputs, job.audit),
        (
            *fenced(job, gen, mode),
            "o",
            RECORDED_UPLOAD,
            "5",
            "c" * 64,
            "text/plain",
            "e",
            "record",
            "",
        ),
    )


def stage_entry(client: redis.Redis, job: JobKeys, gen: int) -> None:
    """Output ``o`` of generation ``gen`` staged (the entry output-stage-3 writes), as it is
    when the bytes have been written and the record is sent."""
    entry = {"state": "staged", "key": f"{job.tenant}/{job.job_id}/g{gen}/o", "size": 0,
             "sha256": "", "content_type": "text/plain", "staged_ms": 1, "recorded_ms": 0,
             "presigned": False, "upload": RECORDED_UPLOAD, "deadline": 2**52, "etag": "",
             "worker_id": "w"}  # fmt: skip
    client.hset(job.outputs, f"{gen}/o", json.dumps(entry))


@dataclass(frozen=True)
class Fenced:
    """A fenced script: a call of it by generation ``gen`` in registration mode ``mode``
    (``build``), the step its audit entries name, and what must be in Redis first
    (``prepare``: the record of an output needs its stage)."""

    build: Callable[[JobKeys, int, str], Call]
    step: str
    prepare: Callable[[redis.Redis, JobKeys, int], None] | None = None


# Every script that decides under the fence, with one call of it.
FENCED: dict[str, Fenced] = {
    "admit-8": Fenced(admit, "s"),
    "check-2": Fenced(check, "s"),
    "checkpoint-3": Fenced(checkpoint, "checkpoint:c"),
    "complete-3": Fenced(complete, "job:complete"),
    "output-stage-3": Fenced(output_stage, "output:o"),
    "output-record-3": Fenced(output_record, "output:o", stage_entry),
    "heartbeat-2": Fenced(heartbeat, ""),
}


def complete_job(scripts: Scripts, job: JobKeys, gen: int) -> None:
    """Complete the job by generation ``gen`` (no outputs)."""
    assert scripts.run("complete-3", job, complete(job, gen, "required", "[]"))[0] == 0
