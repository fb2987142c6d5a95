"""Pure helpers for step intents: canonical JSON and its SHA-256 digest."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import orjson

__all__ = ["canonical_json", "intent_digest"]

# orjson's text is the stdlib's (below) where it holds no number with a fraction or an
# exponent (their texts differ: 1e-07 / 1e-7) and no null (orjson writes NaN and the
# infinities as null; the stdlib refuses them); integers beyond 64 bits, lone surrogates,
# non-string keys and deeper nesting orjson refuses. In the text with each digit read as 0,
# each e or E as e and every other byte but "." as " ", such a number is "0." or "0e".
_NUMBER_CLASSES = bytes(
    ord("0") if c in b"0123456789" else ord("e") if c in b"eE" else c if c == ord(".") else ord(" ")
    for c in range(256)
)


def _stdlib(value: Any) -> bytes:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8 (non-ASCII kept as is): the text of
    ``json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
    allow_nan=False)``, written by orjson where that is the same text."""
    try:
        text = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:
        return _stdlib(value)
    classes = text.translate(_NUMBER_CLASSES)
    if b"0." in classes or b"0e" in classes or b"null" in text:
        return _stdlib(value)
    return text


def intent_digest(adapter: str, operation: str, payload: Any) -> str:
    """SHA-256 (hex) of the canonical JSON of ``{"adapter","operation","payload"}``."""
    doc = {"adapter": adapter, "operation": operation, "payload": payload}
    return hashlib.sha256(canonical_json(doc)).hexdigest()
