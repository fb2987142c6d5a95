"""The plain scripts (``lua/plain/``, :class:`gateway.store.scripts.PlainScript`): the store's
counters and reads that run without the prelude. Each is a file with a contract header, its
name says how many KEYS it takes, its includes come from ``lua/plain/includes/`` (never the
fenced scripts' includes, which need the prelude), and every one loads into Redis."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.store import anchors, link, output_records, quota_counters, relayq, slotscan
from gateway.store.keys import JobKeys
from gateway.store.scripts import PLAIN_NAMES, PlainScript, ScriptSourceError, plain_source

PLAIN = Path(__file__).resolve().parents[2] / "gateway" / "store" / "lua" / "plain"
_CODE = re.compile(r"--\[\[.*?\]\]|--[^\n]*", re.S)  # Lua comments


def test_every_plain_script_is_a_file_named_for_its_keys() -> None:
    assert {p.stem for p in PLAIN.glob("*.lua")} == set(PLAIN_NAMES)
    for name in PLAIN_NAMES:
        body = (PLAIN / f"{name}.lua").read_text()
        assert body.startswith("--[[\n"), name  # the contract header
        code = _CODE.sub("", body)
        count = name.rsplit("-", 1)[1]
        if count.endswith("n"):  # k keys per item, indexed in a loop: KEYS[k * i - m]
            k = int(count[:-1])
            used = set(re.findall(r"KEYS\[(\d+) \* i(?: - (\d+))?\]", code))
            if k == 1 and "KEYS[i]" in code:  # one key per item: KEYS[i]
                used.add(("1", ""))
            assert used == {(str(k), str(m) if m else "") for m in range(k)}, name
            assert not re.findall(r"KEYS\[\d+\]", code), name
            continue
        used = {int(k) for k in re.findall(r"KEYS\[(\d+)\]", code)}
        assert used == set(range(1, int(count) + 1)), name


def test_a_plain_script_runs_without_the_prelude() -> None:
    for name in PLAIN_NAMES:
        source = plain_source(name)
        assert "run_script(function()" not in source and "local function audit(" not in source
        assert source.endswith((PLAIN / f"{name}.lua").read_text()), name  # the body is the chunk


def test_plain_includes_take_everything_as_arguments_and_are_defined_once() -> None:
    for path in (PLAIN / "includes").glob("*.lua"):
        code = _CODE.sub("", path.read_text())
        assert "KEYS" not in code and "ARGV" not in code, path.name
    for name in ("ledger-settle-3", "ledger-fix-3"):
        assert plain_source(name).count("local function ledger_total(") == 1, name
    assert "ledger_total" not in plain_source("ledger-reserve-3")


def test_only_plain_names_load(tmp_path: Path) -> None:
    with pytest.raises(ScriptSourceError, match="not a plain script"):
        PlainScript.load("admit-8")
    (tmp_path / "includes").mkdir()
    (tmp_path / "s-1.lua").write_text('--- @include "includes/fence"\nreturn 1\n')
    with pytest.raises(ScriptSourceError, match="unknown include 'fence'"):
        plain_source("s-1", tmp_path)


def test_each_owner_holds_its_plain_scripts() -> None:
    owned = {
        quota_counters.RESERVE, quota_counters.SETTLE, quota_counters.SETTLE_CHECKPOINT,
        quota_counters.DROP, output_records.RESERVE, output_records.SETTLE, output_records.FIX,
        anchors.SNAPSHOT, link.WITNESS_RAISE, slotscan.DUE, relayq.REHINT,
    }  # fmt: skip
    assert {s.name for s in owned} == set(PLAIN_NAMES)


def test_every_plain_script_loads_by_its_sha(redis_sync: redis.Redis) -> None:
    for name in PLAIN_NAMES:
        script = PlainScript.load(name)
        assert redis_sync.script_load(script.source) == script.sha, name


def test_the_ledger_tail_drops_the_sum_once_nothing_is_charged(redis_sync: redis.Redis) -> None:
    """ledger-settle-3 through its include: the reservation settled to nothing leaves no key."""
    keys = ("fg:quota:{t}:out", "fg:quota:{t}:out_up", "fg:quota:{t}:out_bytes")
    reserve, settle = PlainScript.load("ledger-reserve-3"), PlainScript.load("ledger-settle-3")
    assert redis_sync.eval(reserve.source, 3, *keys, "k", "u", "10", "0", "0", "") == 10
    assert redis_sync.eval(settle.source, 3, *keys, "k", "u", "") == -10
    assert redis_sync.exists(*keys) == 0
    assert redis_sync.eval(reserve.source, 3, *keys, "k", "u", "10", "0", "0", "") == 10
    assert redis_sync.eval(settle.source, 3, *keys, "k", "u", "7") == -3
    assert redis_sync.hgetall(keys[0]) == {"k": "7"} and redis_sync.get(keys[2]) == "7"


def test_a_quota_call_sent_again_counts_once(redis_sync: redis.Redis) -> None:
    """The auto-pipeline re-sends a call whose connection dropped before its reply: a
    reservation finds itself open and counts nothing again, a settlement answers its first
    run's reply (includes/once); a refused reservation writes nothing."""
    reserve = PlainScript.load("quota-reserve-2")
    settle = PlainScript.load("quota-settle-4")
    checkpoint = PlainScript.load("quota-settle-checkpoint-4")
    held, held_bytes, pending = (
        f"fg:quota:{{t}}:{k}" for k in ("held", "held_bytes", "held_pending")
    )
    for _ in range(2):  # the reservation and its re-send
        assert (
            redis_sync.eval(reserve.source, 2, held_bytes, pending, "100", "150", "60", "a") == 100
        )
    assert (redis_sync.get(held_bytes), redis_sync.hgetall(pending)) == ("100", {"a": "100"})
    for _ in range(2):  # over the cap: refused, and refused again without a trace
        assert (
            redis_sync.eval(reserve.source, 2, held_bytes, pending, "100", "150", "60", "b") == -1
        )
    assert (redis_sync.get(held_bytes), redis_sync.hgetall(pending)) == ("100", {"a": "100"})
    for _ in range(2):  # stored: the member holds the charge, the reservation is closed once
        assert redis_sync.eval(settle.source, 4, held, held_bytes, "fg:quota:{t}:req:c", pending,
                               '["j","s"]', "100", "1", "60", "60000", "a") == 1  # fmt: skip
    assert redis_sync.get(held_bytes) == "100" and redis_sync.hget(held, '["j","s"]') == "100"
    assert redis_sync.hgetall(pending) == {}
    assert redis_sync.eval(reserve.source, 2, held_bytes, pending, "50", "150", "60", "d") == 150
    for _ in range(2):  # not stored: given back once
        assert redis_sync.eval(settle.source, 4, held, held_bytes, "fg:quota:{t}:req:e", pending,
                               '["j","t"]', "50", "0", "60", "60000", "d") == 1  # fmt: skip
    assert redis_sync.get(held_bytes) == "100" and redis_sync.hgetall(pending) == {}
    ckpt, ckpt_bytes, ckpt_pending = (
        f"fg:quota:{{t}}:{k}" for k in ("ckpt", "ckpt_bytes", "ckpt_pending")
    )
    assert redis_sync.eval(reserve.source, 2, ckpt_bytes, ckpt_pending, "50", "0", "60", "f") == 50
    for _ in range(2):  # reserved 50, stored 30
        assert redis_sync.eval(checkpoint.source, 4, ckpt, ckpt_bytes, "fg:quota:{t}:req:g",
                               ckpt_pending, "j", "50", "30", "60", "60000", "f") == 1  # fmt: skip
    assert redis_sync.get(ckpt_bytes) == "30" and redis_sync.hget(ckpt, "j") == "30"
    assert redis_sync.hgetall(ckpt_pending) == {}
    assert 0 < redis_sync.pttl("fg:quota:{t}:req:g") <= 60000


