"""Runs in separate processes: fires concurrent effect calls at a gateway URL."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp


async def _fire(url: str, n: int, token: str, payload: dict[str, Any]) -> list[tuple[int, str]]:
    async with aiohttp.ClientSession() as s:

        async def one() -> tuple[int, str]:
            async with s.post(
                url,
                json={"adapter": "hook", "operation": "send", "payload": payload},
                headers={"Fencing-Token": token},
            ) as r:
                body = await r.json(content_type=None)
                return r.status, body.get("code") or (
                    "replayed" if body.get("replayed") else "sent"
                )

        return await asyncio.gather(*(one() for _ in range(n)))


def fire(url: str, n: int, token: str, payload: dict[str, Any]) -> list[tuple[int, str]]:
    return asyncio.run(_fire(url, n, token, payload))
