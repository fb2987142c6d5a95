"""The console's browser rules, the counterpart of :mod:`gateway.browser` for its pages.

The API refuses every request a web page could make (``Origin``, ``Sec-Fetch-Site``,
form bodies). The console *is* a web page, so its routes pass these checks instead:

* every header is valid UTF-8, and ``Host`` names this gateway — the very check the API
  makes (its ``host_allowed``, passed in; ``server.allowed_hosts``; DNS rebinding);
* a POST comes from this origin: ``Origin`` equals the request's own origin (or one of
  ``server.allowed_origins``), ``Sec-Fetch-Site``, when sent, is ``same-origin``, and the
  body is an urlencoded form; else 403 — a cross-site form cannot post here, with or without
  the cookie (which is ``SameSite=Strict`` anyway); every form also carries a CSRF token;
* a GET from another site is served only as a top-level navigation (a permalink pasted in a
  ticket); anything else cross-site (an ``<img>``, a ``fetch``, an ``EventSource``) is 403.

Every response of the console carries the headers of :data:`SECURITY_HEADERS`: a strict CSP
(no inline script or style, nothing from another origin, no framing), ``nosniff``, no
referrer beyond this origin (``same-origin``: under ``no-referrer`` a browser sends
``Origin: null`` with a form). They are set when a response is prepared, so streamed (SSE)
responses carry them too.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from aiohttp import web

__all__ = ["SECURITY_HEADERS", "Refused", "check_request", "security_headers"]

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
_SAFE = frozenset({"GET", "HEAD"})
_FORM = "application/x-www-form-urlencoded"


class Refused(Exception):
    """A request the console will not serve: (HTTP status, why)."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status
        self.why = why


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_request(
    request: web.Request, host_allowed: Callable[[str], bool], origins: Collection[str]
) -> None:
    """Raise :class:`Refused` unless the request may reach a console handler."""
    headers = request.headers
    for name, value in headers.items():
        if not (value.isascii() and name.isascii()) and not _utf8(name + value):
            raise Refused(400, "a request header is not valid UTF-8")
    hosts = headers.getall("Host", ())
    if len(hosts) > 1:
        raise Refused(400, "more than one Host header")
    if hosts and not host_allowed(hosts[0]):
        raise Refused(403, "this Host is not a name of this gateway (server.allowed_hosts)")
    site = (headers.get("Sec-Fetch-Site") or "").lower()
    if request.method in _SAFE:
        if site not in ("", "same-origin", "none") and headers.get("Sec-Fetch-Mode") != "navigate":
            raise Refused(403, "the console is not served to other sites' pages")
        return
    origin = headers.get("Origin")
    own = f"{request.scheme}://{request.host}".lower()
    if origin is None or (origin.lower() != own and origin not in origins):
        raise Refused(403, "a form of the console must be sent from the console's own origin")
    if site not in ("", "same-origin"):
        raise Refused(403, "a form of the console must be sent from the console itself")
    media = (headers.get("Content-Type") or "").partition(";")[0].strip().lower()
    if media != _FORM:
        raise Refused(415, "the console accepts form posts only")


async def security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the same headers on every console response, streams too."""
    response.headers.update(SECURITY_HEADERS)
    if request.path.startswith("/console/static/") and response.status == 200:
        response.headers["Cache-Control"] = (
            "public, max-age=31536000, immutable" if "v" in request.query else "no-cache"
        )
    else:
        response.headers["Cache-Control"] = "no-store"
