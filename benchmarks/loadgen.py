"""A lean HTTP/1.1 keep-alive load generator (benchmarks only).

aiohttp's client spends more CPU per request than a bare aiohttp server does
to answer it, so a load generator built on it saturates its own core first and
the floor (L2) it measures is its own limit, not the server's. This one writes
pre-built request bytes on persistent connections and parses only the status
line and Content-Length of each answer: one connection per concurrent worker,
no pooling logic, no header objects.

It speaks exactly what the benchmark needs: requests with a body or none,
responses with a Content-Length (aiohttp always sends one for these).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

__all__ = ["HttpConnection", "LeanClient"]


class HttpConnection(asyncio.Protocol):
    def __init__(self) -> None:
        self._buf = bytearray()
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.transport: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # uvloop's transports do not subclass asyncio.Transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ConnectionError(f"connection lost: {exc}"))

    def data_received(self, data: bytes) -> None:
        self._buf += data
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self._buf[:end]
        i = head.lower().find(b"\r\ncontent-length:")
        if i < 0:
            raise RuntimeError("response without Content-Length")
        j = head.find(b"\r\n", i + 2)
        length = int(head[i + 17 : j if j >= 0 else len(head)])
        total = end + 4 + length
        if len(self._buf) < total:
            return
        status = int(head[9:12])
        body = bytes(self._buf[end + 4 : total])
        del self._buf[:total]
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result((status, body))

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        assert self.transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self._waiter


class LeanClient:
    """Pre-builds requests; each concurrent worker borrows its own connection."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._idle: list[HttpConnection] = []
        self._all: list[HttpConnection] = []

    @staticmethod
    def build(
        method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> bytes:
        data = b"" if body is None else json.dumps(body).encode()
        lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(data)}"]
        if body is not None:
            lines.append("Content-Type: application/json")
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + data

    async def send(self, raw: bytes) -> tuple[int, bytes]:
        conn = self._idle.pop() if self._idle else await self._connect()
        try:
            result = await conn.request(raw)
        except BaseException:
            if conn.transport is not None:
                conn.transport.close()
            raise
        self._idle.append(conn)
        return result

    async def _connect(self) -> HttpConnection:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(HttpConnection, self.host, self.port)
        self._all.append(conn)
        return conn

    def close(self) -> None:
        for conn in self._all:
            if conn.transport is not None:
                conn.transport.close()
