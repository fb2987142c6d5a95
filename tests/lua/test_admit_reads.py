"""admit-8 reads a step's effect hash once: the answers that carry the record (a replay, an
outcome unknown, an async repeat) answer the hash as it was read, unless the call changed it."""

from __future__ import annotations

import pytest
import redis

from tests.lua.scripts import JOB, Scripts, admit

RECORD = {
    "state": "succeeded", "intent_sha256": "a" * 64, "adapter": "hook", "operation": "send",
    "generation": "1", "result": '{"ok":true}', "attempts": "1", "worker_id": "w",
    "created_at": "1000", "updated_at": "2000",
}  # fmt: skip


pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("job_registered")]


def hash_reads(client: redis.Redis) -> dict[str, int]:
    """Calls so far of each hash read (INFO commandstats counts commands run by scripts)."""
    stats = client.info("commandstats")
    return {
        n: int(stats.get(f"cmdstat_{n}", {}).get("calls", 0)) for n in ("hget", "hmget", "hgetall")
    }


def test_a_replay_reads_the_effect_hash_once(lua: Scripts) -> None:
    lua.client.hset(JOB.effect("s"), mapping=RECORD)
    before = hash_reads(lua.client)
    reply = lua.run("admit-8", JOB, admit(JOB, 1, "required"))
    after = hash_reads(lua.client)
    assert reply[0] == 1
    assert dict(zip(reply[1::2], reply[2::2], strict=True)) == RECORD  # the record as stored
    # the fence guard's HMGET of the job hash, one HGETALL of the effect hash
    assert {n: after[n] - before[n] for n in after} == {"hget": 0, "hmget": 1, "hgetall": 1}


def test_an_unknown_outcome_marked_by_the_admit_answers_the_hash_it_wrote(lua: Scripts) -> None:
    """A dispatch past its deadline is marked unknown by the admit: the answer carries the
    marked record (read again after the write), not the one read first."""
    dispatching = {**RECORD, "state": "dispatching", "deadline": "1", "dispatch_id": "d0"}
    del dispatching["result"]
    lua.client.hset(JOB.effect("s"), mapping=dispatching)
    reply = lua.run("admit-8", JOB, admit(JOB, 1, "required"))
    assert reply[0] == 3
    fields = dict(zip(reply[1::2], reply[2::2], strict=True))
    assert fields["state"] == "unknown" and "deadline passed" in fields["error"]
    assert fields == lua.client.hgetall(JOB.effect("s"))
