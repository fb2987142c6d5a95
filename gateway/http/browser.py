"""A browser cannot drive the gateway: the checks every request passes before its handler.

In order, on every route and method (``/healthz``, ``/metrics`` and
``/openapi.json`` included):

1. every header name and value is valid UTF-8 (aiohttp hands undecodable bytes
   on as lone surrogates) — else 400 ``invalid_request``;
2. ``Host``, when sent, names this gateway (``server.allowed_hosts``; by
   default in open mode only ``localhost`` and loopback IP literals, any port;
   with keys any name) — else 403 ``forbidden``: DNS rebinding;
3. ``Origin``, when sent, is in ``server.allowed_origins`` (default: none) —
   else 403; without an allowed ``Origin``, ``Sec-Fetch-Site`` must be absent,
   ``same-origin`` or ``none`` — else 403: cross-site and same-site pages;
4. a request that declares a ``Content-Type`` or carries a body declares
   ``application/json`` (an optional ``charset=utf-8``) — else 415
   ``unsupported_media_type``; the one exception is an empty body declared
   ``application/octet-stream`` (what aiohttp's client sends on a POST without
   a body), and the output upload route (``streams_body``: a PUT, which no form can
   send and a page's ``fetch`` cannot send cross-site without a preflight), and the
   proxy's route (``any_media_type``: the upstream's media types; it requires the
   ``Fencing-Token``, ``Fencegate-Job`` and ``Fencegate-Step`` headers, which no form
   can send and a cross-site ``fetch`` cannot send without a preflight). HTML forms
   can only send urlencoded, multipart or ``text/plain``
   (even with no fields), and a page's ``fetch`` with a JSON or octet-stream
   body needs a CORS preflight, which this gateway never allows (it sends no
   CORS headers at all).
"""

from __future__ import annotations

import ipaddress
import re

from aiohttp import web
from multidict import CIMultiDictProxy

from gateway.core.errors import Forbidden, InvalidRequest, UnsupportedMediaType
from gateway.runtime.settings import ServerSettings

__all__ = ["GUARD", "BrowserGuard", "split_host"]

_HOST = re.compile(r"(\[[0-9a-f:.]+\]|[a-z0-9_.-]+)(?::([0-9]{1,5}))?")
_SAFE_SITES = frozenset({"same-origin", "none"})
_OCTET = "application/octet-stream"  # aiohttp's default on a POST without a body


def split_host(value: str) -> tuple[str, str] | None:
    """``(name, port)`` of a Host header (lowercased; ``port`` may be ``""``), else None."""
    m = _HOST.fullmatch(value.lower())
    if m is None:
        return None
    return m.group(1), m.group(2) or ""


def _loopback_name(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def _json_media_type(value: str) -> bool:
    """``application/json``, optionally with ``charset=utf-8`` (JSON is UTF-8: RFC 8259)."""
    media, _, params = value.partition(";")
    if media.strip().lower() != "application/json":
        return False
    for param in params.split(";"):
        key, _, val = param.partition("=")
        if key.strip().lower() == "charset" and val.strip().strip('"').lower() != "utf-8":
            return False
    return True


class BrowserGuard:
    """The checks of this module's docstring, built once from the server settings."""

    def __init__(self, server: ServerSettings, *, open_mode: bool) -> None:
        self._origins = frozenset(server.allowed_origins)
        hosts = server.allowed_hosts
        self._any_host = (hosts is None and not open_mode) or (hosts is not None and "*" in hosts)
        self._loopback_only = hosts is None and open_mode
        names: set[str] = set()
        exact: set[str] = set()
        for host in hosts or ():
            parts = split_host(host)
            if parts is not None:  # the settings refuse any other entry but "*"
                (exact if parts[1] else names).add(f"{parts[0]}:{parts[1]}".rstrip(":"))
        self._names, self._exact = frozenset(names), frozenset(exact)
        self._decided: dict[str, bool] = {}  # Host values seen (bounded): one parse each

    def host_allowed(self, value: str) -> bool:
        known = self._decided.get(value)
        if known is not None:
            return known
        parts = split_host(value)
        if parts is None:
            ok = False
        elif self._any_host:
            ok = True
        elif self._loopback_only:
            ok = _loopback_name(parts[0])
        else:
            ok = parts[0] in self._names or f"{parts[0]}:{parts[1]}" in self._exact
        if len(self._decided) < 256:
            self._decided[value] = ok
        return ok

    def check(self, request: web.Request) -> None:
        headers: CIMultiDictProxy[str] = request.headers
        for name, value in headers.items():
            if not (value.isascii() and name.isascii()) and not _utf8(name + value):
                raise InvalidRequest("a request header is not valid UTF-8")
        hosts = headers.getall("Host", ())
        if len(hosts) > 1:
            raise InvalidRequest("more than one Host header")
        if hosts and not self.host_allowed(hosts[0]):
            raise Forbidden(
                f"Host {hosts[0]!r} is not a name of this gateway (server.allowed_hosts); "
                "requests through a foreign name (DNS rebinding) are refused"
            )
        origin = headers.get("Origin")
        if origin is None or origin not in self._origins:
            if origin is not None:
                raise Forbidden(
                    f"requests from web pages are refused: Origin {origin!r} is not in "
                    "server.allowed_origins"
                )
            site = headers.get("Sec-Fetch-Site")
            if site is not None and site.lower() not in _SAFE_SITES:
                raise Forbidden(f"requests from web pages are refused: Sec-Fetch-Site is {site!r}")
        types = headers.getall("Content-Type", ())
        handler = request.match_info.handler
        if getattr(handler, "streams_body", False) or getattr(handler, "any_media_type", False):
            return  # an output's bytes, a proxied body (gateway.http.proxied): any media type
        if len(types) > 1:
            raise UnsupportedMediaType("more than one Content-Type header")
        if types:
            if not _json_media_type(types[0]) and (
                request.body_exists or types[0].strip().lower() != _OCTET
            ):
                raise UnsupportedMediaType(
                    f"Content-Type must be application/json, not {types[0][:100]!r}"
                )
        elif request.body_exists:
            raise UnsupportedMediaType("a request body needs Content-Type: application/json")


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


GUARD = web.AppKey("browser_guard", BrowserGuard)
