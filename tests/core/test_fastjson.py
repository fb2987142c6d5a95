"""gateway.core.fastjson: orjson's speed with the stdlib's meaning; no number silently changed."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core import fastjson

pytestmark = pytest.mark.fast

scalars = (
    st.none()
    | st.booleans()
    | st.integers()  # any size: orjson turned those beyond 64 bits into floats
    | st.integers(-(2**80), 2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
documents = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


def same(a: Any, b: Any) -> bool:
    """Equal values of equal types all the way down (1 == 1.0 is not enough here)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return bool(a == b)


@given(documents)
def test_loads_means_what_the_stdlib_means(doc: Any) -> None:
    text = json.dumps(doc)
    assert same(fastjson.loads(text), json.loads(text))
    assert same(fastjson.loads(text.encode()), json.loads(text))


@given(documents)
def test_loads_exact_keeps_every_finite_document(doc: Any) -> None:
    raw = json.dumps(doc, ensure_ascii=False).encode()
    assert same(fastjson.loads_exact(raw), json.loads(raw))


@given(st.integers())
def test_dumps_writes_integers_of_any_size_exactly(n: int) -> None:
    assert fastjson.dumps({"n": n}) == b'{"n":' + str(n).encode() + b"}"


@pytest.mark.parametrize("n", [2**64, 2**64 + 1, 2**70 + 1, -(2**63) - 1, 10**40 + 7])
def test_integers_beyond_64_bits_stay_integers(n: int) -> None:
    for parse in (fastjson.loads, fastjson.loads_exact):
        value = parse(b'{"n": %d}' % n)["n"]
        assert type(value) is int and value == n


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"[1e999]", "0: the number 1e999 has no finite IEEE 754 double"),
        (b'{"a": {"b": [0, -1E+308, -1e999]}}', "a.b.2: the number -1e999 has no finite"),
        (b'{"x": 1e-400}', "x: the number 1e-400 is not zero but underflows to 0"),
        (b'{"x": NaN}', "x: the number NaN is not JSON"),
        (b'{"x": [Infinity]}', "x.0: the number Infinity is not JSON"),
        (b"-Infinity", "(the document): the number -Infinity is not JSON"),
        (b'{"s": "\\ud800"}', "the body has a lone surrogate escape"),
    ],
)
def test_loads_exact_refuses_what_it_cannot_carry(raw: bytes, message: str) -> None:
    with pytest.raises(fastjson.Unrepresentable) as err:
        fastjson.loads_exact(raw)
    assert str(err.value).startswith(message), str(err.value)


@pytest.mark.parametrize("raw", [b"0e-400", b"0.000e999", b"-0.0e-500", b"1e-300", b"1.5e-320"])
def test_zero_and_representable_extremes_are_kept(raw: bytes) -> None:
    assert fastjson.loads_exact(raw) == float(raw)


def test_an_integer_longer_than_python_converts_is_refused_not_an_error() -> None:
    with pytest.raises(fastjson.Unrepresentable, match="has more than"):
        fastjson.loads_exact(b'{"n": ' + b"7" * 5000 + b"}")


# pieces of numbers and what stands between them, so exponents and long digit runs are common
PIECES = ["e", "E", "+", "-", ".", "1", "07", "999", "12345678", '"', "x", "é", "\U0001f600"]
near_numbers = st.lists(st.sampled_from(PIECES), max_size=16).map("".join)


@settings(max_examples=1000)
@given(near_numbers | st.text(max_size=30))
def test_the_fast_path_is_taken_exactly_where_no_number_can_be_changed(text: str) -> None:
    """The check without a regular expression answers what the pattern does, for text and
    its UTF-8 bytes."""
    import re

    expected = re.search(fastjson.SUSPECT.decode(), text) is None
    assert fastjson._fast(text) is expected
    assert fastjson._fast(text.encode("utf-8", "surrogatepass")) is expected
    assert fastjson._fast(memoryview(text.encode("utf-8", "surrogatepass"))) is expected
