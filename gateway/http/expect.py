"""``Expect: 100-continue``: when the gateway tells a client to send its body.

aiohttp answers ``100 Continue`` (or a text/plain 417) before the request's handler and its
middleware run. The gateway's routes use these expect handlers instead:

- :func:`continue_now` (the API's routes, whose bodies are small and read at once): ``100
  Continue`` at once, as aiohttp would; any other expectation is a problem+json 417;
- :func:`deferred` (the proxy's route): nothing before the handler. The handler refuses an
  expectation other than ``100-continue`` (417, through the middleware like every refusal)
  and calls :func:`continue_if_expected` once the request's head has passed its checks —
  the key, the upstream, the route, the job and step — and right before it reads the body:
  a request refused on its head is answered without its body ever being sent.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.http import HttpVersion11

from gateway.core.errors import ExpectationFailed
from gateway.http.problems import problem_response

__all__ = ["checked_expect", "continue_if_expected", "continue_now", "deferred"]

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def checked_expect(request: web.Request) -> bool:
    """Whether the request expects ``100 Continue``; 417 for any other expectation."""
    expect = request.headers.get("Expect")
    if expect is None:
        return False
    if expect.strip().lower() != "100-continue":
        raise ExpectationFailed(f"Expect {expect[:60]!r} is not supported: only 100-continue")
    return request.version == HttpVersion11


async def continue_now(request: web.Request) -> web.StreamResponse | None:
    try:
        expected = checked_expect(request)
    except ExpectationFailed as exc:
        return problem_response(exc)
    if expected:
        await request.writer.write(_CONTINUE)
        request.writer.output_size = 0  # the 100 is not part of the answer
    return None


async def deferred(request: web.Request) -> None:
    return None


async def continue_if_expected(request: web.Request) -> None:
    if checked_expect(request):
        await request.writer.write(_CONTINUE)
        request.writer.output_size = 0
