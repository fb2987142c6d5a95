"""The connection limits of a real `fencegate serve`: a connection cap with a clear refusal,
idle and slow-header sockets that cannot block service, bodies that never arrive timed out,
the file-descriptor limit raised, and every log line JSON."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

from gateway.http.connections import ConnectionGuard
from gateway.runtime.settings import ConnectionSettings
from tests.support.processes import Serve, write_config

HYGIENE = """
[connections]
max = 40
idle_timeout_seconds = 1.5
body_timeout_seconds = 1.5
"""


def _start(tmp: Path, serves: list[Serve], extra: str = HYGIENE) -> Serve:
    s = Serve(tmp, write_config(tmp, extra))
    serves.append(s)
    s.wait_ready()
    return s


def _connect(s: Serve) -> socket.socket:
    return socket.create_connection(("127.0.0.1", s.port), timeout=5)


def _read_all(sock: socket.socket, timeout: float = 5) -> bytes:
    sock.settimeout(timeout)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except (TimeoutError, ConnectionResetError):
        pass
    return b"".join(chunks)


def _all_json(s: Serve) -> None:
    for line in s.output().splitlines():
        assert isinstance(json.loads(line), dict), line


def test_connection_cap_refuses_with_503_and_slow_bodies_time_out(
    tmp_path: Path, serves: list[Serve]
) -> None:
    s = _start(tmp_path, serves)
    slow = []
    for i in range(40):  # every connection busy: a request whose body never arrives
        c = _connect(s)
        c.sendall(
            f"POST /v1/jobs/j{i}/generations HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode()
        )
        slow.append(c)
    time.sleep(0.5)
    extra = _connect(s)
    extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    refusal = _read_all(extra)
    extra.close()
    assert refusal.startswith(b"HTTP/1.1 503"), refusal
    assert b"Retry-After: 1" in refusal and b"too_many_connections" in refusal
    # the bodies never arrive: 408 and closed, within the body deadline
    started = time.monotonic()
    for c in slow:
        answer = _read_all(c)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"request_timeout" in answer
        c.close()
    assert time.monotonic() - started < 5
    assert s.call("GET", "/healthz")[0] == 200
    _all_json(s)


def test_idle_sockets_cannot_block_service(tmp_path: Path, serves: list[Serve]) -> None:
    s = _start(tmp_path, serves)
    idle = [_connect(s) for _ in range(300)]  # 7x the cap, no bytes sent
    half = [_connect(s) for _ in range(20)]
    for c in half:  # slow headers: never complete
        c.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    time.sleep(0.3)
    for _ in range(20):  # real calls keep being served (oldest idle sockets make room)
        assert s.call("GET", "/healthz")[0] == 200
    assert s.call("POST", "/v1/jobs/r/generations", {"generation": 1})[0] == 201
    # every idle and slow-header socket is closed by the idle deadline (or evicted)
    time.sleep(2.5)
    still_open = 0
    for c in idle + half:
        c.settimeout(0.01)
        try:
            if c.recv(1) != b"":
                still_open += 1
        except ConnectionResetError:
            pass
        except TimeoutError:
            still_open += 1
        c.close()
    assert still_open == 0
    _all_json(s)


def _get_healthz(sock: socket.socket) -> bytes:
    """One keep-alive ``GET /healthz`` on ``sock``: the response's head and body, read whole."""
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    sock.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])  # type: ignore[index]
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head


def _evicted_total(s: Serve) -> int:
    totals = [0]
    for line in s.output().splitlines():
        event = json.loads(line)
        if event.get("event") == "connection_cap_reached":
            totals.append(int(event["evicted_idle_total"]))
    return max(totals)


def test_keep_alive_connections_that_answered_are_evicted_at_the_cap(
    tmp_path: Path, serves: list[Serve]
) -> None:
    digest = hashlib.sha256(b"globex-scheduler-key").hexdigest()
    s = _start(
        tmp_path,
        serves,
        "[connections]\nmax = 8\nidle_timeout_seconds = 30\n"
        f'[[auth.keys]]\nrole = "scheduler"\nsha256 = "{digest}"\ntenant = "globex"\n',
    )
    hog = [_connect(s) for _ in range(8)]  # no key: every socket makes keep-alive calls
    globex = {"Authorization": "Bearer globex-scheduler-key"}
    served = []
    for round_ in range(3):
        for i, c in enumerate(hog):  # the hog's periodic keep-alive; an evicted socket reopens
            head = b""
            with contextlib.suppress(OSError):
                head = _get_healthz(c)
            if not head.startswith(b"HTTP/1.1 200"):
                c.close()
                hog[i] = _connect(s)
                with contextlib.suppress(OSError):
                    _get_healthz(hog[i])
        time.sleep(0.2)
        job = f"/v1/jobs/j{round_}/generations"
        served.append(s.call("POST", job, {"generation": 1}, globex)[0])
    assert served == [201, 201, 201], served  # another tenant's calls are served
    assert _evicted_total(s) > 0
    for c in hog:
        c.close()
    _all_json(s)


