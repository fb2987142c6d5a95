"""The audit log is hash-chained per job; `fencegate audit verify` finds tampering."""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
from typing import Any

from tests.conftest import Gateway

STREAM = "fg:{default/r}:audit"


async def verify(redis_url: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        # no anchors: the default anchor file (./.fencegate/) is the developer's, not this Redis's
        sys.executable, "-m", "gateway", "audit", "verify", "--redis-url", redis_url,
        "--anchors", os.devnull,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def rejections(gw: Gateway, n: int) -> None:
    await gw.register("r", generation=5)
    await gw.register("q", generation=5)
    for i in range(n):
        await gw.effect("r", f"s{i}", 1)
    await gw.effect("q", "s", 9)


async def test_chain_is_intact_and_linked(gw: Gateway, redis_sync: Any, redis_url: str) -> None:
    await rejections(gw, 4)
    entries = redis_sync.xrange(STREAM)
    assert len(entries) == 5  # the registration of generation 5, then the four rejections
    assert entries[0][1]["event"] == "registered" and entries[0][1]["generation"] == "5"
    assert entries[0][1]["prev"] == ""
    for (_, before), (_, after) in itertools.pairwise(entries):
        assert after["prev"] == before["hash"]
    assert redis_sync.hget("fg:{default/r}:job", "audit_head") == entries[-1][1]["hash"]
    code, out = await verify(redis_url)
    assert code == 0 and "2 jobs, 7 entries, intact" in out  # q: its registration, one rejection


async def test_deleted_middle_entry_is_detected(
    gw: Gateway, redis_sync: Any, redis_url: str
) -> None:
    await rejections(gw, 4)
    redis_sync.xdel(STREAM, redis_sync.xrange(STREAM)[1][0])
    code, out = await verify(redis_url)
    assert code == 1 and "previous entry missing or altered" in out


async def test_deleted_newest_entry_is_detected(
    gw: Gateway, redis_sync: Any, redis_url: str
) -> None:
    await rejections(gw, 3)
    redis_sync.xdel(STREAM, redis_sync.xrange(STREAM)[-1][0])
    code, out = await verify(redis_url)
    assert code == 1 and "newest entries missing" in out


async def test_forged_entry_is_detected(gw: Gateway, redis_sync: Any, redis_url: str) -> None:
    await rejections(gw, 2)
    last = redis_sync.xrange(STREAM)[-1][1]
    forged = {**last, "presented": "4", "prev": last["hash"], "hash": last["hash"]}
    redis_sync.xadd(STREAM, forged)
    code, out = await verify(redis_url)
    assert code == 1 and "entry altered" in out
