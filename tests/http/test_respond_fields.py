"""gateway.http.parsing.respond_fields: the hot routes' answers, byte for byte what the model
writes (the effect's result is any JSON value the gateway stored or an adapter answered)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from gateway.http.models import EffectOut, HeartbeatOut
from gateway.http.parsing import respond_fields

pytestmark = pytest.mark.fast

scalars = (
    st.none()
    | st.booleans()
    | st.integers()  # beyond 64 bits too: orjson cannot write those, the model does
    | st.floats()  # NaN and infinities too (a stored result read by the stdlib may hold them)
    | st.text()  # control characters, U+2028, astral planes, lone surrogates
)
documents = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=30,
)
names = st.text(min_size=1, max_size=40)


def _body(model: type[BaseModel], fields: dict[str, Any]) -> bytes:
    body = respond_fields(model, fields).body
    assert isinstance(body, bytes)
    return body


def _model_writes(model: type[BaseModel], fields: dict[str, Any]) -> bytes | None:
    """What ``respond(model(**fields))`` answered; None where the model cannot write it."""
    try:
        return model(**fields).model_dump_json().encode()
    except ValueError:  # e.g. a lone surrogate: no JSON text holds it as UTF-8
        return None


@settings(max_examples=400)
@given(
    result=documents,
    job=names,
    step=names,
    key=names,
    generation=st.integers(0, 2**53 - 1),
    replayed=st.booleans(),
)
def test_an_effect_answer_is_the_bytes_the_model_writes(
    result: Any, job: str, step: str, key: str, generation: int, replayed: bool
) -> None:
    fields = {
        "job_id": job,
        "step": step,
        "generation": generation,
        "state": "succeeded",
        "replayed": replayed,
        "idempotency_key": key,
        "adapter": "hook",
        "result": result,
    }
    assert list(fields) == list(EffectOut.model_fields)  # the model's field order
    expected = _model_writes(EffectOut, fields)
    if expected is None:
        try:
            _body(EffectOut, fields)
        except ValueError:
            return  # refused as before
        raise AssertionError("written although the model refuses it")
    assert _body(EffectOut, fields) == expected


@given(job=names, generation=st.integers(0, 2**53 - 1), lease=st.none() | names)
def test_a_heartbeat_answer_is_the_bytes_the_model_writes(
    job: str, generation: int, lease: str | None
) -> None:
    fields = {"job_id": job, "generation": generation, "current": True, "lease_expires_at": lease}
    assert list(fields) == list(HeartbeatOut.model_fields)
    assert _body(HeartbeatOut, fields) == _model_writes(HeartbeatOut, fields)


def test_a_result_orjson_cannot_write_is_written_by_the_model() -> None:
    big = {"n": 2**64 + 1, "deep": [[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]}
    deep: Any = []
    for _ in range(253):  # with the answer's own object, deeper than orjson follows
        deep = [deep]
    for result in (big, deep):
        fields = {
            "job_id": "j", "step": "s", "generation": 1, "state": "succeeded",
            "replayed": True, "idempotency_key": "j:s", "adapter": "hook", "result": result,
        }  # fmt: skip
        assert _body(EffectOut, fields) == EffectOut(**fields).model_dump_json().encode()
