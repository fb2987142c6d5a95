"""Header hygiene: what may become an HTTP or email header value or name.

Every control character and line separator is refused: C0 (tab included), DEL,
C1 (NEL U+0085 included) and U+2028 / U+2029. Some of them end a header block
or fold a line in one parser and not in another (Python's email package treats
VT, FF, NEL and U+2028 as line breaks), so none of them reaches a downstream.
"""

from __future__ import annotations

import re

__all__ = ["CONTROL", "HEADER_NAME", "check_header", "has_control"]

CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# RFC 9110 token characters
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}")


def has_control(value: str) -> bool:
    """True if ``value`` holds a control character or a line separator."""
    return CONTROL.search(value) is not None


def check_header(name: str, value: str, what: str) -> None:
    """ValueError unless ``name: value`` can be sent as one header line as it is."""
    if not HEADER_NAME.fullmatch(name):
        raise ValueError(f"{what}: {name!r} is not a valid header name")
    if has_control(value):
        raise ValueError(f"{what}: the value of {name} holds a control character or line break")
    if not value.isascii():
        raise ValueError(f"{what}: the value of {name} is not ASCII text")
