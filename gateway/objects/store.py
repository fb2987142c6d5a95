"""One object store for job outputs, local filesystem or S3, behind one small async API.

Everything goes through ``obstore`` (Rust ``object_store`` underneath): streamed puts
from an async iterator (multipart on S3, a staging file renamed into place on the local
filesystem — a put that fails or is cancelled half-way leaves no object behind), ranged
streamed gets, listing, idempotent deletes and, for S3, signed URLs. No hand-written
HTTP client, no boto.

Keys: ``<prefix><tenant>/<job>/g<generation>/<name>`` (:func:`output_key`), and for an
upload through a pre-signed URL ``<prefix><tenant>/<job>/g<generation>/.signed/<upload
id>/<name>`` (:func:`signed_key`): the URL writes there, never to the output's key (an
output name never starts with ``.``, so no output key is ever a signed one). Tenant and
job are names (:data:`gateway.core.names.NAME`: no ``/``), the generation is a decimal
integer and the name is checked by :func:`valid_output_name` before any key is built, so
a key can never leave its attempt's prefix (no ``..``, no absolute path, no separator, no
NUL).

The file store is private to the gateway's user, whatever the umask: its root folder is
made mode 0700 at start, and every object written is mode 0600 in folders of mode 0700
(obstore creates them with the umask's modes; they are narrowed once the put has ended,
and the 0700 root keeps every other local user out before that).
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from glob import escape as glob_escape
from pathlib import Path
from typing import Any, Literal

import obstore
from obstore.exceptions import BaseError as ObstoreBaseError
from obstore.exceptions import PreconditionError
from obstore.store import LocalStore, S3Store

from gateway.core.names import NAME
from gateway.objects.space import SpaceFloor
from gateway.runtime.settings import ConfigError, OutputSettings, Settings

__all__ = [
    "ObjectInfo",
    "ObjectStore",
    "ObjectStoreError",
    "PreconditionFailed",
    "build_object_store",
    "output_key",
    "parse_output_key",
    "parse_signed_key",
    "runtime_started",
    "signed_key",
    "staged_key",
    "valid_output_name",
]

# an output name is one path segment, a name (gateway.core.names.NAME): the first character
# alphanumeric (no ".", "..", hidden or absolute names), then letters, digits, ".", "_", "-";
# at most 128 characters. Tenant and job are names too.
_PART = NAME.pattern
_KEY = re.compile(rf"({_PART})/({_PART})/g([1-9][0-9]{{0,15}})/({_PART})")
# an upload id (gateway.fencing.output_ledger.new_upload_id: hex)
_UPLOAD = re.compile(r"[0-9a-f]{1,64}")
_SIGNED = re.compile(
    rf"({_PART})/({_PART})/g([1-9][0-9]{{0,15}})/\.signed/({_UPLOAD.pattern})/({_PART})"
)
# the local store writes a put to "<key>#<n>" and renames it into place when it ends: a
# process killed mid-put leaves that file behind, and the store's listing never shows it
_STAGING = re.compile(r"(.+)#[0-9]{1,20}")

Kind = Literal["file", "s3"]
_runtime = {"started": False}  # set by the first async call into obstore (see runtime_started)


def runtime_started() -> bool:
    """Whether this process made an async call into obstore. Its Rust runtime (tokio, through
    pyo3-async-runtimes) is never shut down: a worker thread of it can touch Python while the
    interpreter finalizes, which aborts the process (SIGABRT) after all the work is done. A
    command that used it leaves with ``os._exit`` once everything is flushed and closed
    (gateway/__main__.py)."""
    return _runtime["started"]


class ObjectStoreError(Exception):
    """The object store failed (unreachable, refused, I/O error): nothing is recorded."""


class PreconditionFailed(ObjectStoreError):
    """A conditional read found another version of the object than the one recorded."""


def valid_output_name(name: str) -> bool:
    """One safe path segment (see the module docstring); ``..`` or ``a/b`` never pass."""
    return NAME.fullmatch(name) is not None and ".." not in name


def output_key(tenant: str, job: str, generation: int, name: str) -> str:
    """The attempt-scoped key, without the store's prefix: ``<tenant>/<job>/g<gen>/<name>``."""
    if not valid_output_name(name):  # the views check first; this is the last line
        raise ValueError(f"not a valid output name: {name!r}")
    return f"{tenant}/{job}/g{generation}/{name}"


