"""gateway.http.prefer: the Prefer header as RFC 7240 preference tokens, not a substring."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.http.prefer import Preference, parse_prefer

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(
    "values",
    [
        ["respond-async"],
        ["RESPOND-ASYNC"],
        ["Respond-Async"],
        ["respond-async, wait=10"],
        ["wait=10, respond-async"],
        ["wait=10", "respond-async"],  # two header lines are one list
        ["  respond-async  ,wait = 10"],
        [",, respond-async ,"],  # empty list elements are allowed
        ['return=minimal; foo="a,b", respond-async'],  # a comma inside a quoted string
        ["respond-async; x=1"],  # a preference with a parameter
        ["respond-async=ignored"],  # a value respond-async does not define
        ["bad==, respond-async"],  # a malformed element does not spoil the others
    ],
)
def test_respond_async_is_found(values: list[str]) -> None:
    assert "respond-async" in parse_prefer(values)


@pytest.mark.parametrize(
    "values",
    [
        [],
        [""],
        ["no-respond-async"],
        ["respond-async-x"],
        ["return=minimal; respond-async-x"],
        ["return=minimal; respond-async"],  # a parameter of `return`, not a preference
        ['foo="respond-async"'],
        ["foo=respond-async"],
        ["respond-async x"],  # not a preference: no list separator
        ['respond-async; a="unterminated'],
        ["respond_async"],
        ["wait=10 respond-async"],
    ],
)
def test_respond_async_is_not_found(values: list[str]) -> None:
    assert "respond-async" not in parse_prefer(values)


def test_values_parameters_and_first_instance() -> None:
    prefs = parse_prefer(['return=minimal; a="x\\"y" ;b', "Wait=10, wait=20, handling=lenient"])
    assert prefs["return"] == Preference("minimal", (("a", 'x"y'), ("b", None)))
    assert prefs["wait"] == Preference("10")  # the first instance counts (RFC 7240 §2)
    assert prefs["handling"] == Preference("lenient")
    assert set(prefs) == {"return", "wait", "handling"}


@given(st.lists(st.text(max_size=30), max_size=3))
def test_any_header_text_parses_without_error(values: list[str]) -> None:
    prefs = parse_prefer(values)
    assert all(name == name.lower() and name for name in prefs)
