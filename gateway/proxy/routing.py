"""Where a proxied request may go: its path, its route, the addresses behind the upstream.

The path after ``/proxy/<upstream>/`` is checked on the raw request target, before it is
decoded or anything else is done (:func:`checked_rest`): an escape from the base URL in any
spelling — ``..`` or ``.`` segments, encoded dots (``%2e``), encoded slashes or backslashes
(``%2F``, ``%5C``), a literal backslash, an empty segment (``//``), NUL or any control
character, non-ASCII — is a 400 and nothing happens. The host, scheme and port always come
from the configuration: the request target's absolute form and ``X-Forwarded-Host`` are
never read.

A route pattern is ``"METHOD /a/b/*"``: a ``*`` segment matches exactly one segment. POST,
PUT, PATCH and DELETE routes are fenced steps; GET and HEAD routes are reads, passed through.

An address is refused (:func:`address_refused`) unless it is global unicast: private,
loopback, link-local (169.254.169.254, the cloud metadata service), shared (100.64/10),
reserved, multicast and unspecified addresses are refused, so is an IPv4 address wrapped in
IPv6 (mapped, 6to4, Teredo, the NAT64 prefix) that would be. :class:`GuardedResolver`
applies the rule to every address a name resolves to, inside the connection's own
resolution: the address
checked is the address connected to (a name that resolves to a public address for a check
and to a private one for the connection — DNS rebinding — cannot slip between the two).
"""

from __future__ import annotations

import errno
import ipaddress
import re
import socket
from dataclasses import dataclass

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

__all__ = [
    "SAFE_METHODS",
    "UNSAFE_METHODS",
    "AddressRefused",
    "GuardedResolver",
    "PathRefused",
    "RoutePattern",
    "address_refused",
    "checked_rest",
    "normalised_path",
    "parse_route",
]

UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})  # each a fenced step
SAFE_METHODS = frozenset({"GET", "HEAD"})  # passed through, when a route lists them
_SEGMENT = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@%]+")
_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")
_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_~")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_ROUTE = re.compile(r"(POST|PUT|PATCH|DELETE|GET|HEAD|OPTIONS) (/[^\s?#]*)")


class PathRefused(ValueError):
    """The proxied path would leave the upstream's base, or cannot be forwarded as it is."""


class AddressRefused(OSError):
    """The upstream's name resolved to an address the proxy may not connect to."""


def checked_rest(raw: str) -> str:
    """The raw path after ``/proxy/<upstream>/`` (no query), refused (:class:`PathRefused`)
    if it could escape the base or be read two ways; returned as it was sent."""
    if not raw:
        raise PathRefused("the path names nothing after the upstream")
    if not raw.isascii():
        raise PathRefused("the path must be ASCII (percent-encode the rest)")
    for segment in raw.split("/"):
        if not segment:
            raise PathRefused("the path has an empty segment ('//' or a trailing '/')")
        if not _SEGMENT.fullmatch(segment):
            raise PathRefused("the path holds a character that must be percent-encoded")
        for m in _ESCAPE.finditer(segment):
            byte = int(m.group(1), 16)
            if byte in (0x2E, 0x2F, 0x5C) or byte < 0x20 or byte == 0x7F:
                raise PathRefused(
                    "the path encodes a dot, a slash, a backslash or a control character"
                )
        if segment.count("%") != len(_ESCAPE.findall(segment)):
            raise PathRefused("the path has a malformed percent escape")
        if segment in (".", ".."):
            raise PathRefused("the path has a '.' or '..' segment")
    return raw


def normalised_path(rest: str) -> str:
    """One spelling of a checked path: escapes of unreserved characters decoded, other
    escapes in upper case (``%7e`` and ``~`` are the same request)."""

    def one(m: re.Match[str]) -> str:
        byte = int(m.group(1), 16)
        return chr(byte) if byte in _UNRESERVED else "%" + m.group(1).upper()

    return "/" + _ESCAPE.sub(one, rest)


@dataclass(frozen=True, slots=True)
class RoutePattern:
    method: str
    segments: tuple[str, ...]

    def matches(self, method: str, path: str) -> bool:
        """``path``: a normalised path (leading ``/``)."""
        if method != self.method:
            return False
        parts = path[1:].split("/")
        if len(parts) != len(self.segments):
            return False
        return all(p == "*" or p == s for p, s in zip(self.segments, parts, strict=True))


def parse_route(route: str) -> RoutePattern:
    """``"POST /v1/refunds"`` → a pattern; ValueError naming what is wrong."""
    m = _ROUTE.fullmatch(route)
    if m is None:
        raise ValueError(f"route {route!r} must be 'METHOD /path' (path segments or '*')")
    method, path = m.group(1), m.group(2)
    if method not in UNSAFE_METHODS | SAFE_METHODS:
        raise ValueError(
            f"route {route!r}: POST, PUT, PATCH and DELETE are proxied as fenced steps, GET "
            "and HEAD passed through; nothing else"
        )
    segments = tuple(path[1:].split("/"))
    for s in segments:
        if s != "*":
            try:
                checked_rest(s)
            except PathRefused as exc:
                raise ValueError(f"route {route!r}: {exc}") from None
    return RoutePattern(method, tuple(s if s == "*" else normalised_path(s)[1:] for s in segments))


def address_refused(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """True unless ``ip`` is a global unicast address (nor wraps a refused IPv4 one)."""
    if isinstance(ip, ipaddress.IPv6Address):
        inner = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if inner is None and ip in _NAT64:  # a NAT64 gateway connects to the embedded IPv4
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if inner is not None and address_refused(inner):
            return True
    return not ip.is_global or ip.is_multicast or ip.is_unspecified


class GuardedResolver(AbstractResolver):
    """Resolves as the default resolver does, then refuses every address
    :func:`address_refused` refuses (``allow_private``: none). Raises
    :class:`AddressRefused` when nothing is left, so no connection is opened."""

    def __init__(self, *, allow_private: bool) -> None:
        self._inner = DefaultResolver()
        self._allow_private = allow_private

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        if self._allow_private:
            return found
        kept = [
            r for r in found if not address_refused(ipaddress.ip_address(r["host"].split("%")[0]))
        ]
        if not kept:
            raise AddressRefused(
                errno.EACCES,
                f"{host} resolves to no public address (private, loopback, link-local or "
                "reserved addresses are refused; allow_private = true allows them)",
            )
        return kept

    async def close(self) -> None:
        await self._inner.close()