def parse_output_key(key: str) -> tuple[str, str, int, str] | None:
    """``(tenant, job, generation, name)`` of a key built by :func:`output_key`, else None."""
    m = _KEY.fullmatch(key)
    if m is None or ".." in m[4]:
        return None
    return m[1], m[2], int(m[3]), m[4]


def signed_key(tenant: str, job: str, generation: int, upload: str, name: str) -> str:
    """Where a pre-signed URL of upload ``upload`` writes output ``name``:
    ``<tenant>/<job>/g<gen>/.signed/<upload>/<name>``, under the attempt's prefix (the
    sweeper and the quota reconciliation list by tenant) and never the output's own key (the
    completion copies it there)."""
    if not valid_output_name(name) or _UPLOAD.fullmatch(upload) is None:
        raise ValueError(f"not a valid signed upload: {upload!r}, {name!r}")
    return f"{tenant}/{job}/g{generation}/.signed/{upload}/{name}"


def parse_signed_key(key: str) -> tuple[str, str, int, str, str] | None:
    """``(tenant, job, generation, upload, name)`` of a key built by :func:`signed_key`."""
    m = _SIGNED.fullmatch(key)
    if m is None or ".." in m[5]:
        return None
    return m[1], m[2], int(m[3]), m[4], m[5]


def staged_key(key: str) -> str | None:
    """The object key of a staging file's key ``<output key>#<n>``, else None."""
    m = _STAGING.fullmatch(key)
    return m[1] if m is not None and parse_output_key(m[1]) is not None else None


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str  # without the store's prefix
    size: int
    last_modified: datetime
    etag: str


def _info(meta: Any, prefix: str) -> ObjectInfo:
    path = str(meta["path"])
    return ObjectInfo(
        key=path[len(prefix) :] if path.startswith(prefix) else path,
        size=int(meta["size"]),
        last_modified=meta["last_modified"],
        etag=str(meta.get("e_tag") or ""),
    )


