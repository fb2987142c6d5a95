"""The ``Prefer`` request header (RFC 7240 §2), parsed as preference tokens.

::

    Prefer     = 1#preference
    preference = token [ BWS "=" BWS word ] *( OWS ";" [ OWS parameter ] )
    parameter  = token [ BWS "=" BWS word ]
    word       = token / quoted-string

Several ``Prefer`` header lines are one comma-separated list. Preference names
are case-insensitive (``RESPOND-ASYNC`` is ``respond-async``), values are not.
The first instance of a preference counts (§2). A list element that does not
parse is ignored as a whole — a preference the gateway cannot read is one it
does not honour — and so are empty elements. ``no-respond-async`` and
``respond-async-x`` are other tokens, and a ``respond-async`` inside a value or
a parameter is not the preference: matching a substring (as the gateway once
did) sent those calls to the relay.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Preference", "parse_prefer"]

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_QUOTED = re.compile(r'"((?:[^"\\\x00-\x08\x0a-\x1f\x7f]|\\[\t\x20-\x7e\x80-\xff])*)"')
_OWS = re.compile(r"[ \t]*")
_UNQUOTE = re.compile(r"\\(.)")


@dataclass(frozen=True, slots=True)
class Preference:
    value: str | None = None
    params: tuple[tuple[str, str | None], ...] = ()


class _Malformed(Exception):
    pass


class _Scanner:
    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def ows(self) -> None:
        m = _OWS.match(self.text, self.pos)
        self.pos = m.end() if m else self.pos

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def token(self) -> str:
        m = _TOKEN.match(self.text, self.pos)
        if not m:
            raise _Malformed
        self.pos = m.end()
        return m.group()

    def word(self) -> str:
        if self.peek() == '"':
            m = _QUOTED.match(self.text, self.pos)
            if not m:
                raise _Malformed
            self.pos = m.end()
            return _UNQUOTE.sub(r"\1", m.group(1))
        return self.token()

    def name_value(self) -> tuple[str, str | None]:
        name = self.token().lower()
        self.ows()
        if self.peek() != "=":
            return name, None
        self.pos += 1
        self.ows()
        return name, self.word()

    def skip_element(self) -> None:
        """Past the next comma that is not inside a quoted string (or to the end)."""
        while self.pos < len(self.text):
            ch = self.text[self.pos]
            if ch == ",":
                return
            if ch == '"':
                m = _QUOTED.match(self.text, self.pos)
                self.pos = m.end() if m else len(self.text)
                continue
            self.pos += 1


def parse_prefer(values: Iterable[str]) -> dict[str, Preference]:
    """All ``Prefer`` header values of a request → {lower-cased name: first instance}."""
    scanner = _Scanner(",".join(values))
    found: dict[str, Preference] = {}
    while scanner.pos < len(scanner.text):
        scanner.ows()
        if scanner.peek() == ",":  # empty list element
            scanner.pos += 1
            continue
        if not scanner.peek():
            break
        start = scanner.pos
        try:
            name, value = scanner.name_value()
            params: list[tuple[str, str | None]] = []
            scanner.ows()
            while scanner.peek() == ";":
                scanner.pos += 1
                scanner.ows()
                if scanner.peek() not in (";", ",", ""):
                    params.append(scanner.name_value())
                scanner.ows()
            if scanner.peek() not in (",", ""):
                raise _Malformed
        except _Malformed:
            scanner.pos = start
            scanner.skip_element()
            continue
        found.setdefault(name, Preference(value, tuple(params)))
    return found
