"""gateway.store.keys: Redis Cluster key slots, and a job's keys in one slot with its marker."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.store.keys import SLOTS, JobKeys, key_slot, slot_marker, slot_tags

pytestmark = pytest.mark.fast


def test_key_slot_is_redis_crc16() -> None:
    # check values from the Redis Cluster specification
    assert key_slot("123456789") == 0x31C3 % SLOTS
    assert key_slot("foo") == 12182
    assert key_slot("bar") == 5061


def test_slot_tags_cover_every_slot() -> None:
    tags = slot_tags()
    assert len(tags) == SLOTS
    assert all(key_slot(tag) == slot for slot, tag in enumerate(tags))


def test_job_keys_share_one_slot_with_their_marker() -> None:
    k = JobKeys("acme", "job-1")
    tagged = [k.job, k.steps, k.audit, k.effect("notify"), k.marker]
    tags = {key[key.index("{") + 1 : key.index("}")] for key in tagged}
    assert {key_slot(t) for t in tags} == {key_slot("acme/job-1")}
    assert k.marker == slot_marker(key_slot("acme/job-1"))
    assert JobKeys("other", "job-1").job != k.job


@given(st.text(max_size=20), st.text(max_size=20), st.text(max_size=20))
def test_a_steps_member_is_the_compact_json_of_tenant_job_and_step(
    tenant: str, job: str, step: str
) -> None:
    """The relay queue's and the hints' member: the text json writes, whatever the names
    hold (names written directly when nothing in them needs escaping)."""
    expected = json.dumps([tenant, job, step], separators=(",", ":"))
    assert JobKeys(tenant, job).member(step) == expected
