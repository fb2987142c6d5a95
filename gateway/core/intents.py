"""Pure helpers for step intents: canonical JSON and its SHA-256 digest."""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["canonical_json", "intent_digest"]


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8 (non-ASCII kept as is)."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def intent_digest(adapter: str, operation: str, payload: Any) -> str:
    """SHA-256 (hex) of the canonical JSON of ``{"adapter","operation","payload"}``."""
    doc = {"adapter": adapter, "operation": operation, "payload": payload}
    return hashlib.sha256(canonical_json(doc)).hexdigest()
