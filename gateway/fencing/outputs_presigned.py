"""Recording outputs uploaded through a pre-signed URL (the completion's first step).

A pre-signed URL writes its own staging key ``<tenant>/<job>/g<gen>/.signed/<upload>/<name>``
(:func:`gateway.objects.signed_key`), never the output's key: the URL stays valid until it
expires, and its holder may PUT again at any time, so the key it writes can never be the
one a completion promotes. Before the completion script runs, each named output of the
generation that was staged for a signed upload and is not recorded yet is copied:

1. the copy is claimed (``output-record-3`` ``copy``, fenced like a record): one copy of an
   upload at a time, and no stage of the output while it runs; another one running answers
   ``409 output_in_progress``;
2. the staged object is read once (its HEAD, then a read of exactly that version) and its
   bytes are streamed to the output's key while they are hashed: the size, sha256 and etag
   recorded are those of what was written there, whatever the URL's holder PUTs meanwhile;
3. the fenced record script runs, presenting the copy's claim (a copy whose claim was taken
   over records nothing);
4. the staged object is deleted (a PUT through the URL after that writes the staging key
   again: never recorded, never served, deleted by the sweeper).

A signed URL carries no length bound (obstore signs neither a Content-Length header nor a
POST policy), so the size is checked here: an object larger than ``outputs.max_bytes`` (its
HEAD, or the bytes read) is deleted, its claim ends, nothing is recorded and the completion
is answered ``413 payload_too_large``. Nothing else is decided here: a record the fence
refuses is left to the completion script, which refuses and audits the completion itself.
A completion sent again finds the output recorded and deletes a staged object a killed
completion left; one killed before its record copies again (its claim held the output
until :func:`copy_seconds` ran out).

The output quotas: the staged object is covered by its URL's reservation
(``outputs.max_bytes``); the copy is charged to the output's key before a byte of it is
written (at the staged object's size, without a cap: it is the same output, and the staged
object is given back right after) and settled to what was written; the staged object's
charge and its URL's reservation are given back once it is deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Literal, NoReturn, Protocol

import structlog

from gateway.core.errors import (
    FencegateError,
    ObjectStoreUnavailable,
    PayloadTooLarge,
    Rejection,
)
from gateway.core.records import OutputRecord
from gateway.fencing.output_ledger import OutputLedger
from gateway.objects import ObjectStore, ObjectStoreError, PreconditionFailed, signed_key
from gateway.runtime.settings import OutputSettings
from gateway.store.keys import JobKeys
from gateway.store.output_records import OutputRecords

__all__ = ["COPY_BYTES_PER_SECOND", "PresignedOutputs", "copy_seconds", "record_presigned"]


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
        copy: str = "",
        copy_op: Literal["", "copy", "uncopy"] = "",
    ) -> OutputRecord | None: ...

    def crash_point(self, point: str) -> None: ...


log = structlog.get_logger("fencegate.outputs")

# The copy's claim: a minute, plus the object's bytes at this rate, at most the upload
# timeout. A gateway killed mid-copy holds the output that long (the completion answers
# 409 output_in_progress with Retry-After until then).
COPY_BYTES_PER_SECOND = 4 * 1024 * 1024
READ_ATTEMPTS = 3  # the staged object replaced between its HEAD and its read: read again


def copy_seconds(settings: OutputSettings, size: int) -> float:
    """How long the copy of a staged object of ``size`` bytes may hold its output."""
    return min(settings.upload_timeout_seconds, 60.0 + size / COPY_BYTES_PER_SECOND)


class _TooLarge(Exception):
    def __init__(self, size: int) -> None:
        self.size = size


async def _refuse_oversized(
    service: PresignedOutputs, keys: JobKeys, generation: int, entry: OutputRecord, size: int
) -> NoReturn:
    """A presigned upload larger than ``outputs.max_bytes`` (a signed URL carries no length
    bound): the staged object is deleted, the upload's claim (and a copy's) ends, nothing is
    recorded; 413."""
    limit, name = service.settings.max_bytes, entry.name
    staged = signed_key(keys.tenant, keys.job_id, generation, entry.upload, name)
    log.warning("output_presigned_too_large", job_id=keys.job_id, name=name, size=size)
    try:
        await service.objects.delete(staged)
    except ObjectStoreError as exc:  # the sweeper deletes it later (never recorded: an orphan)
        log.warning("output_delete_failed", key=staged, error=str(exc))
        await service.ledger.settle(keys.tenant, staged, entry.upload, size)
    else:
        await service.ledger.released(keys.tenant, [staged], [f"{staged} {entry.upload}"])
    with contextlib.suppress(FencegateError):
        await service.record_upload(keys, generation, name, entry.upload, "", abandon=True)
    raise PayloadTooLarge(
        f"the object uploaded for output {name!r} has {size} bytes; an output may be at most "
        f"{limit} bytes (outputs.max_bytes): it was deleted and nothing was recorded"
    )


async def _drop_staged(service: PresignedOutputs, tenant: str, staged: str, upload: str) -> None:
    """Delete a staged object whose bytes are recorded at the output's key; its charge and
    its URL's reservation are given back. Best effort: the sweeper deletes what is left."""
    try:
        await service.objects.delete(staged)
    except ObjectStoreError as exc:
        log.warning("output_delete_failed", key=staged, error=str(exc))
        return
    await service.ledger.released(tenant, [staged], [f"{staged} {upload}"])


