"""The step of a proxied request that sends no ``Fencegate-Step``: ``step_from``.

An upstream's ``step_from`` says where such a request's step comes from, if anywhere:

- ``""`` (the default): nowhere; the request is refused (400);
- ``"idempotency_key"``: the client's own ``Idempotency-Key`` is the step — only for callers
  that choose deterministic keys (an SDK's random key per call would make every retry a new
  step, so it is never the default);
- ``"json:<pointer>"``: the string at that JSON pointer (RFC 6901, e.g. ``json:/order_id``)
  of the request's JSON body.

Whatever the source, the value must be a step name (:data:`gateway.core.names.NAME`), else
the request is refused (400, :class:`StepRefused`) and nothing happens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.core import fastjson
from gateway.core.names import NAME, NAME_RULE

__all__ = ["StepRefused", "check_step_from", "derive_step", "json_pointer"]

IDEMPOTENCY_KEY = "idempotency_key"
JSON_PREFIX = "json:"


class StepRefused(ValueError):
    """The request names no step, or one that is not a step name; the message says which."""


def check_step_from(value: str) -> str:
    """A ``step_from`` setting, checked (ValueError naming what is wrong)."""
    if value in ("", IDEMPOTENCY_KEY):
        return value
    if value.startswith(JSON_PREFIX):
        json_pointer(value[len(JSON_PREFIX) :])
        return value
    raise ValueError(
        f"{value!r} must be '' (a Fencegate-Step is required), 'idempotency_key' or 'json:/pointer'"
    )


def json_pointer(pointer: str) -> tuple[str, ...]:
    """The reference tokens of an RFC 6901 pointer (``"/a/b~1c"`` → ``("a", "b/c")``);
    ValueError for one that is empty or malformed."""
    if not pointer.startswith("/"):
        raise ValueError(f"the JSON pointer {pointer!r} must start with '/'")
    tokens = []
    for raw in pointer[1:].split("/"):
        if "~" in raw.replace("~0", "").replace("~1", ""):
            raise ValueError(f"the JSON pointer {pointer!r} has a '~' not followed by 0 or 1")
        tokens.append(raw.replace("~1", "/").replace("~0", "~"))
    return tuple(tokens)


def _at(doc: Any, tokens: tuple[str, ...]) -> Any:
    for token in tokens:
        if isinstance(doc, Mapping) and token in doc:
            doc = doc[token]
        elif isinstance(doc, list) and token.isdigit() and (token == "0" or token[0] != "0"):
            if int(token) >= len(doc):
                return None
            doc = doc[int(token)]
        else:
            return None
    return doc


def derive_step(step_from: str, client_key: str | None, body: bytes) -> str:
    """The step named by ``step_from`` (the module docstring), else :class:`StepRefused`."""
    if step_from == IDEMPOTENCY_KEY:
        if client_key is None:
            raise StepRefused(
                "Fencegate-Step or Idempotency-Key is required: the step this request is a step of"
            )
        return _named(client_key, "the Idempotency-Key (the step of this upstream's requests)")
    if step_from.startswith(JSON_PREFIX):
        pointer = step_from[len(JSON_PREFIX) :]
        try:
            doc = fastjson.loads_exact(body)
        except (ValueError, RecursionError):
            raise StepRefused(
                f"Fencegate-Step is required, or a JSON body with the step at {pointer}"
            ) from None
        value = _at(doc, json_pointer(pointer))
        if not isinstance(value, str):
            raise StepRefused(
                f"Fencegate-Step is required, or a string at {pointer} of the JSON body"
            )
        return _named(value, f"the value at {pointer} (the step of this upstream's requests)")
    raise StepRefused("Fencegate-Step is required: the step this request is a step of")


def _named(value: str, what: str) -> str:
    if not NAME.fullmatch(value):
        raise StepRefused(f"{what} {NAME_RULE}")
    return value
