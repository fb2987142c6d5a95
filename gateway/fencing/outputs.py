"""Attempt-scoped job outputs under the fence: stage, stream, record, read.

A worker's output goes to ``<tenant>/<job>/g<generation>/<name>`` in the object store
(:mod:`gateway.objects`), a key no other generation ever writes. Fencing happens on both
sides of the write:

1. **stage** (``output-stage-3.lua``): cancelled, completed, fence, lease — before any
   byte goes out. A stale generation is refused (409, audited with both generations) and
   the store never sees a byte of it.
2. the body streams to the store, hashed on the way (sha256), bounded by
   ``outputs.max_bytes`` (413 as soon as it is passed, never buffered whole), cut at the
   stage's deadline. A failed or cut upload leaves no object (``obstore`` abandons it).
3. **record** (``output-record-3.lua``): the fence again. If it moved while the bytes
   streamed, the record is refused (audited) and the object is an orphan: never
   promoted, deleted by the sweeper (:mod:`gateway.fencing.outputs_sweep`).

Every object is charged to its tenant's output quotas (``quotas.output_bytes``,
``quotas.output_objects``; :class:`gateway.fencing.output_ledger.OutputLedger`): reserved before
the stage (the ``Content-Length``, or step by step as a chunked body arrives; a pre-signed
URL ``outputs.max_bytes``), settled to the object's size once it is written, given back
when nothing was written or the object is deleted. Over a cap: ``429 quota_exceeded``,
nothing stored.

Completion (the ``completed`` field of the job hash, written by the completion script)
promotes one generation's recorded outputs; :meth:`OutputService.open_promoted` serves
exactly those, checked against the recorded etag (a replaced object is refused).

For the completion service (the signature the ``completion`` branch codes against)::

    async def OutputService.ensure_recorded(
        tenant: str, job: str, generation: int, names: Sequence[str]
    ) -> list[str]

records the outputs of ``generation`` that were staged through a pre-signed URL and are
not recorded yet: it copies each staged object (the URL's own staging key) to the output's
key, hashing the bytes it writes, then runs the fenced record and deletes the staged
object (:mod:`gateway.fencing.outputs_presigned`). It returns the names it recorded now; a
missing object, an output that is not presigned-staged, or a record the fence refuses is
left alone (the completion script decides and audits).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Literal

import structlog

from gateway.core.errors import (
    InsufficientStorage,
    InternalError,
    InvalidRequest,
    NotFound,
    ObjectStoreUnavailable,
    OutputInProgress,
    PayloadTooLarge,
    QuotaExceeded,
    RequestTimeout,
    StoreUnavailable,
    TooManyHeld,
    UploadUrlUnsupported,
)
from gateway.core.records import OutputRecord
from gateway.fencing.output_ledger import OutputLedger, made_at_ms, new_upload_id
from gateway.fencing.outputs_presigned import record_presigned
from gateway.fencing.quotas import OUTPUT_STEP, Quotas
from gateway.objects import (
    ObjectStore,
    ObjectStoreError,
    PreconditionFailed,
    output_key,
    signed_key,
)
from gateway.objects.space import CHECK_EVERY
from gateway.runtime.settings import OutputSettings
from gateway.store.keys import JobKeys
from gateway.store.replies import OutputRecordReply, OutputStageReply
from gateway.store.store import Store

__all__ = ["OutputService"]

log = structlog.get_logger("fencegate.outputs")


_NO_SPACE = (
    "the output store's volume is at its free-space floor (outputs.min_free_mb): nothing "
    "was stored; try later or free space"
)


class _NoSpace(Exception):
    pass


class _TooLarge(Exception):
    pass


class _LengthMismatch(Exception):
    pass


class _OverQuota(Exception):
    def __init__(self, problem: QuotaExceeded) -> None:
        self.problem = problem


class OutputService:
    """The fenced outputs of jobs: one per app, shared by the views, completion and CLI."""

    def __init__(
        self,
        store: Store,
        objects: ObjectStore,
        settings: OutputSettings,
        *,
        crash_hook: Callable[[str], None] | None = None,
    ) -> None:
        self._crash = crash_hook or (lambda point: None)  # chaos tests: SIGKILL at a point
        self.store = store
        self.objects = objects
        self.settings = settings
        self._background: set[asyncio.Task[None]] = set()  # claims ended after a lost reply
        self.uploads: dict[str, int] = {}  # tenant -> uploads through this process running
        self.records = store.output_records  # the outputs hashes
        # what each tenant has in the store
        # how long a pre-signed URL is valid
        self.url_seconds = min(settings.upload_timeout_seconds, 7 * 86_400)
        self.ledger = OutputLedger(
            self.records, objects, store.redis_clock_ms, url_ms=int(self.url_seconds * 1000)
        )

    def crash_point(self, point: str) -> None:
        """Chaos tests only (``serve --chaos-crash-at``): may SIGKILL this process here."""
        self._crash(point)

    # -- the fenced scripts -------------------------------------------------------

    async def _stage(
        self,
        keys: JobKeys,
        gen: int,
        name: str,
        worker_id: str,
        *,
        presigned: bool,
        content_type: str,
        seconds: float,
        upload: str,
        by: str = "",
    ) -> tuple[str, int]:
        """The stage decision for ``upload``; ``(key, deadline ms)`` or the typed refusal.
        ``by``: who calls, recorded with an implicit registration."""
        key = output_key(keys.tenant, keys.job_id, gen, name)
        flag = self.store.unaudited_flag(keys.tenant)
        try:
            reply = await self.store.output_stage(
                keys,
                generation=gen,
                name=name,
                object_key=key,
                upload=upload,
                upload_ms=int(seconds * 1000),
                presigned=presigned,
                worker_id=worker_id,
                content_type=content_type,
                by=by,
                unaudited=flag,
            )
        except StoreUnavailable:
            if not presigned:  # it may have run: its claim would lock the output until then
                self._abandon_soon(keys, gen, name, upload)
            raise
        code = int(reply[0])
        if code == OutputStageReply.REJECTED:
            self.store.rejection_spent(keys, f"output:{name}", flag, worker_id, str(reply[4]))
            raise await self.store.rejected(keys, reply, step=f"output:{name}", worker_id=worker_id)
        if code == OutputStageReply.IN_PROGRESS:
            retry = max(1, -(-int(reply[1]) // 1000))
            raise OutputInProgress(
                f"an upload of {name!r} by generation {gen} is still running",
                retry_after=retry,
            )
        return key, int(reply[2])

    async def _charged_stage(
        self,
        keys: JobKeys,
        gen: int,
        name: str,
        worker_id: str,
        *,
        quotas: Quotas | None,
        amount: int,
        at_least: int | None = None,
        presigned: bool,
        content_type: str,
        seconds: float,
        by: str,
    ) -> tuple[str, str, int, int]:
        """Reserve ``amount`` (else ``at_least``) for a new upload of the output, then stage
        it: ``(upload id, key, deadline ms, bytes reserved)``; ``key`` is where the upload
        writes: the output's key, or for a pre-signed URL its own staging key
        (:func:`signed_key`). Nothing is taken over from an earlier upload (an earlier URL may
        still write its own staging key). A refused stage gives the reservation back."""
        upload = new_upload_id(self.store.redis_clock_ms())
        if presigned:
            key = signed_key(keys.tenant, keys.job_id, gen, upload, name)
        else:
            key = output_key(keys.tenant, keys.job_id, gen, name)
        try:
            reserved = await self._reserve(
                quotas,
                keys,
                name,
                key,
                upload,
                amount,
                worker_id,
                at_least=at_least,
            )
        except (asyncio.CancelledError, StoreUnavailable):
            # the reservation may have been made (a client gone or a reply lost after it ran)
            await asyncio.shield(self.ledger.settle(keys.tenant, key, upload, None))
            raise
        except QuotaExceeded:
            if await self._fenced_out(keys, gen):  # the fence's answer first (audited 409)
                await self._stage(
                    keys,
                    gen,
                    name,
                    worker_id,
                    presigned=presigned,
                    content_type=content_type,
                    seconds=seconds,
                    upload=upload,
                    by=by,
                )
                await self._abandon(keys, gen, name, upload)  # not reached: terminal refusals
            raise
        try:
            _, deadline = await self._stage(
                keys,
                gen,
                name,
                worker_id,
                presigned=presigned,
                content_type=content_type,
                seconds=seconds,
                upload=upload,
                by=by,
            )
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError) and not presigned:
                # a client gone while the reply was on its way: the stage may have run, and
                # its claim would lock the output until its deadline (StoreUnavailable: the
                # stage has done the same already)
                self._abandon_soon(keys, gen, name, upload)
            await asyncio.shield(self.ledger.settle(keys.tenant, key, upload, None))
            raise
        return upload, key, deadline, reserved

    async def _fenced_out(self, keys: JobKeys, gen: int) -> bool:
        """Whether the fence refuses ``gen`` for good (below it, or the job cancelled or
        completed): the stage script refuses it then, whatever it is run after."""
        state = await self.records.fence(keys)
        return (
            state.cancelled
            or bool(state.completed)
            or (state.fence is not None and gen < state.fence)
        )

    async def _reserve(
        self,
        quotas: Quotas | None,
        keys: JobKeys,
        name: str,
        key: str,
        upload: str,
        amount: int,
        worker_id: str,
        *,
        at_least: int | None = None,
        replaces: str = "",
    ) -> int:
        if quotas is None:  # no caps (a caller without the app's quotas): still counted
            await self.ledger.reserve(keys.tenant, key, upload, amount, 0, 0, replaces=replaces)
            return amount
        return await quotas.reserve_output(
            self.ledger,
            keys,
            name,
            key,
            upload,
            amount,
            at_least=at_least,
            replaces=replaces,
            worker_id=worker_id,
        )

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
    ) -> OutputRecord | None:
        """Record the upload ``upload`` of output ``name`` of generation ``gen`` under the
        fence (``output-record-3``), or, ``abandon``, end a failed upload's claim. ``copy``:
        the completion's copy of a pre-signed upload that wrote the output's key (its record
        presents it); ``copy_op`` ``copy`` claims that copy for ``size`` ms (another one
        running: ``OutputInProgress``), ``uncopy`` ends the claim. None: a later upload
        replaced it (or another copy holds it); a fence's refusal raises its typed error
        (audited)."""
        reply = await self.store.output_record(
            keys,
            generation=gen,
            name=name,
            upload=upload,
            size=size,
            sha256=sha256,
            content_type=content_type,
            etag=etag,
            worker_id=worker_id,
            abandon=abandon,
            copy=copy,
            copy_op=copy_op,
        )
        code = int(reply[0])
        if code == OutputRecordReply.IN_PROGRESS:
            raise OutputInProgress(
                f"the pre-signed upload of {name!r} by generation {gen} is being recorded by "
                "another completion",
                retry_after=max(1, -(-int(reply[1]) // 1000)),
            )
        if code == OutputRecordReply.REJECTED:
            self.store.rejection_spent(keys, f"output:{name}", "", worker_id, str(reply[4]))
            raise await self.store.rejected(keys, reply, step=f"output:{name}", worker_id=worker_id)
        if code == OutputRecordReply.LOST:
            return None
        return OutputRecord.parse(f"{gen}/{name}", str(reply[1]))

    def _abandon_soon(self, keys: JobKeys, gen: int, name: str, upload: str) -> None:
        """A stage or record whose reply never came may have run: end that upload's claim
        as soon as Redis answers (a no-op once it is recorded or replaced), so the worker's
        retry is not told ``output_in_progress`` until the claim's deadline by a claim
        nobody holds. In the background: the request has its 503 already."""

        async def attempts() -> None:
            for delay in (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0):
                await asyncio.sleep(delay)
                try:
                    await self.record_upload(keys, gen, name, upload, "", abandon=True)
                    return
                except StoreUnavailable:
                    continue
                except Exception as exc:  # the claim still ends at its deadline
                    log.warning("output_abandon_failed", job_id=keys.job_id, error=str(exc))
                    return
            log.warning("output_abandon_gave_up", job_id=keys.job_id, name=name)

        task = asyncio.get_running_loop().create_task(attempts())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _clean_up_failed(
        self, keys: JobKeys, gen: int, name: str, upload: str, key: str
    ) -> None:
        """A failed or cut upload: its partial bytes removed (before the claim is freed), its
        claim ended, its charge given back (an object it replaces is still there)."""
        with contextlib.suppress(ObjectStoreError):
            await self.objects.discard_partial(key)
        await self._abandon(keys, gen, name, upload)
        await self.ledger.settle(keys.tenant, key, upload, None)

    async def _abandon(self, keys: JobKeys, gen: int, name: str, upload: str) -> None:
        """A failed upload frees its claim at once, not at its deadline; if Redis does not
        answer now, as soon as it does (:meth:`_abandon_soon`)."""
        try:
            await asyncio.shield(self.record_upload(keys, gen, name, upload, "", abandon=True))
        except StoreUnavailable:
            self._abandon_soon(keys, gen, name, upload)
        except Exception as exc:  # the claim still ends at its deadline
            log.warning("output_abandon_failed", job_id=keys.job_id, name=name, error=str(exc))

    # -- writes --------------------------------------------------------------------

    async def put(
        self,
        keys: JobKeys,
        gen: int,
        name: str,
        body: AsyncIterator[bytes],
        *,
        content_type: str,
        content_length: int | None,
        worker_id: str = "",
        by: str = "",
        quotas: Quotas | None = None,
    ) -> OutputRecord:
        """Stage, stream ``body`` to the attempt-scoped key (hashing it), record. At most
        ``outputs.uploads_per_tenant`` of a tenant run at once in this process (429). The
        object is charged to the tenant's output quotas, capped by ``quotas``' caps."""
        limit = self.settings.max_bytes
        if content_length is not None and content_length > limit:
            raise PayloadTooLarge(f"an output may be at most {limit} bytes")
        cap, tenant = self.settings.uploads_per_tenant, keys.tenant
        if cap and self.uploads.get(tenant, 0) >= cap:
            raise TooManyHeld(
                f"tenant {tenant!r} has {cap} uploads running (outputs.uploads_per_tenant); "
                "retry when one has ended",
                limit="outputs.uploads_per_tenant",
                retry_after=1,
            )
        self.uploads[tenant] = self.uploads.get(tenant, 0) + 1
        try:
            return await self._put(
                keys,
                gen,
                name,
                body,
                content_type=content_type,
                content_length=content_length,
                worker_id=worker_id,
                by=by,
                quotas=quotas,
            )
        finally:
            if (left := self.uploads[tenant] - 1) > 0:
                self.uploads[tenant] = left
            else:
                del self.uploads[tenant]

    async def _put(
        self,
        keys: JobKeys,
        gen: int,
        name: str,
        body: AsyncIterator[bytes],
        *,
        content_type: str,
        content_length: int | None,
        worker_id: str,
        by: str,
        quotas: Quotas | None,
    ) -> OutputRecord:
        limit = self.settings.max_bytes
        space = self.objects.space
        if space is not None and not space.room_for(content_length or 0):
            raise InsufficientStorage(_NO_SPACE)
        seconds = self.settings.upload_timeout_seconds
        # The claim in Redis runs from the stage script; this put's cut-off runs from
        # before the script was sent, less a margin for the store's commit, so it ends
        # before the claim does even when the stage's reply is late: a retry of the same
        # generation (allowed once the claim ended) never races this put on the key.
        cutoff = asyncio.get_running_loop().time() + seconds - min(seconds / 10, 30.0)
        # a chunked body: a first step, or less if that is what the tenant has left
        chunked = content_length is None
        upload, key, _, reserved = await self._charged_stage(
            keys,
            gen,
            name,
            worker_id,
            quotas=quotas,
            amount=min(OUTPUT_STEP, limit) if chunked else content_length or 0,
            at_least=0 if chunked else None,
            presigned=False,
            content_type=content_type,
            seconds=seconds,
            by=by,
        )
        digest = hashlib.sha256()
        total = 0

        async def hashed() -> AsyncIterator[bytes]:
            nonlocal total, reserved
            unchecked = 0
            async for chunk in body:
                total += len(chunk)
                if total > limit:
                    raise _TooLarge
                if total > reserved:  # a chunked body: reserve the next step (or these bytes)
                    need = total - reserved
                    step = min(max(OUTPUT_STEP, need), limit - reserved)
                    try:
                        reserved += await self._reserve(
                            quotas, keys, name, key, upload, step, worker_id, at_least=need
                        )
                    except QuotaExceeded as exc:
                        raise _OverQuota(exc) from None
                if space is not None:
                    unchecked += len(chunk)
                    if unchecked >= CHECK_EVERY:
                        space.spent(unchecked)
                        unchecked = 0
                        if not space.room_for(0):
                            raise _NoSpace
                digest.update(chunk)
                yield chunk
            if content_length is not None and total != content_length:
                raise _LengthMismatch

        try:
            async with asyncio.timeout_at(cutoff):
                etag = await self.objects.put_stream(key, hashed(), content_type)
        except BaseException as exc:
            # one shielded clean-up: a request cancelled again while it runs (a client that
            # hung up, a shutdown) must still free the claim, not leave it to the deadline
            await asyncio.shield(self._clean_up_failed(keys, gen, name, upload, key))
            if isinstance(exc, _OverQuota):
                raise exc.problem from None
            if isinstance(exc, _TooLarge):
                raise PayloadTooLarge(f"an output may be at most {limit} bytes") from None
            if isinstance(exc, _NoSpace):
                raise InsufficientStorage(_NO_SPACE) from None
            if isinstance(exc, _LengthMismatch):
                raise InvalidRequest(
                    f"the body had {total} bytes, Content-Length said {content_length}"
                ) from None
            if isinstance(exc, TimeoutError):
                raise RequestTimeout("the upload did not finish before its deadline") from None
            if isinstance(exc, ObjectStoreError):
                raise ObjectStoreUnavailable(str(exc)) from exc
            raise
        self._crash("after_output_write")  # the object is written, not recorded
        try:
            entry = await self.record_upload(
                keys,
                gen,
                name,
                upload,
                worker_id,
                size=total,
                sha256=digest.hexdigest(),
                content_type=content_type,
                etag=etag,
            )
        except StoreUnavailable:
            self._abandon_soon(keys, gen, name, upload)  # a no-op if the record ran
            raise
        finally:
            # recorded, refused by the fence (an orphan until swept) or replaced: these
            # bytes are at the key now, charged until the object is deleted
            await asyncio.shield(self.ledger.settle(keys.tenant, key, upload, total))
        if entry is None:
            raise OutputInProgress(
                f"a later upload of {name!r} by generation {gen} replaced this one"
            )
        return entry

    async def upload_url(
        self,
        keys: JobKeys,
        gen: int,
        name: str,
        *,
        content_type: str,
        worker_id: str = "",
        by: str = "",
        quotas: Quotas | None = None,
    ) -> tuple[str, str, int]:
        """The same stage decision, then a pre-signed PUT URL: ``(url, key, expires ms)``.
        The URL writes its own staging key ``key`` (:func:`signed_key`), never the output's:
        the completion copies the object from there (:mod:`gateway.fencing.outputs_presigned`),
        so a PUT through the URL after it never reaches a promoted object.
        ``outputs.max_bytes`` is reserved for it until that completion deletes the staged
        object, else while the URL is valid."""
        if not self.objects.can_sign:
            raise UploadUrlUnsupported(
                f"the {self.objects.kind!r} object store cannot sign URLs: upload with "
                "PUT /v1/jobs/{job}/outputs/{name} through the gateway instead"
            )
        seconds = self.url_seconds
        upload, key, deadline, _ = await self._charged_stage(
            keys,
            gen,
            name,
            worker_id,
            quotas=quotas,
            amount=self.settings.max_bytes,
            presigned=True,
            content_type=content_type,
            seconds=seconds,
            by=by,
        )
        # it expires when its id says (url_valid_until, what the sweeper and the ledger judge
        # by), not a full `seconds` after the reservation and the stage that came first
        # (whole seconds, as S3 reads them: up to one more, within URL_SKEW_MS)
        left = made_at_ms(upload) + int(seconds * 1000) - self.store.redis_clock_ms()
        try:
            if left <= 0:
                raise ObjectStoreError("the stage took longer than the URL's validity")
            url = await self.objects.sign("PUT", key, -(-left // 1000))
        except ObjectStoreError as exc:
            await self.ledger.settle(keys.tenant, key, upload, None)  # no URL: no bytes
            raise ObjectStoreUnavailable(str(exc)) from exc
        return url, key, deadline

    async def ensure_recorded(
        self, tenant: str, job: str, generation: int, names: Sequence[str]
    ) -> list[str]:
        """Record the presigned uploads of ``generation`` among ``names`` (module docstring;
        :func:`gateway.fencing.outputs_presigned.record_presigned`)."""
        return await record_presigned(self, tenant, job, generation, names)

    # -- reads ---------------------------------------------------------------------

    async def entries(self, keys: JobKeys) -> list[OutputRecord]:
        raw = await self.records.entries(keys)
        return sorted(
            (OutputRecord.parse(f, v) for f, v in raw.items()),
            key=lambda e: (e.generation, e.name),
        )

    async def entry(self, keys: JobKeys, gen: int, name: str) -> OutputRecord | None:
        raw = await self.records.entry(keys, f"{gen}/{name}")
        return None if raw is None else OutputRecord.parse(f"{gen}/{name}", raw)

    async def completion(self, keys: JobKeys) -> dict[str, Any] | None:
        raw = await self.records.completion(keys)
        return None if raw is None else dict(json.loads(raw))

    async def promoted(self, keys: JobKeys, name: str) -> OutputRecord:
        """The record of the promoted output ``name``; 404 before completion."""
        done = await self.completion(keys)
        if done is None:
            raise NotFound(f"job {keys.job_id!r} is not completed: no output is promoted yet")
        promoted = (done.get("outputs") or {}).get(name)
        if promoted is None:
            raise NotFound(f"the completion of job {keys.job_id!r} promoted no output {name!r}")
        entry = await self.entry(keys, int(promoted["generation"]), name)
        if (
            entry is None
            or entry.key != promoted.get("key")
            or entry.sha256 != promoted.get("sha256")
        ):
            raise InternalError(f"output {name!r} is promoted but its record does not match")
        return entry

    async def open_promoted(
        self, keys: JobKeys, name: str
    ) -> tuple[OutputRecord, AsyncIterator[bytes]]:
        """The promoted object of ``name`` and its bytes, checked against the recorded etag
        (an object replaced behind the gateway's back is refused, never served)."""
        entry = await self.promoted(keys, name)
        return entry, await self._open(entry, if_match=entry.etag)

    async def open_staged(
        self, keys: JobKeys, gen: int, name: str
    ) -> tuple[OutputRecord, AsyncIterator[bytes]]:
        """Any generation's staged or recorded object (auditors investigating a zombie)."""
        entry = await self.entry(keys, gen, name)
        if entry is None:
            raise NotFound(f"generation {gen} staged no output {name!r}")
        return entry, await self._open(entry, if_match="")

    async def _open(self, entry: OutputRecord, *, if_match: str) -> AsyncIterator[bytes]:
        try:
            opened = await self.objects.open(entry.key, if_match=if_match)
        except PreconditionFailed as exc:
            log.error("output_replaced", key=entry.key, detail=str(exc))
            raise InternalError(
                "the object of this output was replaced in the store after it was recorded "
                "(its etag differs): refusing to serve it"
            ) from exc
        except ObjectStoreError as exc:
            raise ObjectStoreUnavailable(str(exc)) from exc
        if opened is None:
            raise NotFound(f"the object of output {entry.name!r} is not in the store (swept?)")
        return opened[2]

    async def promoted_current(self, keys: JobKeys, name: str) -> OutputRecord:
        """The promoted record of ``name`` after checking that the stored object is still the
        recorded one (a redirect must not send a reader to bytes the completion never saw);
        sign its URL with :meth:`read_url`. The URL stays a window: a replacement after this
        check is served until it expires."""
        entry = await self.promoted(keys, name)
        try:
            info = await self.objects.head(entry.key)
        except ObjectStoreError as exc:
            raise ObjectStoreUnavailable(str(exc)) from exc
        if info is None:
            raise NotFound(f"the object of output {name!r} is not in the store (swept?)")
        if entry.etag and info.etag != entry.etag:
            log.error("output_replaced", key=entry.key, detail="etag differs before a redirect")
            raise InternalError(
                "the object of this output was replaced in the store after it was recorded "
                "(its etag differs): refusing to serve it"
            )
        return entry

    async def read_url(self, entry: OutputRecord, seconds: float) -> str:
        try:
            return await self.objects.sign("GET", entry.key, seconds)
        except ObjectStoreError as exc:
            raise ObjectStoreUnavailable(str(exc)) from exc
