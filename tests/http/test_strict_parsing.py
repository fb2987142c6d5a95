"""Strict parsing everywhere: each rule as a named test.

Ids and header-bound values are matched whole (no trailing newline), control
characters and line separators never reach a header, numbers and cursors out
of range are 400s, undecodable header bytes are refused before anything else,
signed tokens have one spelling, problems name no internal host, adapter
header secrets come from the environment, console logs escape what clients send.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import make_mocked_request
from structlog.testing import capture_logs

from gateway.cli.main import _tenant
from gateway.cli.serve import _configured_secrets
from gateway.core.errors import InvalidRequest
from gateway.http.parsing import worker_id_of
from gateway.runtime.settings import ConfigError, load_settings
from gateway.store.embedded import free_port
from tests.adapters.test_smtp import MAIL
from tests.conftest import Gateway, Upstream, key_digest
from tests.support.calls import EFFECT, assert_untouched, snapshot
from tests.support.peers import Sink

KEY = "strict-suite-admin-key-0123456789abcdef"


# -- ids are matched whole: no trailing newline -----------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "headers"),
    [
        ("POST", "/v1/jobs/r%0A/effects/s", {}),
        ("POST", "/v1/jobs/r/effects/s%0A", {}),
        ("POST", "/v1/jobs/r/effects/s%0A", {"Prefer": "respond-async"}),  # was a dropped 202
        ("POST", "/v1/jobs/r%0A/generations", {}),
        ("POST", "/v1/jobs/r%0A/fence", {}),
        ("GET", "/v1/jobs/r%0A", {}),
        ("GET", "/v1/jobs/r/effects/done%0A", {}),
        ("GET", "/v1/audit/rejections?job=r%0A", {}),
    ],
)
async def test_ids_with_a_trailing_newline_are_refused(
    primed: Gateway, upstream: Upstream, redis_sync: Any, method: str, path: str, headers: Any
) -> None:
    body = {"generation": 5} if path.endswith("/generations") else EFFECT
    call = primed.client.request(
        method,
        path,
        json=body if method == "POST" else None,
        headers={"Fencing-Token": "1", **headers},
    )
    await assert_untouched(primed, upstream, redis_sync, call, 400, "invalid_request")


async def test_webhook_operation_with_a_trailing_newline_is_refused(
    primed: Gateway, upstream: Upstream, redis_sync: Any
) -> None:
    """The operation becomes X-Fencegate-Operation: it was recorded unknown, nothing sent."""
    call = primed.effect("r", "s", 1, operation="send\n")
    await assert_untouched(primed, upstream, redis_sync, call, 400, "invalid_request")


def test_worker_id_tenant_and_adapter_names_with_a_trailing_newline_are_refused() -> None:
    with pytest.raises(InvalidRequest):
        worker_id_of(make_mocked_request("POST", "/", headers={"Worker-Id": "worker-a\n"}))
    key = {"role": "worker", "sha256": "0" * 64, "tenant": "acme\n"}
    with pytest.raises(ConfigError, match="tenant"):
        load_settings(None, auth={"keys": [key]})
    with pytest.raises(ConfigError, match="adapter name"):
        load_settings(None, adapters={"hook\n": {"type": "webhook", "url": "http://x"}})
    with pytest.raises(argparse.ArgumentTypeError):
        _tenant("acme\n")


# -- non-UTF-8 headers are 400/401 before anything else, never a 500 -----------------------


async def raw_request(port: int, head: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(65536), 10)
    writer.close()
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
    return status, data


@pytest.mark.parametrize(
    "header",
    [
        b"Authorization: Bearer \xff\xfe-not-utf8",
        b"Authorization: Bearer caf\xe9",  # latin-1, not UTF-8
        b"X-Request-Id: \xff\xfe",
        b"Worker-Id: w\xff",
        b"Origin: http://\xff",
        b"Fencing-Token: \xc3",
    ],
)
async def test_non_utf8_header_bytes_are_refused_not_500(
    make_gateway: Any, redis_sync: Any, header: bytes
) -> None:
    gw: Gateway = await make_gateway(auth={"keys": [{"role": "admin", "sha256": key_digest(KEY)}]})
    auth = (
        b"" if header.startswith(b"Authorization") else f"Authorization: Bearer {KEY}\r\n".encode()
    )
    before = snapshot(redis_sync)
    status, data = await raw_request(
        gw.client.port,
        b"POST /v1/jobs/r/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        + auth
        + header
        + b"\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
    )
    assert status in (400, 401), data
    assert b"application/problem+json" in data
    assert snapshot(redis_sync) == before


# -- a bad audit cursor, numbers out of range ----------------------------------------------


@pytest.mark.parametrize(
    "query",
    [
        {"cursor": "99999999999999999999-0"},  # beyond a stream id's 64 bits: Redis said ERR
        {"cursor": "18446744073709551616-0"},
        {"cursor": "1-18446744073709551616"},
        {"cursor": "0-0"},  # nothing is before it: Redis refuses the exclusive range
        {"cursor": "1-1\n"},
        {"limit": " 5"},
        {"limit": "+5"},
        {"limit": "\u0665"},  # ARABIC-INDIC DIGIT FIVE: int() takes it
        {"limit": "1_0"},
        {"limit": "5\n"},
        {"limit": "99999999999999999999999"},
    ],
)
async def test_bad_audit_cursors_and_limits_are_400(
    primed: Gateway, upstream: Upstream, redis_sync: Any, query: dict[str, str]
) -> None:
    call = primed.client.get("/v1/audit/rejections", params=query)
    await assert_untouched(primed, upstream, redis_sync, call, 400, "invalid_request")


async def test_largest_audit_cursor_is_fine(primed: Gateway) -> None:
    top = f"{2**64 - 1}-{2**64 - 1}"
    resp = await primed.client.get("/v1/audit/rejections", params={"cursor": top, "limit": "10"})
    assert resp.status == 200, await resp.text()


# -- email header values with VT / FF / NEL / U+2028 refused ---------------------------------


@pytest.fixture
def smtp_sink() -> Any:
    from aiosmtpd.controller import Controller

    s = Sink(port=free_port())
    controller = Controller(s, hostname="127.0.0.1", port=s.port)
    controller.start()
    yield s
    controller.stop()


@pytest.fixture
async def mailer(make_gateway: Any, smtp_sink: Sink) -> Gateway:
    dead_port = free_port()
    gw: Gateway = await make_gateway(
        adapters={
            "email": {
                "type": "smtp",
                "host": "127.0.0.1",
                "port": smtp_sink.port,
                "sender": "jobs@example.com",
                "timeout_seconds": 2,
            },
            "deadmail": {
                "type": "smtp",
                "host": "127.0.0.1",
                "port": dead_port,
                "sender": "jobs@example.com",
            },
        }
    )
    gw.dead_port = dead_port  # type: ignore[attr-defined]
    await gw.register("r", generation=1)
    return gw


@pytest.mark.parametrize(
    "payload",
    [
        {"subject": "a\x0bb"},  # VT
        {"subject": "a\x0cb"},  # FF
        {"subject": "a\x85b"},  # NEL
        {"subject": "a\u2028b"},  # LINE SEPARATOR
        {"subject": "a\u2029b"},  # PARAGRAPH SEPARATOR
        {"subject": "a\x1cb"},  # FS: str.splitlines() breaks here too
        {"subject": "a\x00b"},
        {"subject": "a\x7fb"},
        {"subject": "=?utf-8?q?a=0Bb?="},  # RFC 2047-encoded VT
        {"subject": "a%0Bb"},
        {"to": ["a\x85@example.com"]},
        {"reply_to": "help\u2028@example.com"},
    ],
)
async def test_email_header_values_with_control_characters_are_400_and_nothing_sent(
    mailer: Gateway, smtp_sink: Sink, redis_sync: Any, payload: dict[str, Any]
) -> None:
    """They gave 504 outcome_unknown though nothing was sent."""
    before = snapshot(redis_sync)
    resp = await mailer.effect(
        "r", "notify", 1, adapter="email", operation="send", payload={**MAIL, **payload}
    )
    body = await resp.json(content_type=None)
    assert (resp.status, body["code"]) == (400, "invalid_request"), body
    assert smtp_sink.messages == []
    assert snapshot(redis_sync) == before
    record = await mailer.client.get("/v1/jobs/r/effects/notify")
    assert record.status == 404


# -- SMTP connection errors never tell workers the internal host and port --------------------


async def test_smtp_connection_error_names_no_host_or_port(mailer: Gateway) -> None:
    port = str(mailer.dead_port)  # type: ignore[attr-defined]
    with capture_logs() as logs:
        resp = await mailer.effect(
            "r", "mail", 1, adapter="deadmail", operation="send", payload=MAIL
        )
    text = await resp.text()
    assert resp.status == 502 and "adapter_unavailable" in text, text
    assert "deadmail" in text
    assert "127.0.0.1" not in text and port not in text, text
    record = await (await mailer.client.get("/v1/jobs/r/effects/mail")).text()
    assert "127.0.0.1" not in record and port not in record, record
    # the operator still learns where it failed: the gateway's log has it
    assert any(port in str(e.get("error", "")) for e in logs), logs


# -- a signed token has one spelling: no leading zeros in its expiry --------------------------


@pytest.fixture
async def signed(make_gateway: Any, monkeypatch: pytest.MonkeyPatch) -> Gateway:
    monkeypatch.setenv("STRICT_SIGNING_KEY", "s" * 40)
    gw: Gateway = await make_gateway(auth={"token_signing_key_env": "STRICT_SIGNING_KEY"})
    return gw


async def test_signed_tokens_have_one_spelling(
    signed: Gateway, upstream: Upstream, redis_sync: Any
) -> None:
    resp = await signed.client.post("/v1/jobs/r/generations", json={"generation": 3})
    token = (await resp.json())["token"]
    _, gen, exp, sig = token.split(".")
    last = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    sibling = last[last.index(sig[-1]) ^ 1]  # same 32 bytes, spare bits set
    variants = [
        f"v1.{gen}.0{exp}.{sig}",  # verified before: int("0…") is the same expiry
        f"v1.{gen}.00{exp}.{sig}",
        f"v1.0{gen}.{exp}.{sig}",
        f"v1.+{gen}.{exp}.{sig}",
        f"v1.{gen}.+{exp}.{sig}",
        f"v1.{gen}.{exp}.{sig}=",
        f"v1.{gen}.{exp}.{sig[:-1]}{sibling}",
        f"v1.{gen}. {exp}.{sig}",
        f"V1.{gen}.{exp}.{sig}",
    ]
    for bad in variants:
        before = snapshot(redis_sync)
        resp = await signed.client.post(
            "/v1/jobs/r/effects/s", json=EFFECT, headers={"Fencing-Token": bad}
        )
        body = await resp.json(content_type=None)
        assert (resp.status, body["code"]) == (400, "bad_token"), (bad, body)
        assert upstream.received == []
        assert redis_sync.hgetall("fg:{default/r}:effects") == before.get(
            "fg:{default/r}:effects", {}
        )
    ok = await signed.client.post(
        "/v1/jobs/r/effects/s", json=EFFECT, headers={"Fencing-Token": token}
    )
    assert ok.status == 200


# -- webhook auth header secrets come from the environment --------------------------------------


async def test_webhook_header_secrets_come_from_env(
    make_gateway: Any, upstream: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOOK_AUTH", "Bearer hook-secret-9f8e7d")
    adapters = {
        "hook": {
            "type": "webhook",
            "url": upstream.url,
            "headers": {"X-Static": "plain"},
            "headers_env": {"Authorization": "HOOK_AUTH"},
        }
    }
    gw: Gateway = await make_gateway(adapters=adapters)
    await gw.register("r", generation=1)
    assert (await gw.effect("r", "s", 1)).status == 200
    [got] = upstream.received
    assert got.headers["Authorization"] == "Bearer hook-secret-9f8e7d"
    assert got.headers["X-Static"] == "plain"
    # the value is a secret like the others: it is blanked in the logs
    assert "Bearer hook-secret-9f8e7d" in _configured_secrets(gw.settings)


async def test_webhook_header_env_must_be_set_and_clean(
    make_gateway: Any, upstream: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    def hook(**extra: Any) -> dict[str, Any]:
        return {"hook": {"type": "webhook", "url": upstream.url, **extra}}

    monkeypatch.delenv("HOOK_AUTH_MISSING", raising=False)
    with pytest.raises(ConfigError, match="HOOK_AUTH_MISSING"):
        await make_gateway(adapters=hook(headers_env={"Authorization": "HOOK_AUTH_MISSING"}))
    # a value with a control character stops the adapter from being built (at start)
    from adapters.base import AdapterContext
    from adapters.registry import AdapterConfigError, build_adapters
    from gateway.runtime.settings import read_secret

    monkeypatch.setenv("HOOK_AUTH_DIRTY", "Bearer x\x85y")
    async with aiohttp.ClientSession() as http:
        with pytest.raises(AdapterConfigError, match="control character"):
            build_adapters(
                hook(headers_env={"Authorization": "HOOK_AUTH_DIRTY"}),
                AdapterContext(http=http, secret=read_secret),
            )


@pytest.mark.parametrize(
    "headers",
    [
        {"X-A": "a\x0bb"},
        {"X-A": "a\x85b"},
        {"X-A": "a\u2028b"},
        {"X-A": "a\x00"},
        {"X A": "b"},
        {"X-A\n": "b"},
    ],
)
def test_webhook_clear_headers_with_control_characters_are_config_errors(
    headers: dict[str, str],
) -> None:
    from adapters.registry import AdapterConfigError, validate_configs

    with pytest.raises(AdapterConfigError, match="headers"):
        validate_configs({"hook": {"type": "webhook", "url": "http://x", "headers": headers}})


# -- console-mode logs escape the terminal escapes of a URL path -------------------------------


def test_console_log_escapes_control_characters_from_the_path(tmp_path: Path) -> None:
    """`fencegate serve` with its stderr on a terminal (a pty): the console renderer."""
    port = free_port()
    cfg = tmp_path / "fencegate.toml"
    cfg.write_text(f'[redis]\ndata_dir = "{tmp_path / "data"}"\n')
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--config", str(cfg), "--port", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        cwd=tmp_path,
        env={**os.environ, "TERM": "xterm"},
    )
    os.close(slave)
    out = b""

    def read_for(seconds: float, until: bytes) -> None:
        nonlocal out
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and until not in out:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    out += os.read(master, 65536)
                except OSError:
                    return

    try:
        read_for(30, b"listening")
        evil = "/v1/jobs/%1B%5D0%3Bpwned%07x%1B%5B2J/effects/s"
        reader = subprocess.run(
            [sys.executable, "-c", _GET, str(port), evil], capture_output=True, timeout=30
        )
        assert reader.returncode == 0, reader.stderr
        read_for(10, b"pwned")
        read_for(1, b"\x00never")  # the rest of the line
    finally:
        proc.terminate()
        proc.wait(20)
        os.close(master)
    text = out.decode("utf-8", "replace")
    assert "pwned" in text, text
    assert "\x1b]0;pwned" not in text and "\x07" not in text and "\x1b[2J" not in text, text
    assert "\\x1b]0;pwned\\x07x\\x1b[2J" in text, text


_GET = """
import sys, time, urllib.request, urllib.error
for _ in range(200):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}{sys.argv[2]}", timeout=10)
    except urllib.error.HTTPError as e:
        assert e.code == 400, e.code
        break
    except (urllib.error.URLError, ConnectionError):
        time.sleep(0.1)
else:
    raise SystemExit("the gateway never answered")
"""
