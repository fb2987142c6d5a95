"""The guard matrix: every script that decides under the fence (admit-8, check-2,
checkpoint-3, complete-3, output-stage-3, output-record-3, heartbeat-2) against the same cases
-- the current generation, a job never registered, below the fence, above it, cancelled,
completed, the lease expired -- on a real Redis: the same reason codes, the same audit entries
(both generations), the same implicit raise. The fence guard (``lua/includes/fence.lua``) is
what every one of them runs, with its check order an explicit parameter; where a script's
answers differ (output-record-3 never raises the fence and checks no lease; the order of
the completion check), the tables below name each difference."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from gateway.store.scripts import fenced_args
from tests.lua.scripts import FENCED, JOB, RETENTION, Scripts, admit, complete_job, heartbeat

pytestmark = pytest.mark.fast


def call(lua: Scripts, name: str, gen: int, mode: str = "required") -> list[Any]:
    spec = FENCED[name]
    if spec.prepare is not None:
        spec.prepare(lua.client, JOB, gen)
    return lua.run(name, JOB, spec.build(JOB, gen, mode))


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
    assert fields["step"] == FENCED[name].step


SCRIPTS = sorted(FENCED)


# What the current generation's call answers (complete-3 names an output nobody recorded).
CURRENT = {name: 0 for name in SCRIPTS} | {"complete-3": 7}


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_current_generation_passes_unaudited(lua: Scripts, name: str) -> None:
    lua.register(JOB, 1)
    reply = call(lua, name, 1)
    assert reply[0] == CURRENT[name], reply
    assert lua.client.xlen(JOB.audit) == 1  # register-2's entry only
    assert lua.client.hget(JOB.job, "fence") == "1"


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_job_never_registered_is_unregistered_in_required_mode(lua: Scripts, name: str) -> None:
    reply = call(lua, name, 1)
    assert_rejected(lua, name, reply, "unregistered_generation", presented=1, current=0)
    assert lua.client.hget(JOB.job, "fence") is None
    assert lua.client.ttl(JOB.job) > 0  # the hash of a job with no fence expires


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
    """Except by the record of a staged output: its stage checked the lease, and a lease that
    ran out without a new generation leaves the fence where it was."""
    lua.register(JOB, 1, lease_ms=1)
    time.sleep(0.01)
    reply = call(lua, name, 1)
    if name == "output-record-3":
        assert reply[0] == 0, reply
        return
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
STALE_ON_A_COMPLETED_JOB = {name: "stale_generation" for name in SCRIPTS} | {
    "output-stage-3": "job_completed",
    "output-record-3": "job_completed",
}


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_order_of_the_completed_check(lua: Scripts, name: str) -> None:
    lua.register(JOB, 1)
    lua.register(JOB, 2)
    complete_job(lua, JOB, 2)
    reply = call(lua, name, 1)
    assert_rejected(lua, name, reply, STALE_ON_A_COMPLETED_JOB[name], presented=1, current=2)


# The scripts that raise the fence in implicit mode (check-2 only reads; output-record-3
# records what a stage of the current generation began).
RAISING = [n for n in SCRIPTS if n not in ("check-2", "output-record-3")]


def test_above_the_fence_in_implicit_mode_a_check_passes_without_the_raise(lua: Scripts) -> None:
    lua.register(JOB, 1, lease_ms=60_000)
    reply = call(lua, "check-2", 2, "implicit")
    assert reply[0] == 0, reply
    assert lua.client.hget(JOB.job, "fence") == "1"
    assert lua.client.xlen(JOB.audit) == 1


def test_above_the_fence_in_implicit_mode_a_record_is_unregistered(lua: Scripts) -> None:
    lua.register(JOB, 1)
    reply = call(lua, "output-record-3", 2, "implicit")
    assert_rejected(lua, "output-record-3", reply, "unregistered_generation", presented=2,
                    current=1)  # fmt: skip
    assert lua.client.hget(JOB.job, "fence") == "1"


@pytest.mark.parametrize("name", RAISING)
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


@pytest.mark.parametrize("name", RAISING)
def test_an_implicit_raise_does_not_hand_the_old_lease_to_the_new_generation(
    lua: Scripts, name: str
) -> None:
    """Generation 1 registered with a lease in implicit mode; generation 2
    raises the fence through an admit, a checkpoint, a completion or an upload stage, then
    heartbeats. The heartbeat must not grant generation 2 generation 1's lease (it did, except
    when the raise was the heartbeat itself)."""
    lua.register(JOB, 1, lease_ms=60_000)
    assert call(lua, name, 2, "implicit")[0] != 9
    reply = lua.run("heartbeat-2", JOB, heartbeat(JOB, 2, "implicit"))
    assert reply[:3] == [0, "2", "0"], reply
    assert lua.client.hget(JOB.job, "lease_exp") == "0"


def test_a_rejection_past_the_cap_after_the_admit_wrote_is_remembered(lua: Scripts) -> None:
    """The admit finds a dispatch past its deadline and marks it unknown (a write); resolving
    it then meets the completed job, with the tenant's rejections used up ('1'): the answer is
    a rejection not audited, and, the script having written, it is remembered for a re-send
    and raises the slot's counter like every write."""
    lua.register(JOB, 1)
    keys, args = admit(JOB, 1, "required")
    lapsing = (*args[:13], "1", *args[14:])  # a dispatch timeout of 1 ms
    assert lua.run("admit-8", JOB, (keys, lapsing))[0] == 0
    complete_job(lua, JOB, 1)
    time.sleep(0.01)  # the dispatch's deadline passes
    audited = lua.client.xlen(JOB.audit)
    before = int(lua.client.get(JOB.marker) or 0)
    flagged = fenced_args(JOB, 1, "required", "w", RETENTION, "tester", "1")
    resolving = (*flagged, *args[8:14], "1", *args[15:])  # the adapter can resolve it
    reply = lua.run("admit-8", JOB, (keys, resolving), request_id="past-cap")
    assert reply == [9, "job_completed", "1", "1", "", ""]
    assert lua.client.hget(JOB.effect("s"), "state") == "unknown"
    assert lua.client.xlen(JOB.audit) == audited  # not audited
    assert json.loads(lua.client.get(JOB.req("past-cap")) or "null") == [
        9,
        "job_completed",
        "1",
        "1",
        "",
        "",
    ]
    assert int(lua.client.get(JOB.marker) or 0) > before
