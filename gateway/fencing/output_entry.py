"""One attempt-scoped output as recorded in Redis: a field ``<generation>/<name>`` of the
job's outputs hash ``fg:{t/j}:outputs`` (the shared data model of issue 16: written by the
output scripts, read by the completion script, the views and the sweeper)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_TYPE", "OutputEntry"]

DEFAULT_TYPE = "application/octet-stream"


@dataclass(frozen=True, slots=True)
class OutputEntry:
    """One ``<generation>/<name>`` field of the job's outputs hash."""

    generation: int
    name: str
    state: str  # staged | recorded
    key: str
    size: int
    sha256: str
    content_type: str
    staged_ms: int
    recorded_ms: int
    presigned: bool
    etag: str
    upload: str
    deadline_ms: int
    worker_id: str

    @classmethod
    def parse(cls, field: str, raw: str) -> OutputEntry:
        gen, _, name = field.partition("/")
        d: dict[str, Any] = json.loads(raw)
        return cls(
            generation=int(gen),
            name=name,
            state=str(d.get("state", "")),
            key=str(d.get("key", "")),
            size=int(d.get("size") or 0),
            sha256=str(d.get("sha256", "")),
            content_type=str(d.get("content_type") or DEFAULT_TYPE),
            staged_ms=int(d.get("staged_ms") or 0),
            recorded_ms=int(d.get("recorded_ms") or 0),
            presigned=bool(d.get("presigned")),
            etag=str(d.get("etag", "")),
            upload=str(d.get("upload", "")),
            deadline_ms=int(d.get("deadline") or 0),
            worker_id=str(d.get("worker_id", "")),
        )
