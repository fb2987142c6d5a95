"""``Expect: 100-continue`` and protocol upgrades at the proxy, over raw sockets: fencegate
answers ``100 Continue`` itself, only once the request's head passed its checks (a refused
head is answered before its body is sent), never forwards ``Expect``; an expectation other
than 100-continue is a problem+json 417; an upgrade is refused. The API's own routes answer
``100 Continue`` at once and a foreign expectation with the same 417."""

from __future__ import annotations

import asyncio
import json

from tests.conftest import Gateway
from tests.support.proxying import KEYS, Receiver, fenced, register

BODY = b'{"amount": 5}'


async def _open(g: Gateway) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(g.client.server.host, g.client.server.port)


def _head(g: Gateway, path: str, headers: dict[str, str]) -> bytes:
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    host = f"{g.client.server.host}:{g.client.server.port}"
    return f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{lines}\r\n".encode()


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    status_line = await asyncio.wait_for(reader.readline(), 10)
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    if status == 100:
        return status, headers, b""
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


async def test_a_fenced_call_gets_100_continue_then_its_answer_and_expect_is_not_forwarded(
    gw: Gateway, receiver: Receiver
) -> None:
    gen = await register(gw, "r")
    reader, writer = await _open(gw)
    h = fenced("r", "charge", gen, **{"Content-Type": "application/json"})
    h |= {"Content-Length": str(len(BODY)), "Expect": "100-continue"}
    writer.write(_head(gw, "/proxy/pay/v1/charges", h))
    await writer.drain()
    status, _, _ = await _answer(reader)
    assert status == 100 and receiver.seen == []  # the head passed; the body not yet sent
    writer.write(BODY)
    await writer.drain()
    status, headers, _ = await _answer(reader)
    assert status == 200 and headers["fencegate-outcome"] == "forwarded"
    [seen] = receiver.seen
    assert seen.body == BODY and "Expect" not in seen.headers
    writer.close()


async def test_a_head_refused_is_answered_before_its_body_is_sent(
    gw: Gateway, receiver: Receiver
) -> None:
    gen = await register(gw, "r")
    for headers, code in [
        ({**fenced("r", "c", gen), "Authorization": "Bearer not-a-key"}, "unauthorized"),
        ({**fenced("r", "c", gen), "Fencegate-Job": "bad job!"}, "invalid_request"),
    ]:
        reader, writer = await _open(gw)
        h = headers | {"Content-Length": str(len(BODY)), "Expect": "100-continue"}
        writer.write(_head(gw, "/proxy/pay/v1/charges", h))
        await writer.drain()
        status, _, body = await _answer(reader)  # no 100 first: the refusal, body never sent
        assert status in (400, 401) and json.loads(body)["code"] == code
        writer.close()
    assert receiver.seen == []


async def test_another_expectation_is_417_and_an_upgrade_is_refused(
    gw: Gateway, receiver: Receiver
) -> None:
    gen = await register(gw, "r")
    cases = [
        ({"Expect": "202-accepted"}, 417, "expectation_failed"),
        ({"Connection": "Upgrade", "Upgrade": "websocket"}, 400, "invalid_request"),
    ]
    for extra, status, code in cases:
        reader, writer = await _open(gw)
        h = fenced("r", "c", gen) | {"Content-Length": str(len(BODY))} | extra
        writer.write(_head(gw, "/proxy/pay/v1/charges", h) + BODY)
        await writer.drain()
        got, headers, body = await _answer(reader)
        assert (got, headers["content-type"].split(";")[0]) == (status, "application/problem+json")
        assert json.loads(body)["code"] == code
        writer.close()
    assert receiver.seen == []


async def test_the_apis_routes_continue_at_once_and_refuse_another_expectation(
    gw: Gateway,
) -> None:
    body = b"{}"
    for expect, status in [("100-continue", 201), ("xyz", 417)]:
        reader, writer = await _open(gw)
        h = {"Authorization": f"Bearer {KEYS['sched']}", "Content-Type": "application/json"}
        h |= {"Content-Length": str(len(body)), "Expect": expect}
        writer.write(_head(gw, "/v1/jobs/e/generations", h))
        await writer.drain()
        got, headers, answer = await _answer(reader)
        if expect == "100-continue":
            assert got == 100
            writer.write(body)
            await writer.drain()
            got, headers, answer = await _answer(reader)
        assert got == status, answer
        if status == 417:
            assert headers["content-type"].startswith("application/problem+json")
            assert json.loads(answer)["code"] == "expectation_failed"
        writer.close()
