"""The intent of a proxied request: one digest that ignores what a client varies on a retry.

The digest (:func:`proxy_intent`) is the SHA-256 of the canonical JSON of the upstream, the
method, the normalised path (:func:`gateway.proxy.routing.normalised_path`), the query as
``(name, value)`` pairs stably sorted by name (the order of a repeated name's values is
kept: ``a=1&a=2`` is not ``a=2&a=1``), the media type and the body's digest by media type
(:func:`body_digest`):

============================================  ==========================================
media type                                    body digest over
============================================  ==========================================
``application/json``, ``*+json``              the canonical JSON (sorted keys, no whitespace,
                                              integers exact); a body that is not JSON: its bytes
``application/x-www-form-urlencoded``         the decoded pairs, stably sorted by name
``multipart/form-data``                       each part's name, filename, type and SHA-256,
                                              stably sorted by name; the boundary is not part
anything else (or none)                       the bytes
a spooled body (over ``proxy.buffer_bytes``)  multipart: its parts, as above (read from the
                                              file, a part's content streamed through its
                                              digest); JSON and forms up to 8 MiB: as
                                              above; longer ones, and others: the bytes
============================================  ==========================================

Headers are not part of the intent — an SDK's changing telemetry header, its random
``Idempotency-Key`` and user agent must not make a retry a different request — except the
ones an upstream chooses (``intent_headers``, and the headers of ``tenant_header_values``):
their ``(lower-case name, value)`` pairs, stably sorted by name, are the digest's
``headers`` (left out when there are none, so a digest without chosen headers is the one it
always was).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from gateway.core import fastjson
from gateway.core.intents import canonical_json

__all__ = [
    "body_digest",
    "media_type",
    "multipart_parts_streamed",
    "proxy_intent",
    "sorted_query",
    "spooled_body_digest",
]

# a part's head longer than this, read from a spooled body, makes the body's digest its bytes
HEAD_BYTES = 64 * 1024
# a spooled JSON or form body up to this long is read whole and canonicalised; a longer one:
# its bytes (parsing it would hold several times its size in memory)
CANONICAL_BYTES = 8 * 1024 * 1024
READ_BYTES = 1 << 16

_PARAM = re.compile(r';\s*([!#$%&\'*+.^_`|~0-9A-Za-z-]+)=("(?:[^"\\]|\\.)*"|[^;]*)')
_DISPOSITION = re.compile(r'\b(name|filename)="((?:[^"\\]|\\.)*)"', re.IGNORECASE)


def media_type(content_type: str) -> tuple[str, dict[str, str]]:
    """``("type/subtype", {param: value})`` of a Content-Type value (lower-case type)."""
    media, _, rest = content_type.partition(";")
    params = {k.lower(): v.strip().strip('"') for k, v in _PARAM.findall(";" + rest)}
    return media.strip().lower(), params


def sorted_query(query: str) -> list[tuple[str, str]]:
    """The query's decoded pairs, stably sorted by name."""
    return sorted(parse_qsl(query, keep_blank_values=True), key=lambda kv: kv[0])


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _multipart(body: bytes, boundary: str) -> list[dict[str, str]] | None:
    """Each part's name, filename, type and digest; None if the body is not that multipart."""
    delimiter = b"--" + boundary.encode("latin-1")
    pieces = body.split(delimiter)
    if len(pieces) < 3 or not pieces[-1].startswith(b"--"):
        return None
    parts = []
    for piece in pieces[1:-1]:
        part = _part(piece)
        if part is None:
            return None
        parts.append(part)
    return sorted(parts, key=lambda p: p["name"])


def _fields(head: bytes) -> dict[str, str]:
    fields: dict[str, str] = {"name": "", "filename": "", "type": ""}
    for line in head.decode("utf-8", "replace").split("\r\n"):
        key, _, value = line.partition(":")
        if key.strip().lower() == "content-disposition":
            for m in _DISPOSITION.finditer(value):
                fields[m.group(1).lower()] = m.group(2)
        elif key.strip().lower() == "content-type":
            fields["type"] = media_type(value)[0]
    return fields


def _part(piece: bytes) -> dict[str, str] | None:
    """One part (the bytes between two delimiters), or None if it is not a part."""
    if not piece.startswith(b"\r\n") or not piece.endswith(b"\r\n"):
        return None
    head, sep, content = piece[2:-2].partition(b"\r\n\r\n")
    if not sep:
        head, content = piece[2:-2].removesuffix(b"\r\n"), b""
        if head.endswith(b"\r\n"):
            head = head[:-2]
    fields = _fields(head)
    fields["sha256"] = _sha(content)
    return fields