class ObjectStore:
    """The outputs' object store. Every method raises :class:`ObjectStoreError` on failure."""

    def __init__(self, store: LocalStore | S3Store, kind: Kind, prefix: str, where: str) -> None:
        self._store = store
        self.kind: Kind = kind
        self.prefix = prefix
        self.where = where  # for logs and the CLI: the directory or s3://bucket/prefix
        # the file store's free-space floor (gateway.objects.space); None on S3
        self.space: SpaceFloor | None = None

    @property
    def can_sign(self) -> bool:
        return self.kind == "s3"

    async def put_stream(self, key: str, chunks: AsyncIterator[bytes], content_type: str) -> str:
        """Stream ``chunks`` to ``key`` (replacing what is there); returns the new etag. An
        exception raised by the iterator propagates unchanged after the partial upload is
        abandoned: no object is left (a multipart upload aborted, a staging file removed)."""
        attributes: Any = {"Content-Type": content_type} if self.kind == "s3" else None
        _runtime["started"] = True
        try:
            result = await obstore.put_async(
                self._store,
                self.prefix + key,
                chunks,
                attributes=attributes,
                chunk_size=8 * 1024 * 1024,
            )
        except (ObstoreBaseError, OSError) as exc:
            raise ObjectStoreError(f"object store put failed: {exc}") from exc
        if self.kind == "file":
            try:
                await asyncio.to_thread(_private, Path(self.where), self.prefix + key)
            except OSError as exc:
                raise ObjectStoreError(f"object store put failed: {exc}") from exc
        return str(result.get("e_tag") or "")

    async def head(self, key: str) -> ObjectInfo | None:
        _runtime["started"] = True
        try:
            meta = await obstore.head_async(self._store, self.prefix + key)
        except FileNotFoundError:
            return None
        except (ObstoreBaseError, OSError) as exc:
            raise ObjectStoreError(f"object store head failed: {exc}") from exc
        return _info(meta, self.prefix)

    async def open(
        self, key: str, *, if_match: str = ""
    ) -> tuple[ObjectInfo, str | None, AsyncIterator[bytes]] | None:
        """``(info, content type or None, chunks)`` of ``key``; None when it does not exist.
        ``if_match``: the etag recorded for it; another version raises
        :class:`PreconditionFailed` (the object was replaced behind the gateway's back)."""
        options: Any = {"if_match": if_match} if if_match else None
        _runtime["started"] = True
        try:
            result = await obstore.get_async(self._store, self.prefix + key, options=options)
        except FileNotFoundError:
            return None
        except PreconditionError as exc:
            raise PreconditionFailed(f"object {key} is not the recorded version") from exc
        except (ObstoreBaseError, OSError) as exc:
            raise ObjectStoreError(f"object store get failed: {exc}") from exc
        ctype = result.attributes.get("Content-Type")
        stream = result.stream(min_chunk_size=256 * 1024)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream:
                    yield bytes(chunk)
            except (ObstoreBaseError, OSError) as exc:
                raise ObjectStoreError(f"object store read failed: {exc}") from exc

        return _info(result.meta, self.prefix), str(ctype) if ctype else None, chunks()

    async def delete(self, key: str) -> bool:
        """Delete ``key``; idempotent (a missing object is not an error). True if it existed
        as far as the store tells (S3 does not tell: always True there)."""
        _runtime["started"] = True
        try:
            await obstore.delete_async(self._store, self.prefix + key)
        except FileNotFoundError:
            return False
        except (ObstoreBaseError, OSError) as exc:
            raise ObjectStoreError(f"object store delete failed: {exc}") from exc
        return True

    async def list(self, under: str = "") -> AsyncIterator[ObjectInfo]:
        """Every object under ``under`` (a key prefix below the store's prefix)."""
        _runtime["started"] = True
        try:
            async for batch in obstore.list(self._store, self.prefix + under, chunk_size=1000):
                for meta in batch:
                    yield _info(meta, self.prefix)
        except FileNotFoundError:
            return
        except (ObstoreBaseError, OSError) as exc:
            raise ObjectStoreError(f"object store list failed: {exc}") from exc

    async def staging(self) -> Sequence[ObjectInfo]:
        """The local store's staging files (``<key>#<n>``) under the prefix: puts that have
        not ended, or never will (the process died mid-put). Their ``key`` keeps the
        ``#<n>`` suffix; :func:`staged_key` gives the object's key. S3 shows none (an
        unfinished multipart upload is not listed: a bucket lifecycle rule aborts them)."""
        if self.kind != "file":
            return []
        root = Path(self.where)

        def walk() -> list[ObjectInfo]:
            found: list[ObjectInfo] = []
            for path in root.rglob("*#*"):
                if path.is_symlink() or not path.is_file() or not _STAGING.fullmatch(path.name):
                    continue
                rel = path.relative_to(root).as_posix()
                if not rel.startswith(self.prefix):
                    continue
                st = path.stat()
                modified = datetime.fromtimestamp(st.st_mtime, UTC)
                found.append(ObjectInfo(rel[len(self.prefix) :], st.st_size, modified, ""))
            return found

        try:
            return await asyncio.to_thread(walk)
        except OSError as exc:
            raise ObjectStoreError(f"object store list (staging files) failed: {exc}") from exc

    async def delete_staging(self, key: str) -> None:
        """Delete a staging file found by :meth:`staging` (idempotent). A put still writing
        it then fails instead of renaming it into place."""
        if self.kind != "file" or staged_key(key) is None:
            raise ObjectStoreError(f"not a staging file of this store: {key}")
        try:
            await asyncio.to_thread((Path(self.where) / (self.prefix + key)).unlink, True)
        except OSError as exc:
            raise ObjectStoreError(f"object store delete failed: {exc}") from exc

    async def discard_partial(self, key: str) -> None:
        """After a put of ``key`` failed: remove what it may have left (the local store's
        ``<key>#<n>`` staging files). obstore removes its staging file when the put is
        abandoned, but not always before the failure reaches the caller: a caller that frees
        the key's claim right after could let a retry race that cleanup. No-op on S3 (an
        aborted multipart upload holds no object)."""
        if self.kind != "file":
            return
        target = Path(self.where) / (self.prefix + key)

        def remove() -> None:
            for path in target.parent.glob(glob_escape(target.name) + "#*"):
                if _STAGING.fullmatch(path.name) and not path.is_symlink():
                    path.unlink(missing_ok=True)

        try:
            await asyncio.to_thread(remove)
        except OSError as exc:
            raise ObjectStoreError(f"object store cleanup failed: {exc}") from exc

    async def sign(self, method: Literal["PUT", "GET"], key: str, seconds: float) -> str:
        """A pre-signed URL for ``method`` on ``key``, valid ``seconds`` (S3 only)."""
        if not isinstance(self._store, S3Store):
            raise ObjectStoreError("only an S3 store signs URLs")
        _runtime["started"] = True
        try:
            return await obstore.sign_async(
                self._store, method, self.prefix + key, timedelta(seconds=seconds)
            )
        except (ObstoreBaseError, OSError) as exc:
            raise ObjectStoreError(f"object store sign failed: {exc}") from exc


