"""The tenant feed copy (``lua/includes/feed.lua``): a script that audits a rejection (or, in
admit-8, a supersession) copies the entry to the feed the prelude's trailer names, in the
same script — the fields the store's own copy writes, once, also when the call is re-sent —
and copies nothing when the trailer names no feed (a Cluster: the store copies it there)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.store.keys import audit_feed
from tests.lua.scripts import FENCED, JOB, Scripts, admit

FEED = audit_feed(JOB.tenant)

pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("job_registered")]


def feed(lua: Scripts) -> list[tuple[str, dict[str, str]]]:
    return lua.client.xrange(FEED)  # type: ignore[return-value]


def expected(entry_id: str, fields: dict[str, str]) -> dict[str, str]:
    """The feed entry the store writes for a job's audit entry (gateway.store.base)."""
    names = ("step", "reason", "presented", "current", "worker_id", "adapter")
    return {
        "at": entry_id.split("-")[0],
        "tenant": fields["tenant"],
        "job_id": fields["job_id"],
        "job_audit_id": entry_id,
        **{n: fields[n] for n in names if n in fields},
    }


@pytest.mark.parametrize("name", sorted(FENCED))
def test_a_rejection_is_copied_to_the_tenant_feed_by_the_rejecting_script(
    lua: Scripts, name: str
) -> None:
    lua.register(JOB, 2)
    fenced = FENCED[name]
    if fenced.prepare:
        fenced.prepare(lua.client, JOB, 1)
    reply = lua.run(name, JOB, fenced.build(JOB, 1, "required"), feed=FEED)
    assert reply[:2] == [9, "stale_generation"]
    ((entry_id, fields),) = lua.client.xrevrange(JOB.audit, count=1)
    assert reply[4] == entry_id
    assert [entry for _, entry in feed(lua)] == [expected(entry_id, fields)]
    assert list(feed(lua)[0][1]) == list(expected(entry_id, fields))  # the store's field order


def test_a_resent_rejection_is_copied_once(lua: Scripts) -> None:
    lua.register(JOB, 2)
    call = admit(JOB, 1, "required")
    first = lua.run("admit-8", JOB, call, request_id="again", feed=FEED)
    assert lua.run("admit-8", JOB, call, request_id="again", feed=FEED) == first
    assert len(feed(lua)) == 1


def test_no_feed_named_no_copy(lua: Scripts) -> None:
    lua.register(JOB, 2)
    reply = lua.run("admit-8", JOB, admit(JOB, 1, "required"))
    assert reply[:2] == [9, "stale_generation"]
    assert lua.client.exists(FEED) == 0


def test_a_rejection_outside_a_fence_guard_is_copied_too(lua: Scripts) -> None:
    """reject-2 (a bad token) and register-2 (a regression) audit through includes/reject."""
    lua.register(JOB, 3)
    bad = ((JOB.job, JOB.audit), ("bad_token", "", JOB.job_id, "s", "w", "hook", "t", "3600", ""))
    regression = (
        (JOB.job, JOB.audit),
        ("2", "", JOB.job_id, JOB.tenant, "3600", str(2**53 - 1), "t"),
    )
    replies: list[Any] = [
        lua.run("reject-2", JOB, bad, feed=FEED),
        lua.run("register-2", JOB, regression, feed=FEED),
    ]
    assert [r[1] for r in replies] == ["bad_token", "generation_regression"]
    copied = feed(lua)
    assert [e["job_audit_id"] for _, e in copied] == [r[4] for r in replies]
    assert [e["reason"] for _, e in copied] == ["bad_token", "generation_regression"]


def test_a_superseded_pending_step_is_copied_to_the_feed(lua: Scripts) -> None:
    keys, args = admit(JOB, 1, "required")
    queued = (keys, (*args[:15], '{"to":"a"}', *args[16:]))  # async: pending, queued
    assert lua.run("admit-8", JOB, queued, feed=FEED)[0] == 4
    lua.register(JOB, 2)
    reply = lua.run("admit-8", JOB, admit(JOB, 2, "required"), feed=FEED)
    assert reply[0] == 0 and reply[5]  # admitted, superseding the pending step
    ((_, entry),) = feed(lua)
    assert (entry["job_audit_id"], entry["reason"], entry["presented"]) == (
        reply[5],
        "superseded",
        "1",
    )
