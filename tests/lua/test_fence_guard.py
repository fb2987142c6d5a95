"""The fence guard (``lua/includes/fence.lua``) as every fenced script runs it: the same table
of cases against each of admit-6, checkpoint-3, complete-3, output-stage-3 and heartbeat-2,
on a real Redis; the same reason codes, the same audit entries, the same implicit raise."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from gateway.store.keys import JobKeys
from tests.lua.scripts import FENCED, Scripts, complete_job, heartbeat

JOB = JobKeys("t", "j")


@pytest.fixture
def lua(redis_sync: redis.Redis) -> Scripts:
    return Scripts(redis_sync)


def call(lua: Scripts, name: str, gen: int, mode: str = "required") -> list[Any]:
    build, _ = FENCED[name]
    return lua.run(name, JOB, build(JOB, gen, mode))


def last_audit(lua: Scripts) -> tuple[str, dict[str, str]]:
    ((entry_id, fields),) = lua.client.xrevrange(JOB.audit, count=1)
    return entry_id, fields


def assert_rejected(lua: Scripts, name: str, reply: list[Any], reason: str, *, presented: int,
                    current: int) -> None:  # fmt: skip
    """{9, reason, presented, current, audit_id, ''} and the audit entry it names."""
    assert reply[:4] == [9, reason, str(presented), str(current)], (name, reply)
    assert reply[5] == ""
    entry_id, fields = last_audit(lua)
    assert reply[4] == entry_id
    assert fields["reason"] == reason
    assert (fields["presented"], fields["current"]) == (str(presented), str(current))
    assert (fields["tenant"], fields["job_id"], fields["worker_id"]) == ("t", "j", "w")
    assert fields["step"] == FENCED[name][1]


SCRIPTS = sorted(FENCED)


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_cancelled_job_is_refused_first(lua: Scripts, name: str) -> None:
    lua.register(JOB, 2)
    lua.run("cancel-1", JOB, ((JOB.job,), ()))
    reply = call(lua, name, 1)  # stale too: cancellation is checked before the fence
    assert_rejected(lua, name, reply, "job_cancelled", presented=1, current=2)


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_generation_below_the_fence_is_stale(lua: Scripts, name: str) -> None:
    lua.register(JOB, 3)
    for mode in ("required", "implicit"):
        reply = call(lua, name, 2, mode)
        assert_rejected(lua, name, reply, "stale_generation", presented=2, current=3)


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_generation_above_the_fence_is_unregistered_in_required_mode(
    lua: Scripts, name: str
) -> None:
    lua.register(JOB, 1)
    reply = call(lua, name, 2)
    assert_rejected(lua, name, reply, "unregistered_generation", presented=2, current=1)
    assert lua.client.hget(JOB.job, "fence") == "1"


@pytest.mark.parametrize("name", SCRIPTS)
def test_an_expired_lease_is_refused(lua: Scripts, name: str) -> None:
    lua.register(JOB, 1, lease_ms=1)
    time.sleep(0.01)
    reply = call(lua, name, 1)
    assert_rejected(lua, name, reply, "lease_expired", presented=1, current=1)


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_completed_jobs_fence_is_never_raised(lua: Scripts, name: str) -> None:
    lua.register(JOB, 1)
    complete_job(lua, JOB, 1)
    reply = call(lua, name, 2, "implicit")
    assert_rejected(lua, name, reply, "job_completed", presented=2, current=1)
    assert lua.client.hget(JOB.job, "fence") == "1"


# The one documented difference in order: an upload stage checks completion before the fence
# (nothing is staged after a completion, whoever asks), the others after it.
STALE_ON_A_COMPLETED_JOB = {
    "admit-6": "stale_generation",
    "checkpoint-3": "stale_generation",
    "complete-3": "stale_generation",
    "heartbeat-2": "stale_generation",
    "output-stage-3": "job_completed",
}


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_order_of_the_completed_check(lua: Scripts, name: str) -> None:
    lua.register(JOB, 1)
    lua.register(JOB, 2)
    complete_job(lua, JOB, 2)
    reply = call(lua, name, 1)
    assert_rejected(lua, name, reply, STALE_ON_A_COMPLETED_JOB[name], presented=1, current=2)


@pytest.mark.parametrize("name", SCRIPTS)
def test_an_implicit_raise_is_the_same_registration_everywhere(lua: Scripts, name: str) -> None:
    """Above the fence in implicit mode: the fence is the presented generation, without the
    old generation's lease (lease_exp '0', lease_ms ''), the job hash never expires, and the
    raise is one 'registered' entry in the job's audit chain."""
    lua.register(JOB, 1, lease_ms=60_000)
    reply = call(lua, name, 2, "implicit")
    assert reply[0] != 9, reply
    job = lua.client.hgetall(JOB.job)
    assert (job["fence"], job["lease_exp"], job["lease_ms"]) == ("2", "0", ""), job
    assert lua.client.ttl(JOB.job) == -1
    registrations = [f for _, f in lua.client.xrange(JOB.audit) if f.get("event") == "registered"]
    raised = registrations[-1]
    assert {k: raised[k] for k in ("generation", "previous", "by", "mode", "worker_id")} == {
        "generation": "2",
        "previous": "1",
        "by": "tester",
        "mode": "implicit",
        "worker_id": "w",
    }
    assert len(registrations) == 2  # register-2's, then the raise


@pytest.mark.parametrize("name", SCRIPTS)
def test_an_implicit_raise_does_not_hand_the_old_lease_to_the_new_generation(
    lua: Scripts, name: str
) -> None:
    """Issue 21 item 5: generation 1 registered with a lease in implicit mode; generation 2
    raises the fence through an admit, a checkpoint, a completion or an upload stage, then
    heartbeats. The heartbeat must not grant generation 2 generation 1's lease (it did, except
    when the raise was the heartbeat itself)."""
    lua.register(JOB, 1, lease_ms=60_000)
    assert call(lua, name, 2, "implicit")[0] != 9
    reply = lua.run("heartbeat-2", JOB, heartbeat(JOB, 2, "implicit"))
    assert reply[:3] == [0, "2", "0"], reply
    assert lua.client.hget(JOB.job, "lease_exp") == "0"