def test_file_descriptor_soft_limit_is_raised_to_the_hard_limit(
    tmp_path: Path, serves: list[Serve]
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(1024, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        s = _start(tmp_path, serves, "")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    with open(f"/proc/{s.proc.pid}/limits") as f:
        line = next(x for x in f if x.startswith("Max open files"))
    assert line.split()[3:5] == [str(hard), str(hard)], line


_FLOOD = """
import logging, time
from gateway.http.connections import bridge_stdlib_logging
from gateway.runtime.logging import configure_logging
configure_logging(json=True)
bridge_stdlib_logging(per_second=5)
for _ in range(1000):
    try:
        raise ConnectionResetError("peer went away")
    except ConnectionResetError:
        logging.getLogger("aiohttp.server").exception("Error handling request")
time.sleep(1.1)
logging.getLogger("asyncio").error("socket.accept() out of system resource")
"""


def test_server_log_flood_stays_json_and_rate_limited() -> None:
    """aiohttp's and asyncio's loggers (tracebacks included) become rate-limited JSON lines
    (in a process of its own: logging is configured once per process)."""
    out = subprocess.run([sys.executable, "-c", _FLOOD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stderr.splitlines()
    events = [json.loads(line) for line in lines]  # every line is JSON: no raw traceback
    assert 2 <= len(events) <= 20, lines
    assert events[0]["logger"] == "aiohttp.server"
    assert events[0]["exception"] == "ConnectionResetError: peer went away"
    assert events[-1]["logger"] == "asyncio" and events[-1]["suppressed"] > 0
    assert len(events) + sum(e.get("suppressed", 0) for e in events) == 1001  # all counted


class _Unanswered(asyncio.Protocol):
    """An inner protocol whose handler has not run yet: it takes bytes and answers nothing."""

    def __init__(self, got: asyncio.Event) -> None:
        self.got = got

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        self.got.set()


async def test_a_connection_whose_head_arrived_is_not_evicted_before_its_handler_runs() -> None:
    """At the cap, a connection that sent a complete request head serves from then on, even
    before the request reaches the middleware; the one still sending a head is evicted."""
    loop = asyncio.get_running_loop()
    got = asyncio.Event()
    guard = ConnectionGuard(lambda: _Unanswered(got), ConnectionSettings(), cap=2)
    server = await loop.create_server(guard.factory, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        whole_r, whole_w = await asyncio.open_connection("127.0.0.1", port)
        whole_w.write(b"POST /v1/jobs/j/effects/s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await whole_w.drain()
        await asyncio.wait_for(got.wait(), 5)
        part_r, part_w = await asyncio.open_connection("127.0.0.1", port)
        got.clear()
        part_w.write(b"GET /healthz HTTP/1.1\r\nHost: ")
        await part_w.drain()
        await asyncio.wait_for(got.wait(), 5)
        _, new_w = await asyncio.open_connection("127.0.0.1", port)  # at the cap

        async def closed(reader: asyncio.StreamReader, wait: float) -> bool:
            try:
                return await asyncio.wait_for(reader.read(), wait) == b""
            except ConnectionError:
                return True
            except TimeoutError:
                return False

        assert await closed(part_r, 5)  # evicted: it had not completed its head
        assert not await closed(whole_r, 0.5)  # still open, awaiting its answer
        assert len(guard.open) == 2 and guard.evicted == 1
        for w in (whole_w, part_w, new_w):
            w.close()
    finally:
        server.close()
        await server.wait_closed()


class _ArrivalAtFinish(ConnectionGuard):
    """A guard where a new connection arrives at the cap the instant the first response is
    written (what a busy gateway sees sooner or later): the eviction it makes, if any."""

    arrived = False

    def finished(self, transport: object) -> None:
        super().finished(transport)
        if not self.arrived and len(self.open) >= self.cap:
            self.arrived = True
            self._evict()


async def test_a_request_pipelined_behind_an_answered_one_is_never_evicted_unanswered() -> None:
    """At the cap, a connection that sent its head is never evicted unanswered: two requests
    pipelined on one connection, the first answered while a new connection arrives at the
    cap; the second is answered, its connection not evicted."""
    from aiohttp import web

    from gateway.http.connections import GUARD, GuardSlot, serving

    release, hold = asyncio.Event(), asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="slow")

    async def held(request: web.Request) -> web.Response:
        await hold.wait()
        return web.Response(text="held")

    async def fast(request: web.Request) -> web.Response:
        return web.Response(text="fast")

    app = web.Application(middlewares=[serving])
    app.router.add_get("/slow", slow)
    app.router.add_get("/fast", fast)
    app.router.add_get("/held", held)
    slot = app[GUARD] = GuardSlot()
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    assert runner.server is not None
    guard = slot.guard = _ArrivalAtFinish(runner.server, ConnectionSettings(), cap=2)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(guard.factory, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:  # hold is set on every way out: aiohttp's cleanup waits for its handler
        # the other connection serves all along: the only one an arrival could evict is piped
        _, held_w = await asyncio.open_connection("127.0.0.1", port)
        held_w.write(b"GET /held HTTP/1.1\r\nHost: x\r\n\r\n")
        piped_r, piped_w = await asyncio.open_connection("127.0.0.1", port)
        piped_w.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /fast HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.gather(held_w.drain(), piped_w.drain())
        async with asyncio.timeout(5):
            while len(guard.open) < 2 or guard.idle or guard.partial:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        release.set()
        async with asyncio.timeout(5):
            answers = b""
            while answers.count(b"HTTP/1.1 200") < 2:
                chunk = await piped_r.read(65536)
                if not chunk:
                    break
                answers += chunk
        assert b"slow" in answers and answers.endswith(b"fast"), answers
        assert guard.arrived and guard.evicted == 0
        for w in (held_w, piped_w):
            w.close()
    finally:
        hold.set()
        server.close()
        await server.wait_closed()
        await runner.cleanup()