def multipart_parts_streamed(
    read: Callable[[int], bytes], boundary: str
) -> list[dict[str, str]] | None:
    """What :func:`body_digest` holds of a multipart body, read with ``read(n)`` (b"" at its
    end) instead of held whole: the same parts, or None where it answers by the bytes — and
    also None for a part whose head passes :data:`HEAD_BYTES`. Memory: a head and a read."""
    delim = b"--" + boundary.encode("latin-1")
    hold = len(delim) + 2  # what may still be the "\r\n" + delimiter that ends a content
    buf = b""
    eof = False

    def more() -> None:
        nonlocal buf, eof
        data = read(READ_BYTES)
        eof = not data
        buf += data

    while (d := buf.find(delim)) < 0:  # the preamble
        if eof:
            return None
        buf = buf[-len(delim) :]
        more()
    buf = buf[d + len(delim) :]
    parts: list[dict[str, str]] = []
    while True:  # just after a delimiter
        while len(buf) < 2 and not eof:
            more()
        if buf.startswith(b"--"):  # the epilogue: the last piece, so no delimiter in it
            while delim not in buf:
                if eof:
                    return sorted(parts, key=lambda p: p["name"]) if parts else None
                buf = buf[-len(delim) :]
                more()
            return None
        while True:  # the head: up to "\r\n\r\n" or, where there is none, the piece's end
            d = buf.find(delim)
            if d >= 0:  # the whole piece is here (a head, perhaps some content: bounded)
                part = _part(buf[:d])
                if part is None:
                    return None
                parts.append(part)
                buf = buf[d + len(delim) :]
                break
            sep = buf.find(b"\r\n\r\n", 2)
            # a separator the piece's end cannot overlap: its "\r\n" + delimiter lies past it
            if sep >= 0 and len(buf) >= sep + 4 + hold:
                if not buf.startswith(b"\r\n"):
                    return None
                fields = _fields(buf[2:sep])
                digest = hashlib.sha256()
                buf = buf[sep + 4 :]
                while (d := buf.find(delim)) < 0:  # the content, streamed
                    if eof:
                        return None
                    digest.update(buf[:-hold])
                    buf = buf[-hold:]
                    more()
                if d < 2 or buf[d - 2 : d] != b"\r\n":
                    return None
                digest.update(buf[: d - 2])
                fields["sha256"] = digest.hexdigest()
                parts.append(fields)
                buf = buf[d + len(delim) :]
                break
            if eof or len(buf) > HEAD_BYTES:
                return None
            more()


def spooled_body_digest(content_type: str, path: Path, sha256: str) -> dict[str, Any]:
    """What the intent holds of a spooled body (``sha256``: of its bytes, as read): what
    :func:`body_digest` holds of it — a multipart body's parts streamed, a JSON or form body
    up to :data:`CANONICAL_BYTES` read whole — else its bytes. Reads the file: call it off the
    event loop."""
    media, params = media_type(content_type)
    if media == "multipart/form-data" and params.get("boundary"):
        with path.open("rb") as f:
            parts = multipart_parts_streamed(f.read, params["boundary"])
        if parts is not None:
            return {"media": media, "parts": parts}
    elif _canonical(media) and path.stat().st_size <= CANONICAL_BYTES:
        return body_digest(content_type, path.read_bytes())
    return {"media": media, "bytes": sha256}


def _canonical(media: str) -> bool:
    return media in ("application/json", "application/x-www-form-urlencoded") or media.endswith(
        "+json"
    )


def body_digest(content_type: str, body: bytes) -> dict[str, Any]:
    """What the intent holds of a body, by media type (the module's table)."""
    media, params = media_type(content_type)
    if not body:
        return {"media": media, "empty": True}
    if media == "application/json" or media.endswith("+json"):
        try:
            value = fastjson.loads_exact(body)
        except (ValueError, RecursionError):
            pass
        else:
            return {"media": media, "json": _sha(canonical_json(value))}
    elif media == "application/x-www-form-urlencoded":
        try:
            text = body.decode("ascii")
        except UnicodeDecodeError:
            pass
        else:
            pairs = sorted(parse_qsl(text, keep_blank_values=True), key=lambda kv: kv[0])
            return {"media": media, "form": _sha(canonical_json(pairs))}
    elif media == "multipart/form-data" and params.get("boundary"):
        parts = _multipart(body, params["boundary"])
        if parts is not None:
            return {"media": media, "parts": parts}
    return {"media": media, "bytes": _sha(body)}


def proxy_intent(
    upstream: str,
    method: str,
    path: str,
    query: str,
    content_type: str,
    body: bytes,
    headers: Sequence[tuple[str, str]] = (),
    *,
    spooled: dict[str, Any] | None = None,
) -> str:
    """The intent digest (hex SHA-256) of a proxied request; ``path`` normalised;
    ``headers``: the chosen headers the request carries (the module docstring);
    ``spooled``: a body too long to hold in memory (``body`` unused), as
    :func:`spooled_body_digest` has it."""
    digest = body_digest(content_type, body) if spooled is None else spooled
    doc: dict[str, Any] = {
        "proxy": upstream,
        "method": method,
        "path": path,
        "query": sorted_query(query),
        "body": digest,
    }
    if headers:
        doc["headers"] = sorted(((k.lower(), v) for k, v in headers), key=lambda kv: kv[0])
    return hashlib.sha256(
        json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
