"""The parity check: for the same calls, the peer answers what the gateway answers.

Each call (method, path, headers, body) goes to the gateway and to the peer; their status and
body must be the same bytes, and so must every header but those that must differ
(:data:`EXCLUDED`). The answers are read with aiohttp's client (not timed)."""

from __future__ import annotations

from typing import Any

import aiohttp

# headers that differ by construction: a fresh request id (the gateway's), the clock, the
# server's name, and nginx's explicit keep-alive (aiohttp leaves it implicit on HTTP/1.1)
EXCLUDED = ("Date", "Server", "X-Request-ID", "Connection")


async def _answer(
    session: aiohttp.ClientSession, base: str, call: tuple[str, str, dict[str, str], bytes]
) -> tuple[int, dict[str, str], bytes]:
    method, path, headers, body = call
    async with session.request(method, base + path, headers=headers, data=body) as resp:
        kept = {k: v for k, v in resp.headers.items() if k.lower() not in _EXCLUDED_LOWER}
        return resp.status, kept, await resp.read()


_EXCLUDED_LOWER = {h.lower() for h in EXCLUDED}


async def compare(
    gateway: str, peer: str, calls: list[tuple[str, str, dict[str, str], bytes]], what: str
) -> dict[str, Any]:
    """Send each call to both; how many answers were identical, and the first that was not."""
    same = 0
    first: dict[str, Any] | None = None
    statuses: set[int] = set()
    async with aiohttp.ClientSession() as session:
        for call in calls:
            g = await _answer(session, gateway, call)
            p = await _answer(session, peer, call)
            statuses.add(g[0])
            if g == p:
                same += 1
            elif first is None:
                first = {"call": f"{call[0]} {call[1]}",
                         "gateway": [g[0], g[1], g[2].decode(errors="replace")],
                         "peer": [p[0], p[1], p[2].decode(errors="replace")]}  # fmt: skip
    return {
        "what": what,
        "calls": len(calls),
        "identical": same,
        "statuses": sorted(statuses),
        "compared": "status, body and headers",
        "excluded_headers": list(EXCLUDED),
        **({"first_difference": first} if first else {}),
    }
