"""JSON on the hot path: orjson's speed, the stdlib's meaning, and no number ever changed.

orjson is several times faster for request bodies, problem documents, stored
results and log lines, but it reads an integer beyond 64 bits as a float
*without an error* (``18446744073709551617`` becomes ``1.8446744073709552e19``),
which would change payloads on their way downstream and give different integers
one intent digest. So orjson only reads a document in which no
number can be affected: no run of 16 or more digits and no exponent of three or
more digits. There every integer fits in 64 bits and every other number has at
most 15 significant digits in the normal range of a double, where orjson and
the stdlib agree to the bit. Anything else — and anything orjson refuses — is
read by the stdlib, which keeps integers of any size exact.

The number model (README, "JSON numbers"):

- an integer (no fraction, no exponent) is carried exactly, at any size;
- any other number is an IEEE 754 double (RFC 8259 §6): ``1.10`` and ``1.1`` are
  the same number, sent on as the shortest text of that double;
- :func:`loads_exact` refuses what cannot be carried that way: a number whose
  double is infinite (``1e999``), a non-zero number that becomes 0 (``1e-400``),
  ``NaN`` / ``Infinity`` (not JSON), an integer longer than Python converts, and
  lone surrogate escapes — with :class:`Unrepresentable`, naming the field.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

import orjson

__all__ = ["Unrepresentable", "dumps", "loads", "loads_exact"]

# A document orjson may read: it cannot hold an integer beyond 64 bits or a number
# that over- or underflows a double, i.e. no match of SUSPECT anywhere in its text. Digits
# inside strings only cost the slow path.
SUSPECT = rb"[0-9]{16}|[eE][+-]?[0-9]{3}"
# SUSPECT without a regular expression (the re engine tries its alternatives at every byte:
# several times orjson's own parse of a small body): each digit read as 0, each e or E as e,
# each + or - as +, any other byte as "."; then a match is one of three substrings.
_CLASSES = bytes(
    ord("0")
    if c in b"0123456789"
    else ord("e")
    if c in b"eE"
    else ord("+")
    if c in b"+-"
    else ord(".")
    for c in range(256)
)
_DIGITS_16 = b"0" * 16
_NONZERO_MANTISSA = re.compile(r"^[^eE]*[1-9]")


class Unrepresentable(ValueError):
    """Valid-looking JSON the gateway cannot carry exactly (a 400, never a changed value)."""


def dumps(value: Any, default: Any = None) -> bytes:
    """Compact JSON as UTF-8 bytes."""
    try:
        return orjson.dumps(value, default=default)
    except TypeError:  # e.g. an integer beyond 64 bits: the stdlib writes it exactly
        return json.dumps(value, default=default, separators=(",", ":")).encode()


def _fast(raw: str | bytes) -> bool:
    """No match of :data:`SUSPECT` in ``raw``: orjson reads it exactly."""
    if isinstance(raw, str):  # its UTF-8 (surrogates too): ASCII bytes are the same characters
        raw = raw.encode("utf-8", "surrogatepass")
    elif isinstance(raw, memoryview):
        raw = raw.tobytes()
    seen = raw.translate(_CLASSES)
    return _DIGITS_16 not in seen and b"e000" not in seen and b"e+000" not in seen


def loads(raw: str | bytes) -> Any:
    """Exactly what ``json.loads`` answers (used for what the gateway stored itself)."""
    if _fast(raw):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw)


class _Bad:
    """Stands in for a number that cannot be carried, until its path is known."""

    __slots__ = ("text", "why")

    def __init__(self, text: str, why: str) -> None:
        self.text, self.why = text, why


def loads_exact(raw: str | bytes) -> Any:
    """Parse JSON that will be carried on (request bodies, downstream answers).

    Raises :class:`Unrepresentable` (``"<path>: the number 1e999 …"``) for what the
    module docstring lists, ``ValueError`` for what is not JSON, ``RecursionError``
    for nesting the parser cannot follow.
    """
    if _fast(raw):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    bad: list[_Bad] = []

    def number(text: str) -> float | _Bad:
        value = float(text)
        if math.isinf(value):
            bad.append(_Bad(text, "has no finite IEEE 754 double (it overflows)"))
            return bad[-1]
        if value == 0.0 and _NONZERO_MANTISSA.match(text):
            bad.append(_Bad(text, "is not zero but underflows to 0 as an IEEE 754 double"))
            return bad[-1]
        return value

    def integer(text: str) -> int | _Bad:
        limit = sys.get_int_max_str_digits()
        if limit and len(text.lstrip("-")) > limit:
            bad.append(_Bad(text[:24] + "…", f"has more than {limit} digits"))
            return bad[-1]
        return int(text)

    def constant(name: str) -> _Bad:
        bad.append(_Bad(name, "is not JSON (RFC 8259 has no NaN or Infinity)"))
        return bad[-1]

    data = json.loads(raw, parse_float=number, parse_int=integer, parse_constant=constant)
    if bad:
        first = bad[0]
        raise Unrepresentable(
            f"{_path_of(data, first)}: the number {first.text} {first.why}; "
            "send it as a string, or as an integer if it is one"
        )
    try:  # a lone surrogate escape ("\ud800") parses, but no downstream can be sent it
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError as exc:
        raise Unrepresentable("the body has a lone surrogate escape: not valid Unicode") from exc
    return data


def _path_of(root: Any, target: _Bad) -> str:
    """Dotted path (``payload.items.0.price``) of ``target`` in document order."""
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if node is target:
            return path or "(the document)"
        if isinstance(node, dict):
            children = [(v, f"{path}.{k}" if path else str(k)) for k, v in node.items()]
        elif isinstance(node, list):
            children = [(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(node)]
        else:
            continue
        stack.extend(reversed(children))
    return "(the document)"
