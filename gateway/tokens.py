"""Pure: parse fencing tokens presented in the ``Fencing-Token`` header.

Unsigned mode: the decimal generation, ``1 <= g <= 2**53 - 1``, no sign, no
leading zeros, no spaces. Anything else is :class:`~gateway.errors.InvalidRequest`.
"""

from __future__ import annotations

import re

from gateway.errors import InvalidRequest

__all__ = ["MAX_GENERATION", "parse_generation", "parse_unsigned_token"]

MAX_GENERATION = 2**53 - 1
_DECIMAL = re.compile(r"[1-9][0-9]{0,15}")


def parse_generation(value: object, what: str = "generation") -> int:
    """Validate a JSON generation: an integer (not a bool, not a float) in range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{what} must be an integer from 1 to 2^53-1")
    if not 1 <= value <= MAX_GENERATION:
        raise InvalidRequest(f"{what} must be an integer from 1 to 2^53-1, got {value}")
    return value


def parse_unsigned_token(token: str | None) -> int:
    """The generation of an unsigned token (the decimal string)."""
    if token is None or token == "":
        raise InvalidRequest("the Fencing-Token header is required")
    if not _DECIMAL.fullmatch(token):
        raise InvalidRequest("Fencing-Token must be a decimal generation from 1 to 2^53-1")
    gen = int(token)
    if gen > MAX_GENERATION:
        raise InvalidRequest("Fencing-Token must be a decimal generation from 1 to 2^53-1")
    return gen
