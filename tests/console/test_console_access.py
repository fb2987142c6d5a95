"""The console's access design under attack: a secret computed from a key, a
cookie replayed without the proof of login, a cookie after logout, a flood of wrong keys,
the cookie's attributes under TLS."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import ssl
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from gateway.http.app import create_app
from tests.conftest import Gateway, gateway_settings, key_digest
from tests.console.conftest import ADMIN, AUDITOR, Console, keys_section
from tests.console.test_console_http import logged_in

WORKER_ENV, SECRET_ENV = "FG_TEST_CONSOLE_WORKER_KEY", "FG_TEST_CONSOLE_SECRET"
WORKER_KEY = "acme-worker-key-from-env"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _cookie(secret: bytes, key: str, tenant: str, role: str, name: str) -> str:
    """A cookie signed the way the console signs one, with ``secret``."""
    kid = _b64(
        hmac.new(secret, b"key" + hashlib.sha256(key.encode()).digest(), "sha256").digest()[:12]
    )
    body = {
        "t": tenant,
        "r": role,
        "n": name,
        "k": kid,
        "e": int(time.time()) + 3600,
        "s": "x" * 22,
    }
    payload = _b64(json.dumps(body, separators=(",", ":")).encode())
    return payload + "." + _b64(hmac.new(secret, payload.encode(), "sha256").digest())


async def test_a_cookie_signed_with_a_secret_computed_from_an_api_key_is_refused(
    make_gateway: Any, monkeypatch: Any
) -> None:
    """A worker whose key is the only key_env key once computed the console's secret from it
    and signed a cookie naming an admin of another tenant (its digest is in the config)."""
    monkeypatch.setenv(WORKER_ENV, WORKER_KEY)
    gw: Gateway = await make_gateway(
        auth={
            "keys": [
                {"role": "worker", "key_env": WORKER_ENV, "tenant": "acme"},
                {"role": "admin", "sha256": key_digest(ADMIN), "tenant": "globex", "name": "g"},
            ]
        }
    )
    derived = hmac.new(b"fencegate console v1", WORKER_KEY.encode(), "sha256").digest()
    forged = _cookie(derived, ADMIN, "globex", "admin", "g")
    base = str(gw.client.make_url("")).rstrip("/")
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            base + "/console/attention",
            headers={"Cookie": f"fg_console={forged}"},
            allow_redirects=False,
        ) as resp,
    ):
        assert resp.status == 303 and resp.headers["Location"].startswith("/console/login")
    secret_file = Path(gw.settings.redis.data_dir) / "console.secret"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600


_SECRET_OF = """
import sys
from gateway.console.access import console_secret
from gateway.runtime.settings import load_settings
settings = load_settings(None, redis={"data_dir": sys.argv[1]})
print(console_secret(settings, lambda env, what: "").hex())
"""


def test_the_console_secret_file_is_made_once_for_every_process(tmp_path: Path) -> None:
    data = tmp_path / "data"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SECRET_OF, str(data)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(6)
    ]
    secrets = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert len(secrets) == 1 and len(next(iter(secrets))) == 64
    path = data / "console.secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in data.iterdir()] == ["console.secret"]  # no temporary file left


async def test_a_replayed_cookie_cannot_change_anything_without_the_proof_of_login(
    console: Console,
) -> None:
    """A service on another port of this host receives the cookie and replays it with any
    headers: it reads pages (and their CSRF tokens), but a resolve needs the proof of login
    or the key itself."""
    await console.register("replay-1", 1)
    assert (await console.effect("replay-1", "s", 1, adapter="flaky")).status == 504
    owner, _ = await logged_in(console)
    [cookie] = [c for c in owner.cookie_jar if c.key == "fg_console"]
    await owner.close()
    url = console.base + "/console/jobs/replay-1/steps/s/resolve"
    async with aiohttp.ClientSession() as thief:
        headers = {"Cookie": f"fg_console={cookie.value}", "Origin": console.base}
        async with thief.get(console.base + "/console/attention", headers=headers) as resp:
            assert resp.status == 200
            csrf = re.search(r'name="csrf" value="([^"]+)"', await resp.text())
        assert csrf is not None
        form = {"outcome": "delivered", "confirm": "yes", "csrf": csrf[1]}
        async with thief.post(url, data=form, headers=headers) as resp:
            assert resp.status == 403 and "no proof of this login" in await resp.text()
        record = await console.gw.client.get(
            "/v1/jobs/replay-1/effects/s", headers=console.as_(AUDITOR)
        )
        assert (await record.json())["state"] == "unknown"
        # the operator's own key, typed again, is the proof (a browser without JavaScript)
        async with thief.post(url, data={**form, "key": AUDITOR}, headers=headers) as resp:
            assert resp.status == 200 and resp.url.path == "/console/attention"
    record = await console.gw.client.get(
        "/v1/jobs/replay-1/effects/s", headers=console.as_(AUDITOR)
    )
    assert (await record.json())["state"] == "succeeded"


async def test_logout_ends_the_cookie_and_its_csrf_token_on_every_process(
    make_gateway: Any, monkeypatch: Any, tmp_path: Path
) -> None:
    monkeypatch.setenv(SECRET_ENV, "s" * 40)
    common = {"auth": keys_section(), "console": {"secret_env": SECRET_ENV}}
    one: Gateway = await make_gateway(**common)
    other: Gateway = await make_gateway(**common, redis={"data_dir": str(tmp_path / "other")})
    bases = [str(g.client.make_url("")).rstrip("/") for g in (one, other)]
    proof: list[str] = []
    session, csrf = await logged_in(Console(one, bases[0], []), proof=proof)
    [cookie] = [c for c in session.cookie_jar if c.key == "fg_console"]
    async with session:
        async with session.get(bases[1] + "/console/", allow_redirects=False) as resp:
            assert resp.status == 200  # the other process accepts the login
        async with session.post(
            bases[0] + "/console/logout",
            data={"csrf": csrf},
            headers={"Origin": bases[0]},
            allow_redirects=False,
        ) as resp:
            assert resp.status == 303
    async with aiohttp.ClientSession() as replay:
        for base in bases:
            headers = {"Cookie": f"fg_console={cookie.value}", "Origin": base}
            async with replay.get(
                base + "/console/", headers=headers, allow_redirects=False
            ) as resp:
                assert resp.status == 303 and resp.headers["Location"].startswith("/console/login")
            async with replay.post(
                base + "/console/chain/verify",
                data={"csrf": csrf, "proof": proof[0]},
                headers=headers,
                allow_redirects=False,
            ) as resp:
                assert resp.status == 303 and resp.headers["Location"].startswith("/console/login")


async def _login(base: str, key: str, local: str = "127.0.0.1") -> aiohttp.ClientResponse:
    connector = aiohttp.TCPConnector(local_addr=(local, 0))
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.post(
            base + "/console/login",
            data={"key": key},
            headers={"Origin": base},
            allow_redirects=False,
        ) as resp,
    ):
        await resp.read()
        return resp


async def test_failed_logins_are_throttled_per_peer_across_processes(
    make_gateway: Any, tmp_path: Path
) -> None:
    one: Gateway = await make_gateway(auth=keys_section())  # the defaults: 10 per peer
    other: Gateway = await make_gateway(
        auth=keys_section(), redis={"data_dir": str(tmp_path / "other")}
    )
    a, b = (str(g.client.make_url("")).rstrip("/") for g in (one, other))
    with capture_logs() as logs:
        for i in range(10):  # one peer, two processes: the count is Redis's
            assert (await _login((a, b)[i % 2], "wrong")).status == 401
        for key in ("wrong", AUDITOR):  # throttled: even the right key waits
            resp = await _login(a, key)
            assert resp.status == 429 and 1 <= int(resp.headers["Retry-After"]) <= 60
        # another peer is not throttled by the first one's failures
        assert (await _login(b, AUDITOR, local="127.0.0.2")).status == 303
    refused = [e for e in logs if e["event"] == "console_login_refused"]
    # summarised: the first failure of the window and the one that reached the limit
    assert [(e["remote"], e["peer_failures"], e["throttled"]) for e in refused] == [
        ("127.0.0.1", 1, False),
        ("127.0.0.1", 10, True),
    ]


async def test_failed_logins_of_every_peer_together_are_throttled(make_gateway: Any) -> None:
    limits = {"login_failures_per_peer": 0, "login_failures_total": 3}
    gw: Gateway = await make_gateway(auth=keys_section(), console=limits)
    base = str(gw.client.make_url("")).rstrip("/")
    with capture_logs() as logs:
        for peer in ("127.0.0.1", "127.0.0.2", "127.0.0.3"):
            assert (await _login(base, "wrong", local=peer)).status == 401
        resp = await _login(base, AUDITOR, local="127.0.0.4")
        assert resp.status == 429 and 1 <= int(resp.headers["Retry-After"]) <= 60
    assert [e["all_failures"] for e in logs if e["event"] == "console_logins_throttled"] == [3]


def _self_signed(tmp_path: Path) -> ssl.SSLContext:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    return ctx


async def test_under_tls_the_cookie_is_host_only_secure_and_prefixed(
    redis_url: str, upstream: Any, tmp_path: Path
) -> None:
    settings = gateway_settings(redis_url, upstream.url, tmp_path, auth=keys_section())
    app = create_app(settings, redis_url=redis_url, state_file=tmp_path / "state" / "f.state")
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server(ssl=_self_signed(tmp_path))
    base = f"https://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=False)) as session:
            async with session.post(
                base + "/console/login",
                data={"key": AUDITOR},
                headers={"Origin": base},
                allow_redirects=False,
            ) as resp:
                assert resp.status == 303
                [set_cookie] = resp.headers.getall("Set-Cookie")
            name, _, rest = set_cookie.partition("=")
            attributes = {a.strip().split("=")[0].lower() for a in rest.split(";")[1:]}
            assert name == "__Host-fg_console"
            assert {"secure", "httponly", "path", "samesite"} <= attributes
            assert "domain" not in attributes and "Path=/;" in set_cookie + ";"
            value = rest.split(";")[0]
            async with session.get(
                base + "/console/",
                headers={"Cookie": f"__Host-fg_console={value}"},
                allow_redirects=False,
            ) as resp:
                assert resp.status == 200
            async with session.get(  # the unprefixed name is not read over TLS
                base + "/console/",
                headers={"Cookie": f"fg_console={value}"},
                allow_redirects=False,
            ) as resp:
                assert resp.status == 303
    finally:
        await server.close()


async def test_behind_a_tls_proxy_the_cookie_is_prefixed_and_secure(make_gateway: Any) -> None:
    gw: Gateway = await make_gateway(auth=keys_section(), console={"https": True})
    resp = await gw.client.post(
        "/console/login",
        data={"key": AUDITOR},
        headers={"Origin": str(gw.client.make_url("")).rstrip("/")},
        allow_redirects=False,
    )
    assert resp.status == 303
    [set_cookie] = resp.headers.getall("Set-Cookie")
    assert set_cookie.startswith("__Host-fg_console=") and "Secure" in set_cookie
    assert "Path=/;" in set_cookie + ";" and "Domain" not in set_cookie
