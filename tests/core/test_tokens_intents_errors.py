"""gateway.core: generation tokens, intent digests and the error tree. No I/O."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.errors import (
    EffectInProgress,
    FencegateError,
    InvalidRequest,
    StaleGeneration,
    error_for_code,
)
from gateway.core.intents import canonical_json, intent_digest
from gateway.core.tokens import MAX_GENERATION, parse_generation, parse_unsigned_token

pytestmark = pytest.mark.fast


@given(st.integers(1, MAX_GENERATION))
def test_every_valid_generation_round_trips(g: int) -> None:
    assert parse_unsigned_token(str(g)) == g


@given(st.text(max_size=24))
def test_token_parser_never_accepts_non_canonical_text(text: str) -> None:
    try:
        g = parse_unsigned_token(text)
    except InvalidRequest:
        return
    assert str(g) == text and 1 <= g <= MAX_GENERATION


@pytest.mark.parametrize("value", [True, 1.0, "1", 0, -1, MAX_GENERATION + 1, None])
def test_json_generation_must_be_a_safe_integer(value: object) -> None:
    with pytest.raises(InvalidRequest):
        parse_generation(value)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text()
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@given(st.dictionaries(st.text(max_size=8), json_values, max_size=6))
def test_intent_digest_ignores_key_order_and_whitespace(payload: dict[str, object]) -> None:
    shuffled = dict(reversed(list(payload.items())))
    reparsed = json.loads(json.dumps(payload, indent=3))
    assert intent_digest("a", "op", payload) == intent_digest("a", "op", shuffled)
    assert intent_digest("a", "op", payload) == intent_digest("a", "op", reparsed)


@given(st.dictionaries(st.text(max_size=8), json_values, min_size=1, max_size=6))
def test_intent_digest_separates_adapter_operation_and_payload(payload: dict[str, object]) -> None:
    base = intent_digest("a", "op", payload)
    assert base != intent_digest("b", "op", payload)
    assert base != intent_digest("a", "op2", payload)
    assert base != intent_digest("a", "op", {**payload, "\x00extra": 1})


def test_canonical_json_is_the_documented_form() -> None:
    assert canonical_json({"b": 1, "a": ["é", 2]}) == '{"a":["é",2],"b":1}'.encode()
    doc = {"adapter": "email", "operation": "send", "payload": {"to": ["a@example.com"]}}
    assert (
        intent_digest("email", "send", {"to": ["a@example.com"]})
        == hashlib.sha256(canonical_json(doc)).hexdigest()
    )


def test_error_tree_codes_and_problem_documents() -> None:
    err = StaleGeneration("old", presented=1, current=2)
    doc = err.problem()
    assert doc["status"] == 409 and doc["code"] == "stale_generation"
    assert doc["type"].endswith("/stale_generation")
    assert (doc["presented"], doc["current"]) == (1, 2)
    assert err.presented == 1
    assert error_for_code("effect_in_progress") is EffectInProgress
    assert error_for_code("never-heard-of-it") is FencegateError

    def tree(cls: type[FencegateError]) -> list[type[FencegateError]]:
        return [cls, *(c for sub in cls.__subclasses__() for c in tree(sub))]

    classes = tree(FencegateError)
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes)) > 30  # one code, one class: a client can switch on it
    abstract = {"rejection", "superseded", "try_later"}  # the category bases: never raised
    assert all(error_for_code(c.code) is c for c in classes if c.code not in abstract)
