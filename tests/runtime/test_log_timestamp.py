"""gateway.runtime.logging.iso_utc: the request line's timestamp, the text structlog's
``TimeStamper(fmt="iso", utc=True)`` writes for the same instant."""

from __future__ import annotations

import datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.runtime.logging import iso_utc

pytestmark = pytest.mark.fast

EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
YEAR_9999 = int((datetime.datetime(9999, 12, 31, tzinfo=datetime.UTC) - EPOCH).total_seconds())


def stamper_writes(ns: int) -> str:
    """``datetime.now(UTC).isoformat()`` (what TimeStamper formats) at that instant: the
    clock's nanoseconds floored to the microsecond."""
    at = EPOCH + datetime.timedelta(microseconds=ns // 1000)
    return at.isoformat().replace("+00:00", "Z")


@given(st.integers(0, YEAR_9999 * 10**9))
def test_any_instant_is_written_as_the_time_stamper_writes_it(ns: int) -> None:
    assert iso_utc(ns) == stamper_writes(ns)


@given(st.integers(946_684_800, 4_102_444_800), st.sampled_from([0, 999, 1000, 999_999_999]))
def test_a_whole_second_has_no_fraction_and_the_next_one_is_formatted_anew(
    second: int, rest: int
) -> None:
    for ns in (second * 10**9 + rest, (second + 1) * 10**9 + rest, second * 10**9):
        assert iso_utc(ns) == stamper_writes(ns)
