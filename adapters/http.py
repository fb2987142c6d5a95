"""One HTTP request for an adapter: deadline-bound, no redirects, size-limited body.

Returns the response, or the outcome when there is no response to classify:
:class:`NotDelivered` when the connection never opened (nothing was sent),
:class:`Unknown` when the request may have been sent but no complete answer
came back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from multidict import CIMultiDictProxy

from adapters.base import NotDelivered, Unknown
from gateway.fastjson import loads_exact

__all__ = ["Response", "request"]


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: Any  # parsed JSON, else text
    truncated: bool
    headers: CIMultiDictProxy[str]

    def summary(self) -> dict[str, Any]:
        info: dict[str, Any] = {"status": self.status, "body": self.body}
        if self.truncated:
            info["truncated"] = True
        return info


def _parse(raw: bytes, truncated: bool) -> Any:
    """JSON if it is complete JSON the gateway can store exactly, else text (a cut body is
    never parsed; ``{"v": 1e999}`` or ``NaN`` stays the text it was, not ``null``)."""
    if raw and not truncated:
        try:
            return loads_exact(raw)
        except (ValueError, RecursionError):
            pass
    return raw.decode("utf-8", "replace")


async def request(
    http: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    budget: float,
    max_bytes: int,
    headers: Mapping[str, str] | None = None,
    data: bytes | str | None = None,
    params: Mapping[str, str] | None = None,
) -> Response | NotDelivered | Unknown:
    if budget <= 0:
        return NotDelivered("dispatch deadline passed before sending")
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=budget, sock_read=budget)
    try:
        async with asyncio.timeout(budget):
            async with http.request(
                method,
                url,
                data=data,
                params=params,
                headers=headers,
                timeout=timeout,
                allow_redirects=False,
            ) as resp:
                raw = await resp.content.read(max_bytes + 1)
                truncated = len(raw) > max_bytes
                return Response(
                    resp.status, _parse(raw[:max_bytes], truncated), truncated, resp.headers
                )
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
        return NotDelivered(f"connection failed: {type(exc).__name__}")
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Unknown(f"no complete response after sending: {type(exc).__name__}")
