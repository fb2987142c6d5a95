"""A proxied request's body, read once: decoded, hashed while read, in memory or spooled.

:func:`read_proxied_body` reads the body as it arrives (the proxy's route streams its own
body: the gateway's body-deadline middleware leaves it alone, so the same deadline,
``connections.body_timeout_seconds`` for the whole body, is applied here), undoes its
``Content-Encoding`` (:mod:`gateway.http.codings`), and keeps it

- in memory up to ``proxy.buffer_bytes`` (decoded), the intent then digests it by media type;
- else, with ``proxy.spool_bytes`` set, in a spool file (:mod:`gateway.proxy.spool`) up to
  that many bytes as sent and decoded, counted in the tenant's and the process's spooled
  bytes (past a cap: 503 ``too_many_held``, ``Retry-After``); the intent then digests its
  bytes (the SHA-256 computed as they were read);
- else 413.

Every refusal, a client that goes away mid-body and a deadline passed remove the spool file
before the error leaves; a complete body's file is the caller's to discard
(:meth:`ProxiedBody.discard`, once the request is answered).
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from gateway.core.errors import (
    FencegateError,
    InsufficientStorage,
    InvalidRequest,
    PayloadTooLarge,
    RequestTimeout,
)
from gateway.http.codings import BodyDecoder, codings_of
from gateway.proxy.spool import SpoolArea, SpooledBody, SpoolFile, SpoolLedger
from gateway.runtime.settings import Settings

__all__ = ["ProxiedBody", "Spooling", "read_proxied_body", "spool_dir"]


@dataclass
class Spooling:
    """The process's spooling: where files go (its own :class:`SpoolArea` under ``root``,
    claimed when the app starts, removed when it stops), and the bytes spooled at once."""

    root: Path
    ledger: SpoolLedger
    area: SpoolArea | None = None

    def claim(self) -> Path:
        """This process's spool directory (claimed on the first call)."""
        if self.area is None:
            self.area = SpoolArea(self.root)
        return self.area.directory

    def close(self) -> None:
        if self.area is not None:
            self.area.close()
            self.area = None


def spool_dir(settings: Settings) -> Path:
    return Path(settings.proxy.spool_dir or Path(settings.redis.data_dir) / "proxy-spool")


@dataclass
class ProxiedBody:
    data: bytes | None  # None: spooled
    spooled: SpooledBody | None
    sha256: str  # of the decoded body
    size: int
    file: SpoolFile | None = None

    @property
    def forwarded(self) -> bytes | SpooledBody:
        return self.data if self.data is not None else self.spooled  # type: ignore[return-value]

    def discard(self) -> None:
        if self.file is not None:
            self.file.discard()


async def read_proxied_body(
    request: web.Request, settings: Settings, spooling: Spooling, tenant: str
) -> ProxiedBody:
    """The body (the module docstring); 400, 408, 413, 415 or 503 with no file left."""
    values = request.headers.getall("Content-Encoding", ())
    codings = codings_of(values) if values else ()
    proxy = settings.proxy
    limit = max(proxy.buffer_bytes, proxy.spool_bytes)
    too_large = PayloadTooLarge(
        f"the body may be at most {limit} bytes"
        + ("" if proxy.spool_bytes else " (proxy.buffer_bytes; proxy.spool_bytes is 0)")
    )
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    decoder = BodyDecoder(codings, limit, too_large) if codings else None
    digest = hashlib.sha256()
    kept = bytearray()
    spool: SpoolFile | None = None
    raw = 0
    seconds = settings.connections.body_timeout_seconds

    def keep(data: bytes) -> None:
        nonlocal spool
        if not data:
            return
        digest.update(data)
        if spool is None and len(kept) + len(data) <= proxy.buffer_bytes:
            kept.extend(data)
            return
        if spool is None:
            if not proxy.spool_bytes:
                raise too_large
            spool = SpoolFile(spooling.claim(), spooling.ledger, tenant)
            spool.write(bytes(kept))
            kept.clear()
        spool.write(data)

    try:
        try:
            async with asyncio.timeout(seconds):
                while chunk := await request.content.readany():
                    raw += len(chunk)
                    if raw > limit:
                        raise too_large
                    keep(decoder.feed(chunk) if decoder else chunk)
        except TimeoutError:
            raise RequestTimeout(f"the request body did not arrive within {seconds:g} s") from None
        except FencegateError:
            raise
        except (ConnectionError, HttpProcessingError, web.RequestPayloadError) as exc:
            # the client went away, or sent less than its Content-Length
            raise InvalidRequest(f"the body broke off: {type(exc).__name__}") from None
        except OSError as exc:  # the spool file's volume
            raise InsufficientStorage(
                f"the body could not be spooled ({exc.strerror}): nothing was sent"
            ) from None
        if decoder is not None:
            decoder.end()
    except BaseException:
        if spool is not None:
            spool.discard()
        raise
    if spool is None:
        data = bytes(kept)
        return ProxiedBody(data, None, digest.hexdigest(), len(data))
    body = spool.body()
    return ProxiedBody(None, body, digest.hexdigest(), body.size, spool)
