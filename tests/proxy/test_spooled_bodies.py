"""Proxied request bodies longer than ``proxy.buffer_bytes``: spooled to a file as they are
read, hashed while read, fenced after the last byte, streamed to the upstream from the file,
and the file removed on every path — answered, refused, the client gone mid-body, the
upstream failed. The bytes spooled at once are capped per tenant: one tenant at its cap is
refused (503, ``Retry-After``) while another's body is spooled and sent."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gateway.http.proxied import PROXY
from gateway.proxy.spool import SpoolArea
from gateway.runtime.settings import ConfigError, load_settings
from tests.conftest import Gateway
from tests.support.proxying import Receiver, auth, fenced, register, upstreams

BUFFER = 4096
SPOOL = 256 * 1024


@pytest.fixture
async def sg(make_gateway: Any, receiver: Receiver, secrets: None, tmp_path: Path) -> Gateway:
    g: Gateway = await make_gateway(
        auth=auth(),
        upstreams=upstreams(receiver.url),
        proxy={
            "buffer_bytes": BUFFER,
            "spool_bytes": SPOOL,
            "spool_dir": str(tmp_path / "spool"),
            "spool_bytes_per_tenant": 300_000,
            "spool_bytes_total": 900_000,
        },
    )
    return g


def files(g: Gateway) -> list[Path]:
    """The spool files of every process's area (each area also holds its ``.lock``)."""
    d = Path(g.settings.proxy.spool_dir)
    return sorted(d.rglob("body-*")) if d.exists() else []


def spooled(g: Gateway) -> int:
    return int(g.app[PROXY].spooling.ledger.all)


async def until(predicate: Any) -> None:
    """Wait until ``predicate()`` holds (a bound against a hang, not a timed assertion)."""
    async with asyncio.timeout(20):
        while not predicate():  # noqa: ASYNC110 - the gateway's own count, its files
            await asyncio.sleep(0.01)


async def test_a_long_body_is_spooled_sent_from_the_file_pinned_and_removed(
    sg: Gateway, receiver: Receiver
) -> None:
    gen = await register(sg, "r")
    body = os.urandom(200_000)
    h = fenced("r", "charge", gen, **{"Content-Type": "application/octet-stream"})
    resp = await sg.client.post("/proxy/pay/v1/charges", data=body, headers=h)
    assert resp.status == 200, await resp.text()
    [seen] = receiver.seen
    assert seen.body == body and seen.headers["Content-Length"] == str(len(body))
    assert files(sg) == [] and spooled(sg) == 0
    # the same bytes again: the step's replay; other bytes: another request, nothing sent
    again = await sg.client.post("/proxy/pay/v1/charges", data=body, headers=h)
    assert again.headers["Fencegate-Outcome"] == "replayed"
    other = await sg.client.post("/proxy/pay/v1/charges", data=body[:-1] + b"!", headers=h)
    assert other.status == 422 and (await other.json())["code"] == "intent_mismatch"
    assert len(receiver.seen) == 1 and files(sg) == [] and spooled(sg) == 0


async def test_a_gzip_body_is_spooled_decoded_and_bounded_after_decoding(
    sg: Gateway, receiver: Receiver
) -> None:
    gen = await register(sg, "r")
    body = b'{"rows": "' + b"x" * 250_000 + b'"}'
    h = fenced("r", "bulk", gen, **{"Content-Type": "application/json", "Content-Encoding": "gzip"})
    resp = await sg.client.post("/proxy/pay/v1/charges", data=gzip.compress(body), headers=h)
    assert resp.status == 200, await resp.text()
    assert receiver.seen[0].body == body and "Content-Encoding" not in receiver.seen[0].headers
    # inflating past spool_bytes: 413, and the file that held what was inflated is gone
    bomb = gzip.compress(b"\0" * (4 * SPOOL))
    h2 = {**h, "Fencegate-Step": "bomb"}
    resp = await sg.client.post("/proxy/pay/v1/charges", data=bomb, headers=h2)
    assert resp.status == 413
    cut = gzip.compress(os.urandom(50_000))[:-9]
    resp = await sg.client.post(
        "/proxy/pay/v1/charges", data=cut, headers={**h, "Fencegate-Step": "cut"}
    )
    assert resp.status == 400
    assert len(receiver.seen) == 1 and files(sg) == [] and spooled(sg) == 0


