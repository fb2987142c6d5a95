"""The ceiling of this stack: what a replay costs with nothing of the gateway around it.

    python -m benchmarks.ceiling <redis-url> <port> echo|replay|raw     (started by make bench)

* ``echo`` (row L3): aiohttp's low-level ``web.Server`` (no Application, no
  router, no middleware), the leanest way to answer HTTP with aiohttp,
  answering every request with a small JSON body;
* ``replay`` (row L4): the same server doing only what a replay cannot skip —
  match the path, parse and validate the body, digest the intent, run the
  admit script through the gateway's own auto-pipelined
  :class:`~gateway.store.store.Store`, render the stored result. No authentication,
  no metrics, no log line, no request id, no problem documents;
* ``raw`` (row L5): the same replay on a bare ``asyncio.Protocol`` with a
  minimal HTTP/1.1 parse (request line, headers, Content-Length body, keep-alive
  only) instead of aiohttp's server: what leaving aiohttp's server would buy.

Stripped prototypes to measure against, not servers to run: they trust their
input and speak only what the load generator sends.

Row G2 (the real gateway, same jobs, same pinning) over L4 is the share of
this stack's ceiling the gateway reaches; L4 and L5 over L2 say how far a
replay can go at all on this machine with and without aiohttp's server.
"""

from __future__ import annotations

import asyncio
import gc
import re
import sys
from typing import Any

import orjson
from aiohttp import web

from gateway.core.intents import intent_digest
from gateway.core.records import Replay
from gateway.http.models import EffectBody
from gateway.store.keys import JobKeys
from gateway.store.store import Store, connect

_NAME = r"([A-Za-z0-9][A-Za-z0-9._-]{0,127})"
_PATH = re.compile(rf"^/v1/jobs/{_NAME}/effects/{_NAME}$")
_JSON = {"Content-Type": "application/json"}


async def serve(redis_url: str, port: int, mode: str) -> None:
    client = connect(redis_url, timeout=5, max_connections=128)
    store = Store(
        client, registration="required", dispatch_timeout_ms=30_000, retention_seconds=86_400
    )
    await store.load_scripts()

    async def replay(path: str, token: str, raw: bytes) -> tuple[int, bytes]:
        """The part of a replay no server can skip: (status, body)."""
        match = _PATH.match(path)
        if match is None:
            return 404, b""
        job, step = match.groups()
        body = EffectBody.model_validate(orjson.loads(raw))
        verdict = await store.admit(
            JobKeys("default", job),
            step,
            generation=int(token or "0"),
            intent_sha256=intent_digest(body.adapter, body.operation, body.payload),
            adapter=body.adapter,
            operation=body.operation,
            worker_id="",
            resolvable=False,
        )
        if not isinstance(verdict, Replay):
            return 409, b""
        record = verdict.record
        out = {
            "job_id": job,
            "step": step,
            "generation": record.generation,
            "state": record.state,
            "replayed": True,
            "idempotency_key": f"{job}:{step}",
            "adapter": record.adapter,
            "result": record.result,
        }
        return 200, orjson.dumps(out)

    async def echo(request: web.BaseRequest) -> web.StreamResponse:
        await request.read()
        return web.Response(body=b'{"ok":true}', headers=_JSON)

    async def on_aiohttp(request: web.BaseRequest) -> web.StreamResponse:
        status, body = await replay(
            request.path, request.headers.get("Fencing-Token", ""), await request.read()
        )
        return web.Response(
            status=status, body=body, headers={**_JSON, "Idempotent-Replayed": "true"}
        )

    answering: set[asyncio.Future[None]] = set()

    class RawHttp(asyncio.Protocol):
        """Keep-alive HTTP/1.1 requests with a Content-Length body; nothing else."""

        def connection_made(self, transport: Any) -> None:
            self.transport = transport
            self.buffer = b""

        def data_received(self, data: bytes) -> None:
            self.buffer += data
            while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
                lines = self.buffer[:end].split(b"\r\n")
                headers = {}
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    headers[name.strip().lower()] = value.strip()
                total = end + 4 + int(headers.get(b"content-length", b"0"))
                if len(self.buffer) < total:
                    return
                body, self.buffer = self.buffer[end + 4 : total], self.buffer[total:]
                path = lines[0].split(b" ")[1].decode()
                token = headers.get(b"fencing-token", b"").decode()
                task = asyncio.ensure_future(self.answer(path, token, body))
                answering.add(task)  # a reference until it is done
                task.add_done_callback(answering.discard)

        async def answer(self, path: str, token: str, raw: bytes) -> None:
            status, body = await replay(path, token, raw)
            self.transport.write(
                b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nIdempotent-Replayed: true\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (status, len(body), body)
            )

    loop = asyncio.get_running_loop()
    if mode == "raw":
        await loop.create_server(RawHttp, "127.0.0.1", port)
    else:
        server = web.Server(echo if mode == "echo" else on_aiohttp, access_log=None)
        await loop.create_server(server, "127.0.0.1", port)
    gc.freeze()  # as the gateway does after start-up
    gc.set_threshold(10_000)
    print("ready", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    redis_url, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(redis_url, port, mode))
        return
    uvloop.run(serve(redis_url, port, mode))


if __name__ == "__main__":
    main()
