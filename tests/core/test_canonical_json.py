"""gateway.core.intents.canonical_json: the text every intent digest is taken over. orjson
writes it where that is the stdlib's text; everywhere the stdlib's (a digest that changed
would refuse a worker's retry of a step recorded before as an intent mismatch)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.intents import canonical_json

pytestmark = pytest.mark.fast

keys = st.text(max_size=6) | st.sampled_from(["a", "B", "é", "\ue000", "\U0001f600", "", "a0"])
scalars = (
    st.none()
    | st.booleans()
    | st.integers()  # beyond 64 bits too
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()  # NaN and the infinities too: refused, as before
    | st.sampled_from([1e16, 1e-7, 0.1, -0.0, 1.5, 123456789012345.6, 5e-324, 1e308])
    | st.text(max_size=12)  # control characters, U+2028, astral planes, lone surrogates
)
documents = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=5),
    max_leaves=25,
)


def stdlib(value: Any) -> bytes | type[BaseException]:
    try:
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode("utf-8")
    except (ValueError, TypeError) as exc:  # NaN, a lone surrogate's UTF-8
        return type(exc)


def written(value: Any) -> bytes | type[BaseException]:
    try:
        return canonical_json(value)
    except (ValueError, TypeError) as exc:
        return type(exc)


@settings(max_examples=300)
@given(documents)
def test_the_canonical_text_is_the_stdlibs_for_any_document(doc: Any) -> None:
    assert written(doc) == stdlib(doc)


@given(st.dictionaries(keys, st.integers(0, 9), min_size=2, max_size=8))
def test_keys_are_sorted_as_python_sorts_strings(doc: dict[str, int]) -> None:
    assert written(doc) == stdlib(doc)


def test_documents_without_fractions_exponents_or_null_are_the_same_text() -> None:
    doc = {"payload": {"to": ["a@example.com"], "n": 12345, "ok": True}, "adapter": "hook"}
    assert canonical_json(doc) == stdlib(doc)
    for odd in ({"x": float("nan")}, {"x": 1e-7}, {"x": 2**64}, {"x": None}, {"\ud800": 1}):
        assert written(odd) == stdlib(odd)
