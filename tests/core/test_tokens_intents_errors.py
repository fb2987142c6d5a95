"""Pure modules: tokens, intents, keys, errors, settings. No I/O."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

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
from gateway.runtime.settings import ConfigError, load_settings
from gateway.store.keys import SLOTS, JobKeys, key_slot, slot_marker, slot_tags

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


def test_settings_defaults_and_unknown_keys(tmp_path: Path) -> None:
    s = load_settings(None)
    assert (s.server.host, s.server.port, s.fencing.registration) == ("127.0.0.1", 8080, "required")
    assert s.fencing.retention_seconds == 604_800
    cfg = tmp_path / "f.toml"
    cfg.write_text("[fencing]\nregistraton = 'implicit'\n")
    with pytest.raises(ConfigError, match=r"fencing\.registraton"):
        load_settings(cfg)
    cfg.write_text("[server]\nport = 70000\n")
    with pytest.raises(ConfigError, match=r"server\.port"):
        load_settings(cfg)
    cfg.write_text("[adapters.hook]\nurl = 'http://x'\n")
    with pytest.raises(ConfigError, match="needs a 'type'"):
        load_settings(cfg)


def test_settings_env_overrides_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "f.toml"
    cfg.write_text("[server]\nport = 9000\nhost = '127.0.0.1'\n")
    monkeypatch.setenv("FENCEGATE_SERVER__PORT", "9100")
    s = load_settings(cfg)
    assert (s.server.port, s.server.host) == (9100, "127.0.0.1")


def test_shipped_example_config_is_valid() -> None:
    from adapters.registry import validate_configs

    s = load_settings(Path(__file__).parents[2] / "config" / "fencegate.example.toml")
    validate_configs(s.adapters)
    assert "hook" in s.adapters
