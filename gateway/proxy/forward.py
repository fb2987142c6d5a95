"""The upstream call of a proxied step, as an adapter named ``proxy:<upstream>``.

:class:`ProxyAdapter` is what :mod:`gateway.fencing.dispatch` calls between the admit and
the record, like any adapter; its payload is the prepared request (:func:`forward_payload`).
It sends the request to the configured base URL only (the connection's addresses checked by
:class:`~gateway.proxy.routing.GuardedResolver`), never follows a redirect, sets the
upstream's idempotency header to the step's tenant-qualified key ``<tenant>/<job>:<step>``
(its SHA-256, ``fg-<hex>``, when longer than 255 characters) and classifies the answer:

==============================================  ===========  ====================
what happened                                   outcome      step becomes
==============================================  ===========  ====================
2xx                                             Delivered    ``succeeded``
3xx (never followed), 4xx                       Failed       ``failed``
a 4xx of ``released_statuses``                  NotDelivered ``released``
5xx                                             Unknown      ``unknown``
connection refused, address refused, no         NotDelivered ``released``
connection within the deadline
timeout or connection lost after sending        Unknown      ``unknown``
==============================================  ===========  ====================

The recorded response (:class:`Recorded`, the record's result or error) holds the status,
the allow-listed response headers and the body, base64, up to ``max_response_bytes``; a
longer body is recorded by size and SHA-256 only (``omitted``) and its replay is refused.
The client's own ``Idempotency-Key`` (an SDK's random one) is kept there as ``client_key``.
A released status's answer is not recorded: it goes to the sink (:meth:`ResponseSink.release`),
the call's client's to have, and is never streamed.

A longer body of a status below 500 is **streamed** when the payload carries a
:class:`ResponseSink` (the view's): from the byte that passes the cap, the status, the
allowed headers and every byte read so far go to the sink, then each chunk as it comes,
while the whole body is hashed; the record says ``streamed``. A sink whose client has hung
up takes no more bytes, and the upstream's body is still read to its end, so the record has
its true size and SHA-256 whatever the client did.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

import aiohttp
from yarl import URL

from adapters.base import (
    Capabilities,
    Delivered,
    EffectRequest,
    Failed,
    NotDelivered,
    Outcome,
    Unknown,
)
from gateway.fencing.bulkheads import HttpPools
from gateway.proxy.config import Upstream
from gateway.proxy.routing import GuardedResolver
from gateway.proxy.spool import SpooledBody
from gateway.runtime.settings import BulkheadSettings

__all__ = ["ProxyAdapter", "Recorded", "ResponseSink", "forward_payload"]


class ResponseSink(Protocol):
    """Where a response over the cap is streamed (the client's connection). No method raises
    for a client that has gone or fallen behind: the sink takes no more bytes, and the
    upstream's body is read at the upstream's pace, never the client's."""

    async def start(self, status: int, headers: Sequence[tuple[str, str]]) -> None: ...
    def write(self, chunk: bytes) -> None: ...
    def close(self) -> None:
        """No more bytes (the body ended, or broke off)."""

    def release(self, answer: Recorded) -> None:
        """The upstream's answer of a status it documents as not performed: the step is
        released, and this is what the call's client gets (its body None: over the cap)."""


def forward_payload(
    method: str,
    target: str,
    headers: Sequence[tuple[str, str]],
    body: bytes | SpooledBody,
    client_key: str | None,
    sink: ResponseSink | None = None,
) -> dict[str, Any]:
    """The adapter's payload: what is sent (``target``: path and query after the base URL),
    and where a response over the cap is streamed (None: it is not)."""
    return {
        "method": method,
        "target": target,
        "headers": list(headers),
        "body": body,
        "client_key": client_key,
        "sink": sink,
    }


@dataclass(frozen=True, slots=True)
class Recorded:
    """A recorded upstream response, as stored in the step's record and replayed."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes | None  # None: omitted (longer than the cap), see size and sha256
    size: int
    sha256: str
    streamed: bool = False  # the body went to the client as it was read, never recorded

    def to_json(self, client_key: str | None) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "status": self.status,
            "headers": [list(h) for h in self.headers],
            "size": self.size,
            "sha256": self.sha256,
        }
        if self.body is None:
            doc["omitted"] = True
            if self.streamed:
                doc["streamed"] = True
        else:
            doc["body"] = base64.b64encode(self.body).decode()
        if client_key:
            doc["client_key"] = client_key
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> Recorded | None:
        """The recorded response of a record's result or error; None if it holds none."""
        if not isinstance(doc, Mapping) or not isinstance(doc.get("status"), int):
            return None
        body = doc.get("body")
        return cls(
            status=doc["status"],
            headers=tuple((str(k), str(v)) for k, v in doc.get("headers", ())),
            body=None if body is None else base64.b64decode(body),
            size=int(doc.get("size", 0)),
            sha256=str(doc.get("sha256", "")),
            streamed=bool(doc.get("streamed")),
        )


class ProxyAdapter:
    """One upstream's calls (see the module docstring)."""

    def __init__(self, upstream: Upstream, bulkheads: BulkheadSettings) -> None:
        self.upstream = upstream
        self.name = upstream.adapter_name
        self.capabilities = Capabilities(dedupes_by_key=upstream.config.dedupes_by_key)
        allow_private = upstream.config.allow_private
        # a bounded pool per tenant, as every adapter's (gateway.fencing.bulkheads)
        self._pools = HttpPools(
            self.name, bulkheads, resolver=lambda: GuardedResolver(allow_private=allow_private)
        )
        self._pool_wait = bulkheads.pool_wait_seconds

    def validate(self, operation: str, payload: Mapping[str, Any]) -> None:
        return None  # the proxy's view built the payload (forward_payload)

    async def dispatch(self, request: EffectRequest) -> Outcome:
        p = request.payload
        config = self.upstream.config
        # request.idempotency_key: core.records.proxied_key, "<tenant>/<job>:<step>"
        headers = [*p["headers"], (config.idempotency_header, request.idempotency_key)]
        sent = await self._send(
            request.tenant,
            p["method"],
            p["target"],
            headers,
            p["body"],
            min(config.timeout_seconds, request.remaining()),
            p.get("sink"),
            config.released_statuses,
        )
        if not isinstance(sent, Recorded):
            return sent
        doc = sent.to_json(p.get("client_key"))
        if 200 <= sent.status < 300:
            return Delivered(doc)
        if sent.status >= 500:
            return Unknown(
                f"{self.upstream.name} answered {sent.status}, which may come after the "
                "request was processed"
            )
        if sent.status in config.released_statuses:
            if (sink := p.get("sink")) is not None:
                sink.release(sent)
            return NotDelivered(
                f"{self.upstream.name} answered {sent.status}, a status it documents as not "
                "performed (released_statuses)"
            )
        return Failed(doc)

    async def read(
        self,
        tenant: str,
        method: str,
        target: str,
        headers: Sequence[tuple[str, str]],
        sink: ResponseSink | None = None,
    ) -> Recorded | NotDelivered | Unknown:
        """A read passed through (``GET``/``HEAD`` routes): the tenant's credential, no key,
        nothing recorded; a body over the cap streamed to ``sink``."""
        timeout = self.upstream.config.timeout_seconds
        return await self._send(tenant, method, target, list(headers), b"", timeout, sink)

    async def _send(
        self,
        tenant: str,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes | SpooledBody,
        budget: float,
        sink: ResponseSink | None = None,
        released: Collection[int] = (),
    ) -> Recorded | NotDelivered | Unknown:
        """One request to the base URL (no redirects), within ``budget`` seconds; a body over
        the cap of a ``released`` status is not streamed."""
        config = self.upstream.config
        credential = self.upstream.credential(tenant)
        if credential is not None:
            headers.append(credential)
        headers.append(("Accept-Encoding", "identity"))
        if budget <= 0:
            return NotDelivered("dispatch deadline passed before sending")
        # connect: the wait for a pooled connection and its opening (known not sent)
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=min(self._pool_wait, budget),
            sock_connect=budget,
            sock_read=budget,
        )
        probe: dict[str, bool] = {}
        # a spooled body is streamed from its file, opened anew for each send
        data: bytes | BinaryIO = body if isinstance(body, bytes) else body.open()
        try:
            async with asyncio.timeout(budget):
                async with self._pools.session(tenant).request(
                    method,
                    URL(config.base_url + target, encoded=True),
                    data=data,
                    headers=headers,
                    timeout=timeout,
                    allow_redirects=False,
                    skip_auto_headers=("User-Agent", "Content-Type"),
                    trace_request_ctx=probe,
                ) as resp:
                    return await self._read(resp, sink, released)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            return NotDelivered(f"connection to {self.upstream.name} failed: {exc}")
        except (TimeoutError, aiohttp.ClientError) as exc:
            if probe.get("traced") and not probe.get("connected"):
                return NotDelivered(f"no connection within the deadline: {type(exc).__name__}")
            return Unknown(f"no complete response after sending: {type(exc).__name__}")
        finally:
            if not isinstance(data, bytes):
                data.close()

    async def _read(
        self, resp: aiohttp.ClientResponse, sink: ResponseSink | None, released: Collection[int]
    ) -> Recorded:
        cap = self.upstream.config.max_response_bytes
        allowed = self.upstream.recorded
        headers = tuple((k, v) for k, v in resp.headers.items() if k.lower() in allowed)
        digest = hashlib.sha256()
        kept = bytearray()
        size = 0
        streaming: ResponseSink | None = None  # the sink, once the body passed the cap
        try:
            async for chunk in resp.content.iter_chunked(65_536):
                digest.update(chunk)
                size += len(chunk)
                if streaming is not None:
                    streaming.write(chunk)
                elif size <= cap:
                    kept += chunk
                elif sink is not None and resp.status < 500 and resp.status not in released:
                    # a 5xx is unknown, a released status not performed: neither is streamed
                    streaming = sink
                    await sink.start(resp.status, headers)
                    sink.write(bytes(kept) + chunk)
                    kept.clear()
        finally:
            if streaming is not None:
                streaming.close()
        return Recorded(
            status=resp.status,
            headers=headers,
            body=bytes(kept) if size <= cap else None,
            size=size,
            sha256=digest.hexdigest(),
            streamed=streaming is not None,
        )

    async def lookup(self, request: EffectRequest) -> Delivered | NotDelivered | None:
        return None

    async def aclose(self) -> None:
        await self._pools.close()
