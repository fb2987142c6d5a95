"""gateway.http.parsing.shape_fits_by_size: a body whose size alone proves it within the shape
limits skips the walk; it must never skip one the walk refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.errors import InvalidRequest
from gateway.http.parsing import check_shape, shape_fits_by_size

pytestmark = pytest.mark.fast

documents = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=6), children, max_size=5)
    ),
    max_leaves=40,
)


@settings(max_examples=300)
@given(
    doc=documents,
    ascii_only=st.booleans(),
    spaced=st.booleans(),
    depth=st.integers(2, 8),
    items=st.integers(1, 60),
    string=st.integers(1, 60),
)
def test_a_body_that_fits_by_size_passes_the_walk(
    doc: Any, ascii_only: bool, spaced: bool, depth: int, items: int, string: int
) -> None:
    raw = json.dumps(
        doc, ensure_ascii=ascii_only, separators=(", ", ": ") if spaced else (",", ":")
    ).encode()
    if shape_fits_by_size(raw, depth, items, string):
        check_shape(json.loads(raw), max_depth=depth, max_items=items, max_string=string)


@pytest.mark.parametrize(
    ("raw", "limits"),
    [
        (b"[[[1]]]", (2, 100, 100)),  # too deep
        (b"[1,2,3,4,5,6,7,8,9]", (8, 9, 100)),  # ten values
        (b'"abcdefghij"', (8, 100, 9)),  # a ten-character string
        (b'{"abcdefghij":1}', (8, 100, 9)),  # a ten-character key
    ],
)
def test_a_body_the_walk_refuses_is_never_skipped(raw: bytes, limits: tuple[int, int, int]) -> None:
    assert not shape_fits_by_size(raw, *limits)
    with pytest.raises(InvalidRequest):
        check_shape(json.loads(raw), max_depth=limits[0], max_items=limits[1], max_string=limits[2])
