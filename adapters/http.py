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
from gateway.core.fastjson import loads_exact

__all__ = ["Response", "request", "send_trace"]


def send_trace() -> aiohttp.TraceConfig:
    """Marks, per request, whether it got a connection (``trace_request_ctx``): a request that
    timed out before it had one never left the gateway. Sessions built by the gateway carry
    it; without it every timeout stays ``Unknown``."""

    async def started(_: Any, ctx: Any, __: Any) -> None:
        if isinstance(ctx.trace_request_ctx, dict):
            ctx.trace_request_ctx["traced"] = True

    async def connected(_: Any, ctx: Any, __: Any) -> None:
        if isinstance(ctx.trace_request_ctx, dict):
            ctx.trace_request_ctx["connected"] = True

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(started)
    trace.on_connection_create_end.append(connected)
    trace.on_connection_reuseconn.append(connected)
    trace.freeze()
    return trace


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
    probe: dict[str, bool] = {}  # filled by send_trace(): did this request get a connection?
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
                trace_request_ctx=probe,
            ) as resp:
                raw = await resp.content.read(max_bytes + 1)
                truncated = len(raw) > max_bytes
                return Response(
                    resp.status, _parse(raw[:max_bytes], truncated), truncated, resp.headers
                )
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
        return NotDelivered(f"connection failed: {type(exc).__name__}")
    except (TimeoutError, aiohttp.ClientError) as exc:
        if probe.get("traced") and not probe.get("connected"):
            # no connection within the budget (the pool was full): nothing was sent
            return NotDelivered(f"no connection within the deadline: {type(exc).__name__}")
        return Unknown(f"no complete response after sending: {type(exc).__name__}")
