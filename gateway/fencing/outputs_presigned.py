"""Recording outputs uploaded through a pre-signed URL (the completion's first step).

The bytes bypassed the gateway, so nothing hashed them: before the completion script
runs, each named output of the generation that was staged for a signed upload and is not
recorded yet is read once from the store (size, sha256, content type) and the fenced
record script runs for it. A signed URL carries no length bound (obstore signs neither a
Content-Length header nor a POST policy), so the size is checked here: an object larger
than ``outputs.max_bytes`` (its HEAD, or the bytes read) is deleted, its claim ends,
nothing is recorded and the completion is answered ``413 payload_too_large``. Nothing else
is decided here: a record the fence refuses is left to the completion script, which
refuses and audits the completion itself.

The output quotas: the URL's reservation (``outputs.max_bytes``) is settled to the object's
size once it is read (recorded or not: the object is in the store), and an oversized object
deleted here is given back.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Sequence
from typing import NoReturn, Protocol

import structlog

from gateway.core.errors import (
    FencegateError,
    ObjectStoreUnavailable,
    PayloadTooLarge,
    Rejection,
)
from gateway.core.records import OutputRecord
from gateway.fencing.output_ledger import OutputLedger
from gateway.objects import ObjectStore, ObjectStoreError
from gateway.runtime.settings import OutputSettings
from gateway.store.keys import JobKeys
from gateway.store.output_records import OutputRecords

__all__ = ["PresignedOutputs", "record_presigned"]


class PresignedOutputs(Protocol):
    """What recording a presigned upload needs of the output service
    (:class:`gateway.fencing.outputs.OutputService`, which calls it)."""

    settings: OutputSettings
    objects: ObjectStore
    ledger: OutputLedger
    records: OutputRecords

    async def entry(self, keys: JobKeys, gen: int, name: str) -> OutputRecord | None: ...

    async def record_upload(
        self,
        keys: JobKeys,
        gen: int,
        name: str,
        upload: str,
        worker_id: str,
        *,
        size: int = 0,
        sha256: str = "",
        content_type: str = "",
        etag: str = "",
        abandon: bool = False,
    ) -> OutputRecord | None: ...


log = structlog.get_logger("fencegate.outputs")


async def _refuse_oversized(
    service: PresignedOutputs, keys: JobKeys, generation: int, entry: OutputRecord, size: int
) -> NoReturn:
    """A presigned upload larger than ``outputs.max_bytes`` (a signed URL carries no length
    bound): the object is deleted, its claim ends, nothing is recorded; 413."""
    limit, name = service.settings.max_bytes, entry.name
    log.warning("output_presigned_too_large", job_id=keys.job_id, name=name, size=size)
    try:
        await service.objects.delete(entry.key)
    except ObjectStoreError as exc:  # the sweeper deletes it later (never recorded: an orphan)
        log.warning("output_delete_failed", key=entry.key, error=str(exc))
        await service.ledger.settle(keys.tenant, entry.key, entry.upload, size)
    else:
        await service.ledger.released(keys.tenant, [entry.key], [f"{entry.key} {entry.upload}"])
    with contextlib.suppress(FencegateError):
        await service.record_upload(keys, generation, name, entry.upload, "", abandon=True)
    raise PayloadTooLarge(
        f"the object uploaded for output {name!r} has {size} bytes; an output may be at most "
        f"{limit} bytes (outputs.max_bytes): it was deleted and nothing was recorded"
    )


async def record_presigned(
    service: PresignedOutputs, tenant: str, job: str, generation: int, names: Sequence[str]
) -> list[str]:
    """Record the presigned uploads of ``generation`` among ``names`` (module docstring)."""
    keys = JobKeys(tenant, job)
    state = await service.records.fence(keys)
    if state.cancelled or state.completed or state.fence != generation:
        return []  # the completion script refuses it (and audits) by itself
    done: list[str] = []
    for name in names:
        entry = await service.entry(keys, generation, name)
        if entry is None or entry.state != "staged" or not entry.presigned:
            continue
        try:
            head = await service.objects.head(entry.key)
            if head is None:
                continue
            if head.size > service.settings.max_bytes:
                await _refuse_oversized(service, keys, generation, entry, head.size)
            opened = await service.objects.open(entry.key, if_match=head.etag)
            if opened is None:
                continue
            info, ctype, chunks = opened
            digest, size = hashlib.sha256(), 0
            async for chunk in chunks:
                digest.update(chunk)
                size += len(chunk)
                if size > service.settings.max_bytes:  # replaced since the HEAD: refused too
                    await _refuse_oversized(service, keys, generation, entry, size)
        except ObjectStoreError as exc:
            raise ObjectStoreUnavailable(str(exc)) from exc
        # these bytes are at the key, recorded below or not: charged until deleted
        await service.ledger.settle(tenant, entry.key, entry.upload, size)
        try:
            recorded = await service.record_upload(
                keys,
                generation,
                name,
                entry.upload,
                entry.worker_id,
                size=size,
                sha256=digest.hexdigest(),
                content_type=ctype or entry.content_type,
                etag=info.etag,
            )
        except Rejection as exc:  # refused by the fence: the completion script decides
            log.info("output_record_refused", job_id=job, name=name, reason=str(exc))
            continue
        if recorded is not None:
            done.append(name)
    return done