def test_a_settlement_after_its_reservation_was_given_back_counts_it_again(
    redis_sync: redis.Redis,
) -> None:
    """The reconciliation gave an open reservation back as abandoned (quota-drop-2 on the open
    reservations); its settlement arrives after all: stored, it is counted again; not
    stored, it is not given back twice."""
    reserve, settle = PlainScript.load("quota-reserve-2"), PlainScript.load("quota-settle-4")
    drop = PlainScript.load("quota-drop-2")
    held, held_bytes, pending = (
        f"fg:quota:{{t}}:{k}" for k in ("held", "held_bytes", "held_pending")
    )
    for rid, stored, after in (("a", "1", "100"), ("b", "0", "0")):
        redis_sync.delete(held, held_bytes, pending)
        assert redis_sync.eval(reserve.source, 2, held_bytes, pending, "100", "0", "60", rid) == 100
        assert redis_sync.eval(drop.source, 2, pending, held_bytes, "", rid, "100", "") == 100
        memory = f"fg:quota:{{t}}:req:{rid}"
        args = ('["j","s"]', "100", stored, "60", "60000", rid)
        assert redis_sync.eval(settle.source, 4, held, held_bytes, memory, pending, *args) == 1
        assert redis_sync.get(held_bytes) == after, rid


def test_the_snapshot_of_a_chunk_of_jobs_is_each_jobs_own_snapshot(
    redis_sync: redis.Redis,
) -> None:
    """``anchor-snapshots-2n`` with three jobs at once answers, per job in order, what it
    answers for that job alone: a chain whose head names its newest entry, one whose seen
    entry was deleted, and a job with no chain at all."""
    script = PlainScript.load("anchor-snapshots-2n")
    jobs = [JobKeys("t", f"j{i}") for i in range(3)]
    ids = [redis_sync.xadd(jobs[i].audit, {"n": str(n)}) for i in (0, 1) for n in (1, 2)]
    redis_sync.hset(jobs[0].job, mapping={"audit_head": "h0", "audit_last": ids[1]})
    redis_sync.hset(jobs[1].job, mapping={"audit_head": "h1", "audit_last": ids[3]})
    redis_sync.xdel(jobs[1].audit, ids[2])
    seen = [ids[0], ids[2], "1-1"]

    def snapshot(chunk: list[int]) -> list[Any]:
        keys = [k for i in chunk for k in (jobs[i].job, jobs[i].audit)]
        return list(redis_sync.evalsha(script.sha, len(keys), *keys, *[seen[i] for i in chunk]))

    redis_sync.script_load(script.source)
    alone = [snapshot([i]) for i in range(3)]
    assert alone == [
        ["h0", ids[1], 2, ids[1], 1],
        ["h1", ids[3], 1, ids[3], 0],
        [None, None, 0, None, 0],
    ]
    assert snapshot([0, 1, 2]) == [v for one in alone for v in one]


