"""admit-6 checks the payload reservation sent in its pipeline just before it (standalone Redis:
ARGV[20] the tenant's open payload reservations, ARGV[21] the call's reservation id): a call
that would queue its payload runs only when the reservation is open there; nothing else
looks at it."""

from __future__ import annotations

import pytest

from tests.lua.scripts import JOB, Call, Scripts, admit

pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("job_registered")]

PENDING = "fg:quota:{t}:held_pending"


def with_reservation(call: Call, payload: str, reservation: str) -> Call:
    """The admit ``call`` sent async (``payload``: ARGV[16]) with its reservation checked."""
    keys, args = call
    argv = list(args)
    argv[15] = payload  # ARGV[16]
    return keys, (*argv, "", PENDING, reservation)  # ARGV[19] closed: none


def test_an_open_reservation_lets_the_payload_be_queued(lua: Scripts) -> None:
    lua.client.hset(PENDING, "r1", "120")
    reply = lua.run("admit-6", JOB, with_reservation(admit(JOB, 1, "required"), '{"a":1}', "r1"))
    assert reply[0] == 4  # queued
    assert lua.client.hget(JOB.effect("s"), "payload") == '{"a":1}'
    assert lua.client.hget(PENDING, "r1") == "120"  # the settlement closes it, not the admit


def test_a_reservation_not_made_refuses_the_queue_entry_and_changes_nothing(
    lua: Scripts,
) -> None:
    lua.client.hset(PENDING, "other", "120")
    before = lua.client.dump(JOB.job)
    reply = lua.run("admit-6", JOB, with_reservation(admit(JOB, 1, "required"), '{"a":1}', "r1"))
    assert reply[:2] == [12, "payload_bytes"]
    assert not lua.client.exists(JOB.effect("s"), JOB.steps, JOB.relayq)
    assert lua.client.dump(JOB.job) == before


def test_a_synchronous_call_does_not_look_at_the_reservation(lua: Scripts) -> None:
    reply = lua.run("admit-6", JOB, with_reservation(admit(JOB, 1, "required"), "", "r1"))
    assert reply[0] == 0  # admitted: nothing is queued, no payload is held


def test_a_recorded_step_replays_whatever_the_reservation(lua: Scripts) -> None:
    lua.client.hset(
        JOB.effect("s"),
        mapping={"state": "succeeded", "intent_sha256": "a" * 64, "generation": "1",
                 "result": "{}", "adapter": "hook", "operation": "send"},
    )  # fmt: skip
    reply = lua.run("admit-6", JOB, with_reservation(admit(JOB, 1, "required"), '{"a":1}', "r1"))
    assert reply[0] == 1