async def record_presigned(
    service: PresignedOutputs, tenant: str, job: str, generation: int, names: Sequence[str]
) -> list[str]:
    """Record the presigned uploads of ``generation`` among ``names`` (module docstring);
    the names recorded now."""
    keys = JobKeys(tenant, job)
    state = await service.records.fence(keys)
    if state.cancelled or state.completed or state.fence != generation:
        return []  # the completion script refuses it (and audits) by itself
    done: list[str] = []
    for name in names:
        entry = await service.entry(keys, generation, name)
        if entry is None or not entry.presigned:
            continue
        staged = signed_key(tenant, job, generation, entry.upload, name)
        if entry.state == "recorded":  # a completion sent again: what a killed one left
            await _drop_staged(service, tenant, staged, entry.upload)
            continue
        if entry.state != "staged":
            continue
        if await _copy(service, keys, generation, entry, staged):
            done.append(name)
    return done


async def _copy(
    service: PresignedOutputs, keys: JobKeys, gen: int, entry: OutputRecord, staged: str
) -> bool:
    """Steps 1 to 4 of the module docstring for one output; whether it was recorded now."""
    loop = asyncio.get_running_loop()
    try:
        head = await service.objects.head(staged)
    except ObjectStoreError as exc:
        raise ObjectStoreUnavailable(str(exc)) from exc
    if head is None:
        return False  # nothing uploaded: the completion script answers output_not_staged
    if head.size > service.settings.max_bytes:
        await _refuse_oversized(service, keys, gen, entry, head.size)
    seconds = copy_seconds(service.settings, head.size)
    # the claim runs from the script; the copy's cut-off from before it was sent, less a
    # margin for the store's commit: a copy never writes after its claim ended
    cutoff = loop.time() + seconds - min(seconds / 10, 30.0)
    copy = secrets.token_hex(8)
    claimed = await service.record_upload(
        keys,
        gen,
        entry.name,
        entry.upload,
        entry.worker_id,
        size=int(seconds * 1000),
        copy=copy,
        copy_op="copy",
    )
    if claimed is None:
        return False  # another upload replaced this one, or it was recorded meanwhile
    try:
        async with asyncio.timeout_at(cutoff):
            written = await _write(service, keys, gen, entry, staged)
    except BaseException as exc:
        await asyncio.shield(_uncopy(service, keys, gen, entry, copy))
        if isinstance(exc, _TooLarge):  # replaced since the HEAD by a larger one: refused too
            await _refuse_oversized(service, keys, gen, entry, exc.size)
        if isinstance(exc, TimeoutError):
            raise ObjectStoreUnavailable(
                f"the copy of output {entry.name!r} did not finish in {seconds:.0f} s"
            ) from None
        if isinstance(exc, ObjectStoreError):
            raise ObjectStoreUnavailable(str(exc)) from exc
        raise
    if written is None:  # deleted since the HEAD
        await _uncopy(service, keys, gen, entry, copy)
        return False
    size, sha256, content_type, etag = written
    service.crash_point("after_presigned_copy")  # the output's key is written, not recorded
    try:
        recorded = await service.record_upload(
            keys,
            gen,
            entry.name,
            entry.upload,
            entry.worker_id,
            size=size,
            sha256=sha256,
            content_type=content_type,
            etag=etag,
            copy=copy,
        )
    except Rejection as exc:  # refused by the fence: the completion script decides
        log.info("output_record_refused", job_id=keys.job_id, name=entry.name, reason=str(exc))
        return False
    if recorded is None:
        return False
    await _drop_staged(service, keys.tenant, staged, entry.upload)
    return True


async def _uncopy(
    service: PresignedOutputs, keys: JobKeys, gen: int, entry: OutputRecord, copy: str
) -> None:
    """A copy that failed ends its claim (else it ends at its deadline)."""
    try:
        await service.record_upload(
            keys, gen, entry.name, entry.upload, "", copy=copy, copy_op="uncopy"
        )
    except FencegateError as exc:
        log.warning("output_uncopy_failed", job_id=keys.job_id, name=entry.name, error=str(exc))


async def _write(
    service: PresignedOutputs, keys: JobKeys, gen: int, entry: OutputRecord, staged: str
) -> tuple[int, str, str, str] | None:
    """Stream the staged object to the output's key, hashing it: ``(size, sha256, content
    type, etag of the output's key)``; None when the staged object is gone. The output's key
    is charged before the write and settled to what was written (given back if nothing)."""
    limit, tenant = service.settings.max_bytes, keys.tenant
    for _ in range(READ_ATTEMPTS):
        head = await service.objects.head(staged)
        if head is None:
            return None
        if head.size > limit:
            raise _TooLarge(head.size)
        try:
            opened = await service.objects.open(staged, if_match=head.etag)
        except PreconditionFailed:
            continue  # the URL's holder replaced it between the HEAD and the read
        if opened is None:
            return None
        break
    else:
        raise ObjectStoreError(f"object {staged} kept changing while it was read")
    _, ctype, chunks = opened
    digest, size = hashlib.sha256(), 0

    async def hashed() -> AsyncIterator[bytes]:
        nonlocal size
        async for chunk in chunks:
            size += len(chunk)
            if size > limit:
                raise _TooLarge(size)
            digest.update(chunk)
            yield chunk

    content_type = ctype or entry.content_type
    # charged before a byte is written: the output's key and the staged object are two
    # objects until the staged one is deleted (no cap: it is the same output)
    await service.ledger.reserve(tenant, entry.key, entry.upload, head.size, 0, 0)
    try:
        etag = await service.objects.put_stream(entry.key, hashed(), content_type)
    except BaseException:
        # a failed put leaves no object (one it would have replaced is still there)
        await asyncio.shield(service.ledger.settle(tenant, entry.key, entry.upload, None))
        raise
    # these bytes are at the output's key, recorded below or not: charged until deleted
    await service.ledger.settle(tenant, entry.key, entry.upload, size)
    return size, digest.hexdigest(), content_type, etag
