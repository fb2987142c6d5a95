"""Attempt-scoped job outputs under the fence (issue 16): stage, stream, record, read.

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

Completion (the ``completed`` field of the job hash, written by the completion script)
promotes one generation's recorded outputs; :meth:`OutputService.open_promoted` serves
exactly those, checked against the recorded etag (a replaced object is refused).

For the completion service (the signature the ``completion`` branch codes against)::

    async def OutputService.ensure_recorded(
        tenant: str, job: str, generation: int, names: Sequence[str]
    ) -> list[str]

records the outputs of ``generation`` that were staged through a pre-signed URL and are
not recorded yet: it reads each object once (size, sha256, content type from the store's
metadata; the sha256 needs the read), then runs the fenced record. It returns the names
it recorded now; a missing object, an output that is not presigned-staged, or a record
the fence refuses is left alone (the completion script decides and audits).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import structlog
from redis.exceptions import RedisError

from gateway.core.errors import (
    InsufficientStorage,
    InternalError,
    InvalidRequest,
    NotFound,
    ObjectStoreUnavailable,
    OutputInProgress,
    PayloadTooLarge,
    RequestTimeout,
    StoreUnavailable,
    TooManyHeld,
    UploadUrlUnsupported,
)
from gateway.fencing.output_entry import OutputEntry
from gateway.objects import ObjectStore, ObjectStoreError, PreconditionFailed, output_key
from gateway.objects.space import CHECK_EVERY
from gateway.runtime.settings import OutputSettings
from gateway.store.keys import JobKeys
from gateway.store.store import Store

__all__ = ["OutputEntry", "OutputService"]

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


async def _redis(call: Any) -> Any:
    try:
        return await call
    except (RedisError, OSError) as exc:
        raise StoreUnavailable(f"Redis is unreachable: {type(exc).__name__}") from exc


class OutputService:
    """The fenced outputs of jobs: one per app, shared by the views, completion and CLI."""

    def __init__(
        self,
        store: Store,
        objects: ObjectStore,
        settings: OutputSettings,
        *,
        registration: str,
        retention_seconds: int,
        crash_hook: Callable[[str], None] | None = None,
    ) -> None:
        self._crash = crash_hook or (lambda point: None)  # chaos tests: SIGKILL at a point
        self.store = store
        self.objects = objects
        self.settings = settings
        self._registration = registration
        self._retention = str(retention_seconds)
        self._background: set[asyncio.Task[None]] = set()  # claims ended after a lost reply
        self.uploads: dict[str, int] = {}  # tenant -> uploads through this process running

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
        by: str = "",
    ) -> tuple[str, str, int]:
        """The stage decision; ``(upload id, key, deadline ms)`` or the typed refusal. ``by``:
        who calls, recorded with an implicit registration."""
        key = output_key(keys.tenant, keys.job_id, gen, name)
        upload = secrets.token_hex(8)
        try:
            reply = await self.store.script(
                "output-stage-3",
                keys,
                (keys.job, keys.outputs, keys.audit),
                (str(gen), self._registration, name, key, upload, str(int(seconds * 1000)),
                 "1" if presigned else "0", keys.job_id, keys.tenant, worker_id,
                 self._retention, content_type, by),
            )  # fmt: skip
        except StoreUnavailable:
            if not presigned:  # it may have run: its claim would lock the output until then
                self._abandon_soon(keys, gen, name, upload)
            raise
        code = int(reply[0])
        if code == 9:
            raise await self.store.rejected(keys, reply, step=f"output:{name}", worker_id=worker_id)
        if code == 2:
            retry = max(1, -(-int(reply[1]) // 1000))
            raise OutputInProgress(
                f"an upload of {name!r} by generation {gen} is still running",
                retry_after=retry,
            )
        return upload, key, int(reply[2])

    async def _record(
        self, keys: JobKeys, gen: int, name: str, upload: str, worker_id: str, *,
        size: int = 0, sha256: str = "", content_type: str = "", etag: str = "",
        abandon: bool = False,
    ) -> OutputEntry | None:  # fmt: skip
        """The record (or, ``abandon``, the end of a failed upload's claim). None: lost."""
        reply = await self.store.script(
            "output-record-3",
            keys,
            (keys.job, keys.outputs, keys.audit),
            (str(gen), name, upload, str(size), sha256, content_type, etag, keys.job_id,
             keys.tenant, worker_id, self._retention, "abandon" if abandon else "record"),
        )  # fmt: skip
        code = int(reply[0])
        if code == 9:
            raise await self.store.rejected(keys, reply, step=f"output:{name}", worker_id=worker_id)
        if code == 1:
            return None
        return OutputEntry.parse(f"{gen}/{name}", str(reply[1]))

    def _abandon_soon(self, keys: JobKeys, gen: int, name: str, upload: str) -> None:
        """A stage or record whose reply never came may have run: end that upload's claim
        as soon as Redis answers (a no-op once it is recorded or replaced), so the worker's
        retry is not told ``output_in_progress`` until the claim's deadline by a claim
        nobody holds. In the background: the request has its 503 already."""

        async def attempts() -> None:
            for delay in (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0):
                await asyncio.sleep(delay)
                try:
                    await self._record(keys, gen, name, upload, "", abandon=True)
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

    async def _abandon(self, keys: JobKeys, gen: int, name: str, upload: str) -> None:
        """Best effort: a failed upload frees its claim at once, not at its deadline."""
        try:
            await asyncio.shield(self._record(keys, gen, name, upload, "", abandon=True))
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
    ) -> OutputEntry:
        """Stage, stream ``body`` to the attempt-scoped key (hashing it), record. At most
        ``outputs.uploads_per_tenant`` of a tenant run at once in this process (429)."""
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
                keys, gen, name, body, content_type=content_type,
                content_length=content_length, worker_id=worker_id, by=by,
            )  # fmt: skip
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
    ) -> OutputEntry:
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
        upload, key, _ = await self._stage(
            keys, gen, name, worker_id, presigned=False, content_type=content_type,
            seconds=seconds, by=by,
        )  # fmt: skip
        digest = hashlib.sha256()
        total = 0

        async def hashed() -> AsyncIterator[bytes]:
            nonlocal total
            unchecked = 0
            async for chunk in body:
                total += len(chunk)
                if total > limit:
                    raise _TooLarge
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
            with contextlib.suppress(ObjectStoreError):  # before the claim is freed
                await self.objects.discard_partial(key)
            await self._abandon(keys, gen, name, upload)
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
            entry = await self._record(
                keys, gen, name, upload, worker_id, size=total, sha256=digest.hexdigest(),
                content_type=content_type, etag=etag,
            )  # fmt: skip
        except StoreUnavailable:
            self._abandon_soon(keys, gen, name, upload)  # a no-op if the record ran
            raise
        if entry is None:
            raise OutputInProgress(
                f"a later upload of {name!r} by generation {gen} replaced this one"
            )
        return entry

    async def upload_url(
        self, keys: JobKeys, gen: int, name: str, *, content_type: str, worker_id: str = "",
        by: str = "",
    ) -> tuple[str, str, int]:  # fmt: skip
        """The same stage decision, then a pre-signed PUT URL: ``(url, key, expires ms)``."""
        if not self.objects.can_sign:
            raise UploadUrlUnsupported(
                f"the {self.objects.kind!r} object store cannot sign URLs: upload with "
                "PUT /v1/jobs/{job}/outputs/{name} through the gateway instead"
            )
        seconds = min(self.settings.upload_timeout_seconds, 7 * 86_400)
        _, key, deadline = await self._stage(
            keys, gen, name, worker_id, presigned=True, content_type=content_type,
            seconds=seconds, by=by,
        )  # fmt: skip
        try:
            url = await self.objects.sign("PUT", key, seconds)
        except ObjectStoreError as exc:
            raise ObjectStoreUnavailable(str(exc)) from exc
        return url, key, deadline

    async def ensure_recorded(
        self, tenant: str, job: str, generation: int, names: Sequence[str]
    ) -> list[str]:
        """Record the presigned uploads of ``generation`` among ``names`` (module docstring;
        :func:`gateway.fencing.outputs_presigned.record_presigned`)."""
        from gateway.fencing.outputs_presigned import record_presigned

        return await record_presigned(self, tenant, job, generation, names)

    # -- reads ---------------------------------------------------------------------

    async def entries(self, keys: JobKeys) -> list[OutputEntry]:
        raw: dict[str, str] = await _redis(self.store.client.hgetall(keys.outputs))
        return sorted(
            (OutputEntry.parse(_s(f), _s(v)) for f, v in raw.items()),
            key=lambda e: (e.generation, e.name),
        )

    async def entry(self, keys: JobKeys, gen: int, name: str) -> OutputEntry | None:
        raw = await _redis(self.store.client.hget(keys.outputs, f"{gen}/{name}"))
        return None if raw is None else OutputEntry.parse(f"{gen}/{name}", _s(raw))

    async def completion(self, keys: JobKeys) -> dict[str, Any] | None:
        raw = await _redis(self.store.client.hget(keys.job, "completed"))
        return None if raw is None else dict(json.loads(raw))

    async def promoted(self, keys: JobKeys, name: str) -> OutputEntry:
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
    ) -> tuple[OutputEntry, AsyncIterator[bytes]]:
        """The promoted object of ``name`` and its bytes, checked against the recorded etag
        (an object replaced behind the gateway's back is refused, never served)."""
        entry = await self.promoted(keys, name)
        return entry, await self._open(entry, if_match=entry.etag)

    async def open_staged(
        self, keys: JobKeys, gen: int, name: str
    ) -> tuple[OutputEntry, AsyncIterator[bytes]]:
        """Any generation's staged or recorded object (auditors investigating a zombie)."""
        entry = await self.entry(keys, gen, name)
        if entry is None:
            raise NotFound(f"generation {gen} staged no output {name!r}")
        return entry, await self._open(entry, if_match="")

    async def _open(self, entry: OutputEntry, *, if_match: str) -> AsyncIterator[bytes]:
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

    async def promoted_current(self, keys: JobKeys, name: str) -> OutputEntry:
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

    async def read_url(self, entry: OutputEntry, seconds: float) -> str:
        try:
            return await self.objects.sign("GET", entry.key, seconds)
        except ObjectStoreError as exc:
            raise ObjectStoreUnavailable(str(exc)) from exc


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
