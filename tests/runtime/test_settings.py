"""gateway.runtime.settings: defaults, unknown keys named, the environment over the TOML file,
and the shipped example config valid."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.runtime.settings import ConfigError, load_settings

pytestmark = pytest.mark.fast


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
