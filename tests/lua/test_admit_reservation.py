"""admit-6 checks the payload reservation sent in its pipeline just before it (standalone Redis:
ARGV[20] the tenant's open payload reservations, ARGV[21] the call's reservation id): a call
that would queue its payload runs only when the reservation is open there, and queueing it
settles the reservation in the same step (the step holds its charge); nothing else looks at
it."""

from __future__ import annotations

import pytest

from tests.lua.scripts import JOB, Call, Scripts, admit

pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("job_registered")]

PENDING = "fg:quota:{t}:held_pending"
HELD, HELD_BYTES = "fg:quota:{t}:held", "fg:quota:{t}:held_bytes"
MEMBER = '["j","s"]'


def with_reservation(call: Call, payload: str, reservation: str) -> Call:
    """The admit ``call`` sent async (``payload``: ARGV[16]) with its reservation checked."""
    keys, args = call
    argv = list(args)
    argv[15] = payload  # ARGV[16]
    # ARGV[19] closed: none; then the reservation, the held payloads, the step's member, ttl
    return keys, (*argv, "", PENDING, reservation, HELD, HELD_BYTES, MEMBER, "3600")


def test_an_open_reservation_lets_the_payload_be_queued_and_becomes_its_charge(
    lua: Scripts,
) -> None:
    lua.client.hset(PENDING, mapping={"r1": "120", "other": "7"})
    lua.client.set(HELD_BYTES, "127")  # what the two reservations counted
    reply = lua.run("admit-6", JOB, with_reservation(admit(JOB, 1, "required"), '{"a":1}', "r1"))
    assert reply[0] == 4  # queued
    assert lua.client.hget(JOB.effect("s"), "payload") == '{"a":1}'
    assert lua.client.hgetall(PENDING) == {"other": "7"}  # closed
    assert lua.client.hgetall(HELD) == {MEMBER: "120"}
    assert lua.client.get(HELD_BYTES) == "127"  # counted at the reservation, not again
    assert 0 < lua.client.ttl(HELD) <= 3600


def test_a_newer_generation_queueing_over_an_older_one_gives_its_charge_back(
    lua: Scripts,
) -> None:
    """The step was queued by generation 1 (its charge 500 held); generation 2 supersedes it
    with its own payload: the step holds 2's charge, 1's is given back, atomically with the
    queue write (no settlement can land after it and undo it)."""
    lua.client.hset(PENDING, "r1", "500")
    lua.client.set(HELD_BYTES, "500")
    first = with_reservation(admit(JOB, 1, "required"), '{"a":1}', "r1")
    assert lua.run("admit-6", JOB, first)[0] == 4
    lua.register(JOB, 2)
    lua.client.hset(PENDING, "r2", "300")
    lua.client.incrby(HELD_BYTES, 300)
    second = with_reservation(admit(JOB, 2, "required"), '{"b":2}', "r2")
    assert lua.run("admit-6", JOB, second)[0] == 4
    assert lua.client.hgetall(HELD) == {MEMBER: "300"}
    assert lua.client.get(HELD_BYTES) == "300"
    assert lua.client.hlen(PENDING) == 0


def test_a_reservation_not_made_refuses_the_queue_entry_and_changes_nothing(
    lua: Scripts,
) -> None:
    lua.client.hset(PENDING, "other", "120")
    before = lua.client.dump(JOB.job)
    reply = lua.run("admit-6", JOB, with_reservation(admit(JOB, 1, "required"), '{"a":1}', "r1"))
    assert reply[:2] == [12, "payload_bytes"]
    assert not lua.client.exists(JOB.effect("s"), JOB.steps, JOB.relayq, HELD, HELD_BYTES)
    assert lua.client.dump(JOB.job) == before
    assert lua.client.hgetall(PENDING) == {"other": "120"}


def test_a_synchronous_call_does_not_look_at_the_reservation(lua: Scripts) -> None:
    lua.client.hset(PENDING, "r1", "120")
    reply = lua.run("admit-6", JOB, with_reservation(admit(JOB, 1, "required"), "", "r1"))
    assert reply[0] == 0  # admitted: nothing is queued, no payload is held
    assert lua.client.hgetall(PENDING) == {"r1": "120"} and not lua.client.exists(HELD)


def test_a_recorded_step_replays_whatever_the_reservation(lua: Scripts) -> None:
    lua.client.hset(
        JOB.effect("s"),
        mapping={"state": "succeeded", "intent_sha256": "a" * 64, "generation": "1",
                 "result": "{}", "adapter": "hook", "operation": "send"},
    )  # fmt: skip
    reply = lua.run("admit-6", JOB, with_reservation(admit(JOB, 1, "required"), '{"a":1}', "r1"))
    assert reply[0] == 1
