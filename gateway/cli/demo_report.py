"""The result table and the invariants of ``fencegate demo`` (pure: what happened in, a
table and an exit code out)."""

from __future__ import annotations

import sqlite3
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gateway.cli.demo_worker import JOB, OUTPUT, report_bytes

__all__ = ["OutputStory", "report"]


class Delivered(Protocol):
    emails: list[tuple[str, str]]  # (message-id, fencegate key)
    hooks: list[tuple[str, str]]  # (idempotency key, fencing token)


@dataclass
class OutputStory:
    """What the demo saw of the outputs: the official bytes, the orphans the job view
    listed, the sweep's output and whether A's object is still on disk afterwards."""

    official: bytes | None = None
    orphans: list[dict[str, Any]] = field(default_factory=list)
    sweep: str = ""
    a_object_left: bool = True


def _story_checks(
    events: list[dict[str, Any]], audit: list[dict[str, Any]], job: dict[str, Any], s: OutputStory
) -> dict[str, bool]:
    done = job.get("completion") or {}
    promoted = (done.get("outputs") or {}).get(OUTPUT, {})
    a_key = f"default/{JOB}/g1/{OUTPUT}"
    return {
        "B resumed from A's checkpoint (written by generation 1)": any(
            e["worker"] == "B" and e["event"] == "resumed" and e["from_generation"] == 1
            for e in events
        ),
        "A's completion refused: stale_generation 1 < 2": any(
            e["worker"] == "A"
            and e["event"] == "gateway_completion_refused"
            and (e["code"], e["presented"], e["current"]) == ("stale_generation", 1, 2)
            for e in events
        ),
        "A's completion refusal audited with both generations": any(
            e["step"] == "job:complete"
            and e["reason"] == "stale_generation"
            and (e["presented"], e["current"], e["worker_id"]) == (1, 2, "A")
            for e in audit
        ),
        "the job completed once, by generation 2": done.get("generation") == 2
        and [e["worker"] for e in events if e["event"] == "gateway_completed"] == ["B"],
        "the official output is B's report (generation 2)": promoted.get("generation") == 2
        and s.official == report_bytes("B", 2),
        "A's report is listed as an orphan, never promoted": [
            (o["generation"], o["name"]) for o in s.orphans
        ]
        == [(1, OUTPUT)],
        "A's orphan swept from the object store": a_key in s.sweep and not s.a_object_left,
    }


def report(
    events: list[dict[str, Any]],
    sinks: Delivered,
    audit: list[dict[str, Any]],
    job: dict[str, Any],
    db: Path,
    outputs: OutputStory | None = None,
) -> int:
    attempted = Counter(e["worker"] for e in events if e["event"] == "effect")
    refused = [e for e in events if e["event"] == "refused"]
    delivered = Counter(key for _, key in sinks.emails) + Counter(key for key, _ in sinks.hooks)
    with sqlite3.connect(db) as conn:
        state, attempt = conn.execute(
            "SELECT state, attempt FROM jobs WHERE job_id = ?", (JOB,)
        ).fetchone()
    print("\nresult:")
    print(f"  {'worker':<8}{'effects attempted':>18}{'refused':>9}  completion")
    for name in ("A", "B"):
        comp = next(
            (e for e in events if e["worker"] == name and e["event"].startswith("complet")), {}
        )
        n_ref = sum(1 for e in refused if e["worker"] == name)
        outcome = f"{comp.get('event', '-')} (rows={comp.get('rows', '-')})"
        print(f"  {name:<8}{attempted[name]:>18}{n_ref:>9}  {outcome}")
    print(f"\n  {'key':<12}{'delivered downstream':>22}")
    for key in ("r:notify", "r:crm"):
        print(f"  {key:<12}{delivered[key]:>22}")
    print("\n  audit log (rejections):")
    for e in audit:
        gens = f"presented={e['presented']} current={e['current']}"
        print(f"    {e['reason']:<18} step={e['step']} {gens} worker={e['worker_id']}")
    print(f"\n  job table: state={state} attempt={attempt}; gateway fence={job['fence']}")
    if outputs is not None:
        done = job.get("completion") or {}
        print(f"  gateway: completed by generation {done.get('generation', '-')}")
        for name, o in sorted((done.get("outputs") or {}).items()):
            print(f"    promoted {name}: {o['key']} ({o['size']} B, sha256 {o['sha256'][:12]})")
        official = (outputs.official or b"").decode(errors="replace").strip()
        print(f"    official {OUTPUT}: {official!r}")
        for o in outputs.orphans:
            print(f"    orphan   {o['name']}: {o['key']} (generation {o['generation']})")
        if outputs.sweep:
            print("  orphan sweep (fencegate outputs sweep):")
            for line in outputs.sweep.strip().splitlines():
                print(f"    {line}")
    checks = {
        "exactly one email, keyed r:notify": delivered["r:notify"] == 1 and len(sinks.emails) == 1,
        "exactly one webhook, keyed r:crm": delivered["r:crm"] == 1 and len(sinks.hooks) == 1,
        "worker A refused with stale_generation 1 < 2": any(
            e["worker"] == "A"
            and e["code"] == "stale_generation"
            and (e["presented"], e["current"]) == (1, 2)
            for e in refused
        ),
        "the refusal is audited with both generations": any(
            e["reason"] == "stale_generation" and (e["presented"], e["current"]) == (1, 2)
            for e in audit
        ),
        "A's completion matched zero rows": any(
            e["worker"] == "A" and e["event"] == "completion_rejected" for e in events
        ),
        "B delivered under generation 2": {tok for _, tok in sinks.hooks} == {"2"},
        "job succeeded at attempt 2, fence 2": (state, attempt, job["fence"])
        == ("succeeded", 2, 2),
    }
    if outputs is not None:
        checks.update(_story_checks(events, audit, job, outputs))
    print("\ninvariants:")
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    return 0 if all(checks.values()) else 1