FILE_MODE = 0o600
FOLDER_MODE = 0o700


def _private(root: Path, key: str) -> None:
    """Narrow an object just written under ``root`` to 0600 and its folders to 0700."""
    path = root / key
    os.chmod(path, FILE_MODE)
    folder = path.parent
    while folder != root and root in folder.parents:
        os.chmod(folder, FOLDER_MODE)
        folder = folder.parent


def default_path(settings: Settings) -> Path:
    """The file store's directory: ``outputs.path``, else ``<redis.data_dir>-outputs``."""
    if settings.outputs.path:
        return Path(settings.outputs.path)
    data = Path(settings.redis.data_dir)
    return data.with_name(data.name + "-outputs")


def build_object_store(settings: Settings, secret: Callable[[str, str], str]) -> ObjectStore:
    """The configured store; a configuration that cannot work is a :class:`ConfigError`."""
    out: OutputSettings = settings.outputs
    if out.store == "file":
        path = default_path(settings).resolve()
        path.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
        os.chmod(path, FOLDER_MODE)  # mkdir's mode is masked by the umask, and exist_ok keeps
        files = ObjectStore(LocalStore(str(path)), "file", out.prefix, str(path))
        floor = out.min_free_mb
        data = Path(settings.redis.data_dir)
        if not settings.redis.url and SpaceFloor.same_volume(path, data if data.exists() else path):
            # the embedded Redis's AOF is here: uploads stop while Redis still has its floor
            floor += settings.redis.min_free_mb
        files.space = SpaceFloor(path, floor * 1024 * 1024)
        return files
    if not out.bucket:
        raise ConfigError('outputs.bucket: required with outputs.store = "s3"')
    creds: dict[str, Any] = {}
    for field, env in (
        ("access_key_id", out.access_key_id_env),
        ("secret_access_key", out.secret_access_key_env),
        ("token", out.session_token_env),
    ):
        if env:
            creds[field] = secret(env, f"outputs.{field}_env")
    if bool(creds.get("access_key_id")) != bool(creds.get("secret_access_key")):
        raise ConfigError("outputs: set both access_key_id_env and secret_access_key_env, or none")
    config: Any = {"region": out.region, **creds}
    if out.endpoint:
        config["endpoint"] = out.endpoint
        config["virtual_hosted_style_request"] = False
    store = S3Store(out.bucket, config=config, client_options={"allow_http": out.allow_http})
    return ObjectStore(store, "s3", out.prefix, f"s3://{out.bucket}/{out.prefix}")