async def test_a_body_over_spool_bytes_is_413_and_leaves_no_file(
    sg: Gateway, receiver: Receiver
) -> None:
    gen = await register(sg, "r")
    h = fenced("r", "big", gen)

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: cut while read
        for _ in range(SPOOL // 65_536 + 2):
            yield b"y" * 65_536

    resp = await sg.client.post("/proxy/pay/v1/charges", data=chunked(), headers=h)
    assert resp.status == 413
    declared = await sg.client.post("/proxy/pay/v1/charges", data=b"z" * (SPOOL + 1), headers=h)
    assert declared.status == 413
    assert receiver.seen == [] and files(sg) == [] and spooled(sg) == 0


async def test_a_tenant_at_its_spool_cap_is_refused_and_another_tenant_is_not(
    sg: Gateway, receiver: Receiver
) -> None:
    acme = await register(sg, "a")
    globex = await register(sg, "g", scheduler="sched-globex")
    go = asyncio.Event()

    async def slow() -> AsyncIterator[bytes]:  # 250 kB now, the rest once told
        yield b"a" * 250_000
        await go.wait()
        yield b"b" * 10_000

    held = asyncio.create_task(
        sg.client.post("/proxy/shared/hook", data=slow(), headers=fenced("a", "one", acme))
    )
    await until(lambda: spooled(sg) >= 250_000)  # acme holds 250 kB of its 300 kB
    refused = await sg.client.post(
        "/proxy/shared/hook", data=b"c" * 100_000, headers=fenced("a", "two", acme)
    )
    assert refused.status == 503
    assert refused.headers["Retry-After"] == "1"
    assert refused.headers["X-Should-Retry"] == "true"
    assert (await refused.json())["code"] == "too_many_held"
    other = await sg.client.post(
        "/proxy/shared/hook", data=b"d" * 100_000, headers=fenced("g", "one", globex, "globex")
    )
    assert other.status == 200, await other.text()
    go.set()
    first = await held
    assert first.status == 200, await first.text()
    assert sorted(len(s.body) for s in receiver.seen) == [100_000, 260_000]
    assert files(sg) == [] and spooled(sg) == 0
    # acme's room is back: the refused request now goes through
    again = await sg.client.post(
        "/proxy/shared/hook", data=b"c" * 100_000, headers=fenced("a", "two", acme)
    )
    assert again.status == 200


async def test_a_client_gone_mid_body_leaves_no_file_and_sends_nothing(
    sg: Gateway, receiver: Receiver
) -> None:
    gen = await register(sg, "r")
    host, port = sg.client.server.host, sg.client.server.port
    _, writer = await asyncio.open_connection(host, port)
    head = "".join(f"{k}: {v}\r\n" for k, v in fenced("r", "charge", gen).items())
    writer.write(
        f"POST /proxy/pay/v1/charges HTTP/1.1\r\nHost: {host}:{port}\r\n{head}"
        f"Content-Length: 200000\r\n\r\n".encode()
        + b"p" * 100_000
    )
    await writer.drain()
    await until(lambda: spooled(sg) >= 100_000 and files(sg) != [])
    writer.close()  # 100 kB short of its Content-Length
    await until(lambda: files(sg) == [] and spooled(sg) == 0)
    assert receiver.seen == []
    # the step was never admitted: the whole request later is sent
    ok = await sg.client.post(
        "/proxy/pay/v1/charges", data=b"p" * 200_000, headers=fenced("r", "charge", gen)
    )
    assert ok.status == 200 and len(receiver.seen) == 1


async def test_an_upstream_failure_after_a_spooled_send_removes_the_file(
    sg: Gateway, receiver: Receiver
) -> None:
    gen = await register(sg, "r")
    receiver.statuses = ["drop", 500]
    body = os.urandom(100_000)
    for step in ("dropped", "errored"):
        resp = await sg.client.post(
            "/proxy/pay/v1/charges", data=body, headers=fenced("r", step, gen)
        )
        assert resp.status == 504, await resp.text()
        assert (await resp.json())["code"] == "outcome_unknown"
        assert files(sg) == [] and spooled(sg) == 0
    assert [hashlib.sha256(s.body).hexdigest() for s in receiver.seen] == [
        hashlib.sha256(body).hexdigest()
    ] * 2


def test_a_spool_limit_the_caps_could_never_hold_stops_the_start() -> None:
    for cap in ("spool_bytes_per_tenant", "spool_bytes_total"):
        with pytest.raises(ConfigError, match=cap):
            load_settings(None, proxy={"spool_bytes": 2 * 1024**2, cap: 1024**2})
    assert load_settings(None, proxy={"spool_bytes": 2 * 1024**2}).proxy.spool_bytes_total > 0


_HOLDER = """
import sys
from pathlib import Path
from gateway.proxy.spool import SpoolArea
area = SpoolArea(Path(sys.argv[1]))
(area.directory / "body-left").write_bytes(b"x" * 1000)
print(area.directory, flush=True)
sys.stdin.read()
"""


def test_a_process_reclaims_the_spool_areas_of_dead_processes_and_never_a_live_ones(
    tmp_path: Path,
) -> None:
    """Two real processes spool into the same directory; one is SIGKILLed with a file in its
    area. A third process's area, claimed beside them, removes the dead one's and keeps the
    live one's; the live one's lock is still held (its process still owns it)."""
    root = tmp_path / "spool"
    holders = [
        subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(root)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        dead, live = (Path(h.stdout.readline().strip()) for h in holders)  # type: ignore[union-attr]
        holders[0].send_signal(signal.SIGKILL)
        holders[0].wait(10)
        assert (dead / "body-left").exists()  # nothing ran at its death
        area = SpoolArea(root)
        assert area.reclaimed == 1
        assert not dead.exists()
        assert (live / "body-left").exists()
        assert sorted(p.name for p in root.iterdir()) == sorted([area.directory.name, live.name])
        again = SpoolArea(root)  # the live one and this process's first area stay
        assert again.reclaimed == 0 and live.exists() and area.directory.exists()
        again.close()
        area.close()
        assert not area.directory.exists()
    finally:
        for h in holders:
            h.kill()
            h.communicate(timeout=10)  # closes its pipes


def _multipart(boundary: str, content: bytes) -> bytes:
    file_head = (
        f"--{boundary}\r\n"
        'Content-Disposition: form-data; name="file"; filename="statement.pdf"\r\n'
        "Content-Type: application/pdf\r\n\r\n"
    )
    purpose = (
        f"\r\n--{boundary}\r\n"
        'Content-Disposition: form-data; name="purpose"\r\n\r\n'
        f"dispute_evidence\r\n--{boundary}--\r\n"
    )
    return file_head.encode() + content + purpose.encode()


async def test_a_spooled_multipart_retry_with_a_new_boundary_is_the_same_request(
    sg: Gateway, receiver: Receiver
) -> None:
    """A new attempt re-runs the step with the same file: its SDK picks a new random boundary.
    Spooled, the body is still digested by its parts — a replay, not intent_mismatch; a
    changed file under the same step is a mismatch."""
    gen = await register(sg, "r")
    content = os.urandom(150_000)

    def post(boundary: str, data: bytes) -> Any:
        h = fenced(
            "r", "upload", gen, **{"Content-Type": f"multipart/form-data; boundary={boundary}"}
        )
        return sg.client.post("/proxy/pay/v1/charges", data=_multipart(boundary, data), headers=h)

    first = await post("a" * 24, content)
    assert first.status == 200 and first.headers["Fencegate-Outcome"] == "forwarded"
    again = await post("Zq9" * 10, content)
    assert again.status == 200 and again.headers["Fencegate-Outcome"] == "replayed"
    other = await post("Zq9" * 10, content[:-1] + b"!")
    assert other.status == 422 and (await other.json())["code"] == "intent_mismatch"
    assert len(receiver.seen) == 1 and files(sg) == [] and spooled(sg) == 0
