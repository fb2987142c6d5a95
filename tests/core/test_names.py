"""The name pattern (gateway.core.names) is defined once and every refusal of a name says it.

The source of ``gateway/`` and ``adapters/`` spells the pattern only in ``core/names.py``;
the anchored form is what the OpenAPI document and pydantic get; the refusals of the API,
the adapters and the configuration end with ``NAME_RULE``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from adapters.base import InvalidPayload
from gateway.core.errors import InvalidRequest
from gateway.core.names import NAME, NAME_PATTERN, NAME_RULE, checked_name
from gateway.fencing.completion import check_output_names
from gateway.proxy.steps import StepRefused, derive_step
from gateway.runtime.settings import ConfigError, load_settings

ROOT = Path(__file__).resolve().parents[2]
SPELLED = re.compile(re.escape(r"[A-Za-z0-9][A-Za-z0-9._-]"))

pytestmark = pytest.mark.fast


def test_the_pattern_is_spelled_once() -> None:
    spelled = [
        str(path.relative_to(ROOT))
        for folder in ("gateway", "adapters")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if SPELLED.search(path.read_text())
    ]
    assert spelled == ["gateway/core/names.py"]


def test_anchored_form_and_rule() -> None:
    assert NAME_PATTERN == "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
    assert f"must match {NAME_PATTERN}" == NAME_RULE
    assert NAME.fullmatch("a" * 128) and not NAME.fullmatch("a" * 129)
    assert not NAME.fullmatch("job\n") and not NAME.fullmatch(".job")


@pytest.mark.parametrize("bad", ["", ".hidden", "a/b", "job\n", "a" * 129])
def test_refusals_say_the_rule(bad: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        checked_name(bad, "job")
    assert e.value.detail == f"job {NAME_RULE}"
    with pytest.raises(InvalidRequest) as e:
        check_output_names([bad])
    assert e.value.detail == f"output name {bad!r} {NAME_RULE}"
    with pytest.raises(StepRefused) as s:
        derive_step("idempotency_key", bad, b"")
    assert str(s.value).endswith(NAME_RULE)


def test_webhook_operation_refusal() -> None:
    from adapters.webhook import WebhookAdapter

    with pytest.raises(InvalidPayload, match=re.escape(f"operation {NAME_RULE}")):
        WebhookAdapter.validate(object.__new__(WebhookAdapter), "a/b", {})


def test_configuration_refusals(tmp_path: Path) -> None:
    cfg = tmp_path / "fencegate.toml"
    cfg.write_text("[adapters.'a b']\ntype = 'http'\n")
    with pytest.raises(ConfigError, match=re.escape(f"adapter name 'a b' {NAME_RULE}")):
        load_settings(cfg)
