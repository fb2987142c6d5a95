"""The ceiling of this stack: what a replay costs with nothing of the gateway around it.

    python -m benchmarks.ceiling <redis-url> <port> echo|replay     (started by make bench)

Two servers on aiohttp's low-level ``web.Server`` (no Application, no router,
no middleware), the leanest way to answer HTTP with aiohttp:

* ``echo`` answers every request with a small JSON body (row L3);
* ``replay`` does only what a replay cannot skip: match the path, read and
  validate the body, digest the intent, run the admit script through the
  gateway's own :class:`~gateway.store.Store` (auto-pipelined), render the
  stored result (row L4). No authentication, no metrics, no log line, no
  request id, no problem documents — a stripped prototype, not a server to run.

Row G2 (the real gateway, same jobs, same pinning) over L4 is the share of
this stack's ceiling the gateway reaches; L4 over L2 says how far a replay on
aiohttp + redis-py can go at all on this machine.
"""

from __future__ import annotations

import asyncio
import gc
import re
import sys

import orjson
from aiohttp import web

from gateway.intents import intent_digest
from gateway.keys import JobKeys
from gateway.models import EffectBody
from gateway.records import Replay
from gateway.store import Store, connect

_NAME = r"([A-Za-z0-9][A-Za-z0-9._-]{0,127})"
_PATH = re.compile(rf"^/v1/jobs/{_NAME}/effects/{_NAME}$")
_JSON = {"Content-Type": "application/json"}


async def serve(redis_url: str, port: int, mode: str) -> None:
    client = connect(redis_url, timeout=5, max_connections=128)
    store = Store(
        client, registration="required", dispatch_timeout_ms=30_000, retention_seconds=86_400
    )
    await store.load_scripts()

    async def echo(request: web.BaseRequest) -> web.StreamResponse:
        await request.read()
        return web.Response(body=b'{"ok":true}', headers=_JSON)

    async def replay(request: web.BaseRequest) -> web.StreamResponse:
        match = _PATH.match(request.path)
        if match is None or request.method != "POST":
            return web.Response(status=404)
        job, step = match.groups()
        body = EffectBody.model_validate(orjson.loads(await request.read()))
        verdict = await store.admit(
            JobKeys("default", job),
            step,
            generation=int(request.headers.get("Fencing-Token", "0")),
            intent_sha256=intent_digest(body.adapter, body.operation, body.payload),
            adapter=body.adapter,
            operation=body.operation,
            worker_id="",
            resolvable=False,
        )
        if not isinstance(verdict, Replay):
            return web.Response(status=409)
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
        return web.Response(
            body=orjson.dumps(out), headers={**_JSON, "Idempotent-Replayed": "true"}
        )

    server = web.Server(echo if mode == "echo" else replay, access_log=None)
    await asyncio.get_running_loop().create_server(server, "127.0.0.1", port)
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
