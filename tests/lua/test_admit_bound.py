"""admit-8's "run before" (ARGV[17]) and void-5's mark: a copy of a given-up admit that reaches
Redis late never runs as a fresh admit (docs/reliability.md, "a voided admit")."""

from __future__ import annotations

import time

import pytest

from tests.lua.scripts import JOB, REQUEST_MEMORY_MS, RETENTION, Scripts, admit

pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("job_registered")]


def now_ms() -> int:
    return int(time.time() * 1000)


def void(lua: Scripts, request_id: str, run_before: str) -> list[object]:
    keys = (JOB.effect("s"), JOB.relayq, JOB.req(request_id), JOB.attention)
    return lua.run("void-5", JOB, (keys, (request_id, RETENTION, JOB.member("s"), run_before)))


def test_an_admit_past_its_bound_does_nothing(lua: Scripts) -> None:
    counter = lua.client.get(JOB.marker)
    keys, args = admit(JOB, 1, "required", run_before=str(now_ms() - 1))
    reply = lua.run("admit-8", JOB, (keys, args), request_id="late")
    assert reply[0] == 11 and abs(int(reply[1]) - now_ms()) < 5_000
    assert not lua.client.exists(JOB.effect("s"), JOB.req("late"))
    assert lua.client.get(JOB.marker) == counter  # no write in the slot


def test_an_admit_within_its_bound_runs(lua: Scripts) -> None:
    keys, args = admit(JOB, 1, "required", run_before=str(now_ms() + 10_000))
    assert lua.run("admit-8", JOB, (keys, args))[0] == 0


def test_a_void_mark_lives_until_the_admits_bound(lua: Scripts) -> None:
    """The bound is past the request memory: the void's mark lives until the bound, and the
    admit arriving in between finds it ({10}); after the bound it refuses by itself ({11})."""
    run_before = now_ms() + 2 * REQUEST_MEMORY_MS
    assert void(lua, "d1", str(run_before)) == [0, "voided"]
    assert lua.client.pttl(JOB.req("d1")) > REQUEST_MEMORY_MS + 30_000
    keys, args = admit(JOB, 1, "required", run_before=str(run_before))
    assert lua.run("admit-8", JOB, (keys, args), request_id="d1") == [10]
    assert not lua.client.exists(JOB.effect("s"))


def test_a_void_keeps_a_remembered_reply_until_the_admits_bound(lua: Scripts) -> None:
    """The admit ran (its reply lost): the void releases the step, and the remembered reply
    lives until the bound, so a copy still on the wire replays it and claims nothing."""
    run_before = now_ms() + 2 * REQUEST_MEMORY_MS
    keys, args = admit(JOB, 1, "required", run_before=str(run_before))
    args = (*args[:12], "d2", *args[13:])  # the dispatch id is the request id
    ran = lua.run("admit-8", JOB, (keys, args), request_id="d2")
    assert ran[0] == 0
    assert void(lua, "d2", str(run_before)) == [0, "released"]
    assert lua.client.pttl(JOB.req("d2")) > REQUEST_MEMORY_MS + 30_000
    assert lua.run("admit-8", JOB, (keys, args), request_id="d2") == ran
    assert lua.client.hget(JOB.effect("s"), "state") == "released"


def test_a_void_of_an_admit_that_ran_but_is_forgotten_marks_it_void(lua: Scripts) -> None:
    """The admit ran and its remembered reply expired: the void releases the step (it holds
    it under its dispatch id) and marks the request void, so a late copy does nothing."""
    keys, args = admit(JOB, 1, "required")
    args = (*args[:12], "d3", *args[13:])
    assert lua.run("admit-8", JOB, (keys, args), request_id="d3")[0] == 0
    lua.client.delete(JOB.req("d3"))
    assert void(lua, "d3", "") == [0, "released"]
    assert lua.run("admit-8", JOB, (keys, args), request_id="d3") == [10]
    assert lua.client.hget(JOB.effect("s"), "state") == "released"


def test_a_relay_claim_past_its_bound_does_nothing(lua: Scripts) -> None:
    keys, args = admit(JOB, 1, "required")
    args = (*args[:15], '{"to":"a"}', *args[16:])  # async: queued for the relay
    assert lua.run("admit-8", JOB, (keys, args))[0] == 4
    claim_keys = (JOB.effect("s"), JOB.job, JOB.audit, JOB.relayq, JOB.attention)
    claim = ["c1", "30000", RETENTION, JOB.member("s"), JOB.job_id, "s", JOB.tenant]
    late = lua.run("relay-6", JOB, (claim_keys, (*claim, str(now_ms() - 1))), request_id="c1")
    assert late[0] == 11
    assert lua.client.hget(JOB.effect("s"), "state") == "pending"
    assert lua.client.zscore(JOB.relayq, JOB.member("s")) is not None
    ok = lua.run("relay-6", JOB, (claim_keys, (*claim, str(now_ms() + 10_000))), request_id="c1")
    assert ok[0] == 0


def test_a_re_sent_relay_claim_is_answered_without_the_payload(lua: Scripts) -> None:
    """The claim's reply carries the payload; what its request memory keeps for a re-send does
    not (the payload stays in the effect hash while the claim holds the step): a relay that
    tries a failing downstream again and again keeps no copy of it per attempt."""
    keys, args = admit(JOB, 1, "required")
    payload = '{"blob":"' + "x" * 5000 + '"}'
    args = (*args[:15], payload, *args[16:])
    assert lua.run("admit-8", JOB, (keys, args))[0] == 4
    claim_keys = (JOB.effect("s"), JOB.job, JOB.audit, JOB.relayq, JOB.attention)
    claim = ("c9", "30000", RETENTION, JOB.member("s"), JOB.job_id, "s", JOB.tenant, "")
    first = lua.run("relay-6", JOB, (claim_keys, claim), request_id="c9")
    assert first[0] == 0 and first[5] == payload
    assert len(lua.client.get(JOB.req("c9")) or "") < 500  # no copy of the 5 kB payload
    again = lua.run("relay-6", JOB, (claim_keys, claim), request_id="c9")
    assert again == [*first[:5], "", first[6]]
    assert lua.client.hget(JOB.effect("s"), "payload") == payload