def test_a_reconciliation_drops_no_entry_whose_thing_came_back_since_it_read_it(
    redis_sync: redis.Redis,
) -> None:
    """``quota-drop-2`` checks again what the reconciliation read: a step queued again since
    (its effect holds a payload again, with the same charge) keeps its charge; a job whose
    checkpoints were written again keeps its own; one still gone is given back."""
    drop = PlainScript.load("quota-drop-2")
    held, held_bytes = "fg:quota:{t}:held", "fg:quota:{t}:held_bytes"
    back, gone = JobKeys("t", "j").effect("back"), JobKeys("t", "j").effect("gone")
    redis_sync.hset(held, mapping={'["j","back"]': "100", '["j","gone"]': "100"})
    redis_sync.set(held_bytes, "200")
    redis_sync.hset(back, mapping={"state": "pending", "payload_sha": "a" * 64})
    redis_sync.hset(gone, mapping={"state": "succeeded"})
    args = ("held", '["j","back"]', "100", back, '["j","gone"]', "100", gone)
    assert redis_sync.eval(drop.source, 2, held, held_bytes, *args) == 100
    assert redis_sync.hgetall(held) == {'["j","back"]': "100"}
    assert redis_sync.get(held_bytes) == "100"
    ckpt, ckpt_bytes = "fg:quota:{t}:ckpt", "fg:quota:{t}:ckpt_bytes"
    redis_sync.hset(ckpt, mapping={"j": "50", "k": "70"})
    redis_sync.set(ckpt_bytes, "120")
    redis_sync.hset(JobKeys("t", "j").ckpt, "c", "{}")  # written again
    args = ("ckpt", "j", "50", JobKeys("t", "j").ckpt, "k", "70", JobKeys("t", "k").ckpt)
    assert redis_sync.eval(drop.source, 2, ckpt, ckpt_bytes, *args) == 70
    assert redis_sync.hgetall(ckpt) == {"j": "50"} and redis_sync.get(ckpt_bytes) == "50"
