"""admit-8 charges an async payload itself on a standalone Redis (ARGV[20] to ARGV[25]: the
tenant's held payloads, their total, the step's member, the charge, the cap, the ttl): a call
that would queue its payload runs only when the charge fits under the cap (a charge the step
holds already is replaced, so it does not count), and queueing it charges it in the same
atomic step; a call that does not queue charges nothing."""

from __future__ import annotations

import pytest

from tests.lua.scripts import JOB, Call, Scripts, admit

pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("job_registered")]

HELD, HELD_BYTES = "fg:quota:{t}:held", "fg:quota:{t}:held_bytes"
MEMBER = '["j","s"]'


def charged(call: Call, payload: str, charge: int, cap: int = 1000) -> Call:
    """The admit ``call`` sent async (``payload``: ARGV[16]) with its payload's charge."""
    keys, args = call
    argv = list(args)
    argv[15] = payload  # ARGV[16]
    # ARGV[19] closed: none; then the held payloads, their total, the member, charge, cap, ttl
    return keys, (*argv, "", HELD, HELD_BYTES, MEMBER, str(charge), str(cap), "3600")


def test_a_payload_that_fits_is_queued_and_charged_in_the_same_step(lua: Scripts) -> None:
    lua.client.hset(HELD, '["j","other"]', "300")
    lua.client.set(HELD_BYTES, "300")
    reply = lua.run("admit-8", JOB, charged(admit(JOB, 1, "required"), '{"a":1}', 120))
    assert reply[0] == 4  # queued
    assert lua.client.hget(JOB.effect("s"), "payload") == '{"a":1}'
    assert lua.client.hgetall(HELD) == {'["j","other"]': "300", MEMBER: "120"}
    assert lua.client.get(HELD_BYTES) == "420"
    assert 0 < lua.client.ttl(HELD) <= 3600 and 0 < lua.client.ttl(HELD_BYTES) <= 3600


def test_a_payload_over_the_cap_is_refused_and_changes_nothing(lua: Scripts) -> None:
    lua.client.set(HELD_BYTES, "900")
    before = lua.client.dump(JOB.job)
    reply = lua.run("admit-8", JOB, charged(admit(JOB, 1, "required"), '{"a":1}', 120))
    assert reply[:2] == [12, "payload_bytes"]
    assert not lua.client.exists(JOB.effect("s"), JOB.steps, JOB.relayq, HELD)
    assert lua.client.dump(JOB.job) == before and lua.client.get(HELD_BYTES) == "900"


def test_a_newer_generation_queueing_over_an_older_one_replaces_its_charge(
    lua: Scripts,
) -> None:
    """The step was queued by generation 1 (its charge 800 held, the cap 1000); generation 2
    supersedes it with a payload of 500: it fits, since 1's charge is replaced, atomically
    with the queue write."""
    assert lua.run("admit-8", JOB, charged(admit(JOB, 1, "required"), '{"a":1}', 800))[0] == 4
    lua.register(JOB, 2)
    assert lua.run("admit-8", JOB, charged(admit(JOB, 2, "required"), '{"b":2}', 500))[0] == 4
    assert lua.client.hgetall(HELD) == {MEMBER: "500"}
    assert lua.client.get(HELD_BYTES) == "500"


def test_a_call_that_does_not_queue_charges_nothing(lua: Scripts) -> None:
    """A synchronous call, and a replay of a recorded step, whatever the cap."""
    lua.client.set(HELD_BYTES, "1000")
    assert lua.run("admit-8", JOB, charged(admit(JOB, 1, "required"), "", 120))[0] == 0
    lua.client.hset(
        JOB.effect("r"),
        mapping={"state": "succeeded", "intent_sha256": "a" * 64, "generation": "1",
                 "result": "{}", "adapter": "hook", "operation": "send"},
    )  # fmt: skip
    keys, args = charged(admit(JOB, 1, "required"), '{"a":1}', 120)
    argv = list(args)
    argv[8] = "r"  # ARGV[9]: the recorded step
    keys = (keys[0], JOB.effect("r"), *keys[2:])
    assert lua.run("admit-8", JOB, (keys, tuple(argv)))[0] == 1
    assert lua.client.get(HELD_BYTES) == "1000" and not lua.client.exists(HELD)


def windowed(call: Call, cap: int) -> Call:
    """The admit ``call`` (synchronous) counted in the tenant's effects window (ARGV[26..28])."""
    keys, args = call
    return keys, (*args, "", *("",) * 6, WINDOW, str(cap), "3660")


WINDOW = "fg:quota:{t}:fx:7"


def test_an_effect_call_that_claims_the_step_is_counted_in_its_window_up_to_the_cap(
    lua: Scripts,
) -> None:
    """Two calls under a cap of 2 claim their steps and are counted (the window's TTL set with
    its first count); the third is refused at the cap and changes nothing; a replay of a
    claimed step is neither counted nor refused."""
    for step in ("a", "b"):
        keys, args = windowed(admit(JOB, 1, "required"), 2)
        argv = list(args)
        argv[8] = step  # ARGV[9]
        assert (
            lua.run("admit-8", JOB, ((keys[0], JOB.effect(step), *keys[2:]), tuple(argv)))[0] == 0
        )
    assert lua.client.get(WINDOW) == "2" and 0 < lua.client.ttl(WINDOW) <= 3660
    keys, args = windowed(admit(JOB, 1, "required"), 2)
    argv = list(args)
    argv[8] = "c"
    third = lua.run("admit-8", JOB, ((keys[0], JOB.effect("c"), *keys[2:]), tuple(argv)))
    assert third[:2] == [12, "effects_per_window"] and not lua.client.exists(JOB.effect("c"))
    lua.client.hset(JOB.effect("a"), mapping={"state": "succeeded", "result": "{}"})
    keys, args = windowed(admit(JOB, 1, "required"), 2)
    argv = list(args)
    argv[8] = "a"
    assert lua.run("admit-8", JOB, ((keys[0], JOB.effect("a"), *keys[2:]), tuple(argv)))[0] == 1
    assert lua.client.get(WINDOW) == "2"
