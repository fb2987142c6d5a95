"""The reverse proxy's test parties: the keys and provider credentials of two tenants, a plain
HTTP receiver that records every request, the upstreams configured in front of it, and the
headers of a fenced call."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.conftest import Gateway, key_digest

KEYS = {
    "acme": "acme-worker-key",
    "globex": "globex-worker-key",
    "sched": "acme-scheduler-key",
    "sched-globex": "globex-scheduler-key",
    "audit": "acme-auditor-key",
}
SECRETS = {"PAY_ACME": "sk_live_acme_secret", "PAY_GLOBEX": "sk_live_globex_secret"}


@dataclass
class Seen:
    method: str
    path_qs: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """A plain HTTP receiver: records every request; ``statuses`` answers in turn (then 200),
    ``"drop"`` closes the connection after reading the request; ``gate`` holds answers;
    ``reply`` makes the JSON body of an answer from its number and request (an OpenAI-style
    API: :func:`chat_completion`)."""

    url: str = ""
    seen: list[Seen] = field(default_factory=list)
    statuses: list[Any] = field(default_factory=list)
    gate: asyncio.Event | None = None
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    reply: Callable[[int, Seen], Any] | None = None

    def hold(self) -> asyncio.Event:
        """Hold every answer until the returned event is set; ``arrived`` then waits for a
        request that comes after this call, not for one that came before."""
        self.gate = asyncio.Event()
        self.arrived.clear()
        return self.gate

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append(Seen(request.method, request.path_qs, dict(request.headers), body))
        self.arrived.set()
        if self.gate is not None:
            await self.gate.wait()
        status = self.statuses.pop(0) if self.statuses else 200
        if status == "drop":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(3)
        headers = {"Request-Id": f"req_{len(self.seen)}", "X-Internal": "not replayed"}
        if status in (301, 302, 307, 308):
            headers["Location"] = f"{self.url}/elsewhere"
        n = len(self.seen)
        return web.json_response(
            self.reply(n, self.seen[-1]) if self.reply else {"n": n, "path": request.path_qs},
            status=int(status) if status != "drop" else 200,
            headers=headers,
        )


def chat_completion(n: int, seen: Seen) -> dict[str, Any]:
    """An OpenAI-style chat completion answering the request's last message, numbered ``n``."""
    asked = json.loads(seen.body)
    return {
        "id": f"chatcmpl-{n}",
        "object": "chat.completion",
        "created": 1_700_000_000 + n,
        "model": asked["model"],
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {
                    "role": "assistant",
                    "content": f"re: {asked['messages'][-1]['content']}",
                },
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def auth() -> dict[str, Any]:
    return {
        "keys": [
            {"role": "worker", "sha256": key_digest(KEYS["acme"]), "tenant": "acme"},
            {"role": "worker", "sha256": key_digest(KEYS["globex"]), "tenant": "globex"},
            {"role": "scheduler", "sha256": key_digest(KEYS["sched"]), "tenant": "acme"},
            {"role": "scheduler", "sha256": key_digest(KEYS["sched-globex"]), "tenant": "globex"},
            {"role": "auditor", "sha256": key_digest(KEYS["audit"]), "tenant": "acme"},
        ]
    }


def upstreams(base: str, **pay: Any) -> dict[str, Any]:
    return {
        "pay": {
            "base_url": base + "/api",
            "tenants": ["acme"],
            "routes": [
                "POST /v1/charges",
                "POST /v1/charges/*/capture",
                "PUT /v1/items/*",
                "GET /v1/charges/*",
            ],
            "credentials_env": {"acme": "PAY_ACME"},
            "allow_private": True,
            **pay,
        },
        "shared": {
            "base_url": base,
            "routes": ["POST /hook"],
            "credentials_env": {"acme": "PAY_ACME", "globex": "PAY_GLOBEX"},
            "allow_private": True,
        },
    }


async def register(g: Gateway, job: str, scheduler: str = "sched") -> int:
    resp = await g.client.post(
        f"/v1/jobs/{job}/generations",
        json={},
        headers={"Authorization": f"Bearer {KEYS[scheduler]}"},
    )
    assert resp.status in (200, 201), await resp.text()
    return int((await resp.json())["generation"])


def fenced(job: str, step: str, token: int, tenant: str = "acme", **extra: str) -> dict[str, str]:
    return {
        "Authorization": f"Bearer {KEYS[tenant]}",
        "Fencing-Token": str(token),
        "Fencegate-Job": job,
        "Fencegate-Step": step,
        **extra,
    }
