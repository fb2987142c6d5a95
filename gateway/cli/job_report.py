"""``fencegate job <id>``: the job's completion, checkpoints and outputs, after its effects.

Each section is printed only when it has rows, so a job without them reads as before.
An attempt-scoped output is ``promoted`` (the completion points at it), ``orphan`` (it can
never be promoted: the job completed with another, or its generation is below the fence)
or ``pending`` (the current generation's, until it completes).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

__all__ = ["job_state_lines", "output_status"]

Table = Callable[[list[list[str]], list[str]], str]


def output_status(job: dict[str, Any], output: dict[str, Any]) -> str:
    if output.get("promoted"):
        return "promoted"
    if job.get("completion") or job.get("cancelled") or output["generation"] < job["fence"]:
        return "orphan"
    return "pending"


def _short(text: Any, width: int = 60) -> str:
    s = json.dumps(text, separators=(",", ":")) if not isinstance(text, str) else text
    return s if len(s) <= width else s[: width - 1] + "…"


def job_state_lines(job: dict[str, Any], table: Table) -> list[str]:
    lines: list[str] = []
    done = job.get("completion")
    if done:
        lines.append(
            f"\ncompleted by generation {done['generation']} at {done['completed_at']}; "
            f"result: {_short(done['result'])}"
        )
        rows = [
            [n, str(o["generation"]), str(o["size"]), o["sha256"][:12], o["key"]]
            for n, o in sorted(done["outputs"].items())
        ]
        if rows:
            lines += ["promoted outputs:", table(rows, ["output", "gen", "size", "sha256", "key"])]
    checkpoints = job.get("checkpoints") or {}
    if checkpoints:
        rows = [
            [n, str(c["generation"]), c.get("worker_id") or "-", c.get("at") or "-"]
            for n, c in sorted(checkpoints.items())
        ]
        lines += ["\ncheckpoints:", table(rows, ["checkpoint", "gen", "worker", "at"])]
    outputs = job.get("outputs") or []
    if outputs:
        rows = [
            [
                o["name"],
                str(o["generation"]),
                o["state"],
                output_status(job, o),
                "-" if o.get("size") is None else str(o["size"]),
                (o.get("sha256") or "-")[:12],
                o["key"],
            ]
            for o in outputs
        ]
        header = ["output", "gen", "state", "status", "size", "sha256", "key"]
        lines += ["\nstaged outputs (attempt-scoped):", table(rows, header)]
    return lines
