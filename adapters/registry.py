"""Adapter types by name: built-ins plus the ``fencegate.adapters`` entry-point group.

A type maps to ``"module:Class"`` and is imported lazily, so a missing optional
dependency only matters to the configs that use it (and then says what to
install). Adding a built-in adapter is one module plus one line in
:data:`BUILTIN`.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any

from pydantic import ValidationError

from adapters.base import Adapter, AdapterConfig, AdapterContext, describe

__all__ = ["BUILTIN", "AdapterConfigError", "build_adapters", "load_type", "validate_configs"]

BUILTIN: dict[str, str] = {
    "webhook": "adapters.webhook:WebhookAdapter",
    "smtp": "adapters.smtp:SmtpAdapter",
    "stripe": "adapters.stripe:StripeAdapter",
    "jira": "adapters.jira:JiraAdapter",
}
ENTRY_POINT_GROUP = "fencegate.adapters"


class AdapterConfigError(Exception):
    """An adapter section cannot be used; the message names the key."""


def _targets() -> dict[str, str]:
    """Built-in and installed adapter types; scanning the installed distributions costs ~50 ms,
    so it is done once per import path (a plugin put on ``sys.path`` later is still found)."""
    return dict(_scan(tuple(sys.path)))


@functools.lru_cache(maxsize=8)
def _scan(path: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    del path  # the cache key: entry_points() reads the distributions on sys.path
    targets = dict(BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in targets:
            raise AdapterConfigError(
                f"adapter type {ep.name!r} from entry point {ep.value!r} clashes with "
                f"{targets[ep.name]!r}; adapter types must be unique"
            )
        targets[ep.name] = ep.value
    return tuple(targets.items())


def load_type(type_name: str) -> Any:
    """The adapter class for a type name, imported on first use."""
    targets = _targets()
    if type_name not in targets:
        known = ", ".join(sorted(targets))
        raise AdapterConfigError(f"unknown adapter type {type_name!r} (known: {known})")
    module_name, _, attr = targets[type_name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AdapterConfigError(
            f"adapter type {type_name!r} needs {exc.name!r}, which is not installed; "
            f"install it (pip install {exc.name}) or remove the adapter from the config"
        ) from exc
    return getattr(module, attr)


def _config(name: str, section: Mapping[str, Any]) -> tuple[Any, AdapterConfig]:
    cls = load_type(str(section.get("type", "")))
    try:
        config = cls.Config(**section)
    except ValidationError as exc:
        raise AdapterConfigError(describe(exc, prefix=f"adapters.{name}.")) from exc
    return cls, config


def validate_configs(
    sections: Mapping[str, Mapping[str, Any]],
    secret: Callable[[str, str], str] | None = None,
) -> None:
    """Validate every adapter section without connecting anywhere.

    With ``secret``, every non-empty ``*_env`` key must also name a set
    environment variable, so a missing credential stops the start early.
    """
    for name, section in sections.items():
        _, config = _config(name, section)
        if secret is None:
            continue
        for field, value in config.model_dump().items():
            if field.endswith("_env") and isinstance(value, dict):  # e.g. webhook headers_env
                for key, env in value.items():
                    secret(env, f"adapters.{name}.{field}.{key}")
            elif field.endswith("_env") and value:
                secret(value, f"adapters.{name}.{field}")


def build_adapters(
    sections: Mapping[str, Mapping[str, Any]], ctx: AdapterContext
) -> dict[str, Adapter]:
    adapters: dict[str, Adapter] = {}
    for name, section in sections.items():
        cls, config = _config(name, section)
        try:
            adapters[name] = cls(name, config, ctx)
        except Exception as exc:
            raise AdapterConfigError(f"adapters.{name}: {exc}") from exc
    return adapters
