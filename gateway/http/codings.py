"""Request bodies sent with a ``Content-Encoding``: decoded here, strictly and bounded.

The gateway's HTTP server never inflates a body itself (``auto_decompress`` is off for every
server of the app: :data:`HANDLER_ARGS`): aiohttp's own decoding hands a gzip stream cut short
to the handler as the bytes inflated so far, with no error — a body the client never made.
Every route that reads a body reads it through this module instead:

- the codings are the request's ``Content-Encoding`` headers, all of them, comma-separated, in
  the order they were applied (RFC 9110 §8.4); ``identity`` is no coding; ``gzip`` (also
  ``x-gzip``) and ``deflate`` (the zlib format, or a raw deflate stream as some clients send)
  are decoded, the last applied first, at most :data:`MAX_CODINGS` of them; any other coding
  (``br``, ``zstd``, …), or more of them, is ``415`` before the body is read;
- strict: a stream cut short, a corrupt one, or bytes after its end (after the last member of
  a gzip stream, which may have several) is ``400``, never the bytes decoded so far;
- bounded after decoding by the route's own limit: a body that inflates past it is ``413``,
  and never more than ``limit + 1`` bytes of it are inflated (each coding's output alike);
- an empty body is empty, whatever its codings say.

:class:`BodyDecoder` decodes chunk by chunk (a spooled body); :func:`decoded` a whole one;
:func:`read_decoded` reads a request's body, bounded before and after decoding.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any

from aiohttp import web

from gateway.core.errors import InvalidRequest, PayloadTooLarge, UnsupportedMediaType

__all__ = [
    "CODINGS",
    "HANDLER_ARGS",
    "MAX_CODINGS",
    "BodyDecoder",
    "codings_of",
    "decoded",
    "read_decoded",
]

# web.Application(handler_args=...): the request handler of every server the app runs on
# (run_app's, a test server's) passes the body through as it came
HANDLER_ARGS: dict[str, Any] = {"auto_decompress": False}
CODINGS = frozenset({"gzip", "x-gzip", "deflate"})
MAX_CODINGS = 2


def codings_of(values: Iterable[str]) -> tuple[str, ...]:
    """The codings of these ``Content-Encoding`` values, in the order they were applied
    (``identity`` left out); 415 for one that is not decoded, or more than
    :data:`MAX_CODINGS`."""
    codings = []
    for value in values:
        for item in value.split(","):
            coding = item.strip().lower()
            if coding in ("", "identity"):
                continue
            if coding not in CODINGS:
                raise UnsupportedMediaType(
                    f"Content-Encoding {coding[:40]!r} is not decoded: send the body as "
                    "gzip, deflate or unencoded"
                )
            codings.append("gzip" if coding == "x-gzip" else coding)
    if len(codings) > MAX_CODINGS:
        raise UnsupportedMediaType(
            f"{len(codings)} content codings: at most {MAX_CODINGS} are decoded"
        )
    return tuple(codings)


class _Inflate:
    """One coding's decoder: its output never past ``limit`` (413 at ``limit + 1``)."""

    def __init__(self, coding: str, limit: int, too_large: PayloadTooLarge) -> None:
        self.coding = coding
        self.limit = limit
        self.too_large = too_large
        self.out = 0
        self.seen = 0  # bytes fed
        self.ended = False  # a complete stream (gzip: at least one member) was decoded
        self.head = b""  # deflate: the first bytes, until the format is known
        self.d: Any = None  # the zlib decompressor of the stream (gzip: member) being decoded

    def _start(self, data: bytes) -> Any:
        if self.coding == "gzip":
            return zlib.decompressobj(16 + zlib.MAX_WBITS)
        # RFC 9110's "deflate" is the zlib format; a raw deflate stream (no zlib header,
        # which is 2 bytes whose big-endian value is a multiple of 31, method 8) is accepted
        zlib_format = data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
        return zlib.decompressobj(zlib.MAX_WBITS if zlib_format else -zlib.MAX_WBITS)

    def _refused(self, what: str) -> InvalidRequest:
        return InvalidRequest(f"the {self.coding} body {what}: nothing of it is used")

    def feed(self, data: bytes) -> bytes:
        self.seen += len(data)
        out = bytearray()
        data = self.head + data
        self.head = b""
        while data:
            if self.d is None:
                if self.ended and self.coding == "deflate":
                    raise self._refused("has bytes after its end")
                if self.coding == "deflate" and len(data) < 2:
                    self.head = data
                    break
                self.d = self._start(data)
            try:
                while True:
                    produced = self.d.decompress(data, self.limit + 1 - self.out)
                    self.out += len(produced)
                    if self.out > self.limit:
                        raise self.too_large
                    out += produced
                    data = self.d.unconsumed_tail
                    if self.d.eof or (not data and not produced):
                        break
            except zlib.error as exc:
                what = "has bytes after its end" if self.ended else f"is corrupt ({exc})"
                raise self._refused(what) from None
            if self.d.eof:  # the stream (gzip: a member) ended; what follows is another
                data = self.d.unused_data
                self.d = None
                self.ended = True
        return bytes(out)

    def end(self) -> None:
        if self.seen and (self.d is not None or self.head or not self.ended):
            raise self._refused("is cut short")


class BodyDecoder:
    """A body's codings undone chunk by chunk (:meth:`feed`, then :meth:`end` once the last
    raw byte came); each raises 400, 413 (``too_large``) as the module says."""

    def __init__(self, codings: Sequence[str], limit: int, too_large: PayloadTooLarge) -> None:
        # decoded in reverse: the coding applied last comes off first
        self.stages = [_Inflate(c, limit, too_large) for c in reversed(codings)]

    def feed(self, chunk: bytes) -> bytes:
        for stage in self.stages:
            if not chunk:
                break
            chunk = stage.feed(chunk)
        return chunk

    def end(self) -> bytes:
        for stage in self.stages:  # each stage's output went on as it came: only checks left
            stage.end()
        return b""


def decoded(raw: bytes, codings: Sequence[str], limit: int, too_large: PayloadTooLarge) -> bytes:
    """``raw`` with its codings undone (the module's rules); ``raw`` itself when none."""
    if not codings:
        return raw
    decoder = BodyDecoder(codings, limit, too_large)
    return decoder.feed(raw) + decoder.end()


async def read_decoded(request: web.Request, limit: int, too_large: PayloadTooLarge) -> bytes:
    """The request's body, decoded: 415 for a coding not decoded (before anything is read),
    ``too_large`` for more than ``limit`` bytes as sent or once decoded."""
    values = request.headers.getall("Content-Encoding", ())
    codings = codings_of(values) if values else ()
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise too_large from exc
    if len(raw) > limit:
        raise too_large
    return decoded(raw, codings, limit, too_large)
