"""The reverse proxy (/proxy/<upstream>/<rest>) against a real receiver on loopback: routing,
credentials in custody, the fence, the pinned intent, outcomes and replay, refusals."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import tomllib
import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.cli.serve import _configured_secrets
from gateway.proxy.config import load_upstreams
from gateway.runtime.settings import ConfigError, read_secret
from tests.conftest import Gateway, key_digest
from tests.support.proxying import KEYS, SECRETS, Receiver, auth, fenced, register, upstreams


async def test_a_proxied_call_reaches_the_base_url_with_the_step_key_and_the_tenant_credential(
    gw: Gateway, receiver: Receiver
) -> None:
    gen = await register(gw, "r")
    headers = fenced(
        "r", "charge", gen, **{"Idempotency-Key": "sdk-random-1", "X-Secret-Header": "no",
                               "Content-Type": "application/x-www-form-urlencoded"}
    )  # fmt: skip
    resp = await gw.client.post(
        "/proxy/pay/v1/charges?expand=a&b=2", data="amount=5&currency=eur", headers=headers
    )
    assert resp.status == 200, await resp.text()
    assert resp.headers["Fencegate-Outcome"] == "forwarded"
    assert "Idempotent-Replayed" not in resp.headers
    assert resp.headers["Request-Id"] == "req_1"  # an allow-listed response header
    assert "X-Internal" not in resp.headers
    assert await resp.json() == {"n": 1, "path": "/api/v1/charges?expand=a&b=2"}
    [seen] = receiver.seen
    assert (seen.method, seen.path_qs, seen.body) == (
        "POST", "/api/v1/charges?expand=a&b=2", b"amount=5&currency=eur"
    )  # fmt: skip
    assert seen.headers["Idempotency-Key"] == "acme/r:charge"  # not the client's own
    assert seen.headers["Authorization"] == f"Bearer {SECRETS['PAY_ACME']}"  # not the worker's
    assert seen.headers["Content-Type"] == "application/x-www-form-urlencoded"
    for dropped in ("X-Secret-Header", "Fencing-Token", "Fencegate-Job", "Fencegate-Step"):
        assert dropped not in seen.headers
    assert KEYS["acme"] not in json.dumps(seen.headers)


async def test_the_same_call_again_is_replayed_as_the_upstream_answered_and_nothing_is_sent(
    gw: Gateway, receiver: Receiver
) -> None:
    gen = await register(gw, "r")
    h = fenced("r", "charge", gen, **{"Content-Type": "application/json"})
    first = await gw.client.post("/proxy/pay/v1/charges", data='{"a":1,"b":2}', headers=h)
    assert first.status == 200
    again = await gw.client.post(
        "/proxy/pay/v1/charges",
        data='{ "b": 2, "a": 1 }',  # the same JSON, other key order and whitespace
        headers={**h, "Idempotency-Key": "another-random-key"},
    )
    assert again.status == 200, await again.text()
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.headers["Fencegate-Outcome"] == "replayed"
    assert again.headers["Request-Id"] == "req_1"
    assert await again.json() == await first.json()
    assert len(receiver.seen) == 1


async def test_a_4xx_is_recorded_failed_and_replayed_with_its_status(
    gw: Gateway, receiver: Receiver
) -> None:
    gen = await register(gw, "r")
    receiver.statuses = [402]
    h = fenced("r", "charge", gen)
    first = await gw.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)
    assert first.status == 402
    assert first.headers["Fencegate-Outcome"] == "forwarded"
    again = await gw.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)
    assert again.status == 402
    assert again.headers["Fencegate-Outcome"] == "replayed"
    assert len(receiver.seen) == 1
    record = await gw.client.get(
        "/v1/jobs/r/effects/charge", headers={"Authorization": f"Bearer {KEYS['audit']}"}
    )
    body = await record.json()
    assert (body["state"], body["adapter"]) == ("failed", "proxy:pay")
    assert body["idempotency_key"] == "acme/r:charge"  # the key as the upstream saw it


async def test_unknown_and_foreign_upstreams_get_the_same_404(gw: Gateway) -> None:
    gen = await register(gw, "r")
    answers = []
    for name in ("pay", "nope"):
        resp = await gw.client.post(
            f"/proxy/{name}/v1/charges", data=b"", headers=fenced("r", "s", gen, "globex")
        )
        body = await resp.json()
        answers.append((resp.status, body["code"], body["detail"].replace(name, "<name>")))
    expected = (404, "not_found", "no upstream named '<name>' is configured")
    assert answers[0] == answers[1] == expected


async def test_missing_job_or_step_is_400_and_nothing_is_sent(
    gw: Gateway, receiver: Receiver
) -> None:
    gen = await register(gw, "r")
    for missing in ("Fencegate-Step", "Fencegate-Job"):
        h = fenced("r", "charge", gen)
        del h[missing]
        resp = await gw.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)
        assert resp.status == 400
        body = await resp.json()
        assert body["code"] == "invalid_request" and missing in body["detail"]
        assert resp.headers["Fencegate-Outcome"] == "refused"
        assert resp.headers["Stripe-Should-Retry"] == resp.headers["X-Should-Retry"] == "false"
    assert receiver.seen == []


async def test_routes_are_an_allow_list(gw: Gateway, receiver: Receiver) -> None:
    gen = await register(gw, "r")
    h = fenced("r", "s", gen)
    assert (await gw.client.post("/proxy/pay/v1/refunds", data=b"", headers=h)).status == 403
    assert (await gw.client.put("/proxy/pay/v1/charges", data=b"", headers=h)).status == 403
    assert (await gw.client.get("/proxy/pay/v1/charges", headers=h)).status == 403
    assert (await gw.client.options("/proxy/pay/v1/charges", headers=h)).status == 405
    ok = await gw.client.post("/proxy/pay/v1/charges/ch_1/capture", data=b"", headers=h)
    assert ok.status == 200
    assert [s.path_qs for s in receiver.seen] == ["/api/v1/charges/ch_1/capture"]


async def test_no_worker_key_no_proxy(gw: Gateway, receiver: Receiver) -> None:
    gen = await register(gw, "r")
    h = fenced("r", "s", gen)
    for value in (None, "Bearer wrong", f"Bearer {KEYS['sched']}"):
        if value is None:
            h.pop("Authorization")
        else:
            h["Authorization"] = value
        resp = await gw.client.post("/proxy/pay/v1/charges", data=b"", headers=h)
        assert resp.status in (401, 403)
    assert receiver.seen == []


async def test_a_zombie_is_refused_terminally_and_nothing_is_sent(
    gw: Gateway, receiver: Receiver
) -> None:
    old = await register(gw, "r")
    new = await register(gw, "r")
    resp = await gw.client.post("/proxy/pay/v1/charges", data=b"x", headers=fenced("r", "s", old))
    assert resp.status == 409
    body = await resp.json()
    assert (body["code"], body["presented"], body["current"]) == ("stale_generation", old, new)
    assert resp.headers["Content-Type"].startswith("application/problem+json")
    assert resp.headers["Stripe-Should-Retry"] == resp.headers["X-Should-Retry"] == "false"
    assert resp.headers["Fencegate-Outcome"] == "refused"
    assert receiver.seen == []


async def test_another_request_on_a_pinned_step_is_an_audited_intent_mismatch(
    gw: Gateway, receiver: Receiver
) -> None:
    gen = await register(gw, "r")
    h = fenced("r", "charge", gen, **{"Content-Type": "application/x-www-form-urlencoded"})
    assert (await gw.client.post("/proxy/pay/v1/charges", data="a=1", headers=h)).status == 200
    other = await gw.client.post("/proxy/pay/v1/charges", data="a=2", headers=h)
    assert other.status == 422
    assert (await other.json())["code"] == "intent_mismatch"
    assert other.headers["Stripe-Should-Retry"] == "false"
    query = await gw.client.post("/proxy/pay/v1/charges?x=1", data="a=1", headers=h)
    assert query.status == 422
    assert len(receiver.seen) == 1
    audit = await gw.client.get(
        "/v1/audit/rejections", headers={"Authorization": f"Bearer {KEYS['audit']}"}
    )
    assert audit.status == 200, await audit.text()
    items = (await audit.json())["items"]
    assert [(i["reason"], i["step"]) for i in items] == [("intent_mismatch", "charge")] * 2


async def test_a_5xx_is_unknown_and_not_sent_again_to_an_upstream_that_does_not_dedupe(
    gw: Gateway, receiver: Receiver
) -> None:
    gen = await register(gw, "r")
    receiver.statuses = [503]
    h = fenced("r", "charge", gen)
    first = await gw.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)
    assert first.status == 504
    assert (await first.json())["code"] == "outcome_unknown"
    assert first.headers["Stripe-Should-Retry"] == "false"
    again = await gw.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)
    assert again.status == 409
    assert (await again.json())["code"] == "outcome_unknown"
    assert again.headers["X-Should-Retry"] == "false"
    assert len(receiver.seen) == 1


async def test_a_lost_response_is_sent_again_under_the_same_key_to_an_upstream_that_dedupes(
    make_gateway: Any, receiver: Receiver, secrets: None
) -> None:
    g: Gateway = await make_gateway(
        auth=auth(), upstreams=upstreams(receiver.url, dedupes_by_key=True)
    )
    gen = await register(g, "r")
    receiver.statuses = ["drop"]
    h = fenced("r", "charge", gen)
    first = await g.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)
    assert first.status == 504
    assert first.headers["Stripe-Should-Retry"] == "true"  # a retry re-sends under the key
    assert "Retry-After" in first.headers
    again = await g.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)
    assert again.status == 200, await again.text()
    assert again.headers["Fencegate-Outcome"] == "forwarded"
    assert [s.headers["Idempotency-Key"] for s in receiver.seen] == ["acme/r:charge"] * 2


async def test_two_tenants_get_their_own_credential_and_key(
    gw: Gateway, receiver: Receiver
) -> None:
    for tenant, scheduler in (("acme", "sched"), ("globex", "sched-globex")):
        gen = await register(gw, "r", scheduler)
        h = fenced("r", "s", gen, tenant)
        resp = await gw.client.post("/proxy/shared/hook", data=b"x", headers=h)
        assert resp.status == 200, await resp.text()
        assert resp.headers["Fencegate-Outcome"] == "forwarded"  # not the other's replay
    sent = [(s.headers["Authorization"], s.headers["Idempotency-Key"]) for s in receiver.seen]
    assert sent == [
        (f"Bearer {SECRETS['PAY_ACME']}", "acme/r:s"),
        (f"Bearer {SECRETS['PAY_GLOBEX']}", "globex/r:s"),
    ]


@pytest.mark.parametrize(
    "path",
    [
        "/proxy/pay/v1/charges/..%2f..%2fadmin/capture",
        "/proxy/pay/v1/charges/%2e%2e/capture",
        "/proxy/pay/v1/charges/.%2E/capture",
        "/proxy/pay/v1/charges/%2E/capture",
        "/proxy/pay/v1/charges/a%2Fb/capture",
        "/proxy/pay/v1/charges/a%5cb/capture",
        "/proxy/pay/v1/charges/a\\b/capture",
        "/proxy/pay/v1//charges",
        "/proxy/pay//v1/charges",
        "/proxy/pay/v1/charges/",
        "/proxy/pay/v1/charges/a%00b/capture",
        "/proxy/pay/v1/charges/a%0d%0aX:1/capture",
        "/proxy/pay/v1/charges/a%zzb/capture",
        "/proxy/pay/v1/charges/..",
        "/proxy/pay/v1/./charges",
        "/proxy/pay/v1/charges/../../../v1/charges",
        "/proxy/pay/v1/charges/%2e%2e/%2e%2e/v1/charges",
        "/proxy/pay/v1/charges?a=1#fragment",
    ],
)
async def test_a_path_escaping_the_base_is_refused_before_anything(
    gw: Gateway, receiver: Receiver, path: str
) -> None:
    gen = await register(gw, "r")
    status, body = await raw_post(gw, path, fenced("r", "s", gen))
    assert status == 400, (path, body)
    assert json.loads(body)["code"] == "invalid_request"
    assert receiver.seen == []


async def raw_post(gw: Gateway, target: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """A POST with the request target exactly as given (an HTTP client would normalise it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.client.port)
    lines = [f"POST {target} HTTP/1.1", "Host: 127.0.0.1", "Content-Length: 1",
             "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]  # fmt: skip
    writer.write(("\r\n".join(lines) + "\r\n\r\nx").encode("latin-1"))
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def test_the_request_target_never_chooses_the_host(gw: Gateway, receiver: Receiver) -> None:
    gen = await register(gw, "r")
    for target in (
        f"{receiver.url}/proxy/pay/v1/charges",  # the absolute form, naming a host
        "http://evil.example/proxy/pay/v1/charges",
    ):
        status, _ = await raw_post(gw, target, fenced("r", "s", gen))
        assert status == 404, (target, status)  # never routed by its host
    assert receiver.seen == []
    h = fenced("r", "s", gen, **{"X-Forwarded-Host": "evil.example", "Forwarded": "host=evil"})
    resp = await gw.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)
    assert resp.status == 200
    [seen] = receiver.seen
    assert seen.path_qs == "/api/v1/charges"
    assert "evil" not in json.dumps(seen.headers)


async def test_a_name_resolving_to_loopback_is_refused_without_allow_private(
    make_gateway: Any, receiver: Receiver, secrets: None
) -> None:
    port = receiver.url.rsplit(":", 1)[1]
    ups = upstreams(receiver.url)
    ups["pay"]["base_url"] = f"http://localhost:{port}/api"
    ups["pay"]["allow_private"] = False
    g: Gateway = await make_gateway(auth=auth(), upstreams=ups)
    gen = await register(g, "r")
    h = fenced("r", "charge", gen)
    resp = await g.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)
    assert resp.status == 502
    body = await resp.json()
    assert body["code"] == "adapter_unavailable" and "public address" in body["detail"]
    assert resp.headers["Stripe-Should-Retry"] == "true"  # nothing was sent: released
    assert receiver.seen == []


@pytest.mark.parametrize(
    "base_url",
    [
        "http://127.0.0.1:9/x",
        "http://10.0.0.8",
        "http://169.254.169.254/latest",
        "http://[::1]:80",
        "http://[::ffff:127.0.0.1]",
        "http://[fe80::1]",
        "http://[fd00::1]",
        "http://100.64.0.1",
        "http://0.0.0.0",
        "http://2130706433",
        "http://0x7f.1",
        "http://0177.0.0.1",
        "ftp://example.com",
        "http://user:pw@example.com",
        "http://example.com/?q=1",
    ],
)
async def test_an_upstream_at_a_private_or_ambiguous_address_refuses_to_start(
    make_gateway: Any, receiver: Receiver, secrets: None, base_url: str
) -> None:
    ups = upstreams(receiver.url)
    ups["pay"].update(base_url=base_url, allow_private=False)
    with pytest.raises(ConfigError, match=r"upstreams\.pay"):
        await make_gateway(auth=auth(), upstreams=ups)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"routes": ["OPTIONS /v1/charges"]}, "nothing else"),
        ({"routes": []}, "at least one route"),
        ({"routes": ["POST v1"]}, "METHOD /path"),
        ({"tenants": ["nobody"], "credentials_env": {}}, "nobody"),
        ({"credentials_env": {"acme": "UNSET_VAR_FOR_TEST"}}, "UNSET_VAR_FOR_TEST"),
        ({"credentials_env": {}, "credential_env": "PAY_ACME", "tenants": "*"}, "share one"),
        ({"forward_headers": ["Authorization"]}, "never forwarded"),
        ({"error_dialect": "graphql"}, "error_dialect"),
    ],
)
async def test_a_wrong_upstream_section_refuses_to_start(
    make_gateway: Any, receiver: Receiver, secrets: None, change: dict[str, Any], match: str
) -> None:
    ups = upstreams(receiver.url)
    ups["pay"].update(change)
    with pytest.raises(ConfigError, match=match):
        await make_gateway(auth=auth(), upstreams=ups)


async def test_pause_takeover_resume_through_httpx_is_one_effect(
    gw: Gateway, receiver: Receiver
) -> None:
    """The seed's timeline with a plain httpx client and an upstream that does not dedupe:
    A holds generation 1 and stalls mid-call; B takes over as 2; A resumes."""
    base = str(gw.client.make_url("/proxy/pay")).rstrip("/")
    a_gen = await register(gw, "r")
    receiver.hold()  # A's request reaches the upstream, whose answer stalls
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        body = {"to": "customer@example.com", "amount": 5}
        a_first = asyncio.create_task(
            http.post("/v1/charges", json=body, headers=fenced("r", "notify", a_gen))
        )
        await asyncio.wait_for(receiver.arrived.wait(), 5)
        b_gen = await register(gw, "r")  # the lease ran out: B is generation 2
        b_busy = await http.post("/v1/charges", json=body, headers=fenced("r", "notify", b_gen))
        assert b_busy.status_code == 409  # A's dispatch holds the step
        assert b_busy.json()["code"] == "effect_in_progress"
        assert b_busy.headers["X-Should-Retry"] == "true" and "Retry-After" in b_busy.headers
        receiver.gate.set()
        a_answer = await a_first  # admitted before the takeover: the effect happened, recorded
        assert a_answer.status_code == 200
        assert a_answer.headers["Fencegate-Outcome"] == "forwarded"
        b_retry = await http.post("/v1/charges", json=body, headers=fenced("r", "notify", b_gen))
        assert b_retry.status_code == 200
        assert b_retry.headers["Fencegate-Outcome"] == "replayed"  # B gets it back, not again
        assert b_retry.json() == a_answer.json()
        a_again = await http.post("/v1/charges", json=body, headers=fenced("r", "notify", a_gen))
        assert a_again.status_code == 409
        assert a_again.json()["code"] == "stale_generation"
        a_other = await http.post("/v1/charges", json=body, headers=fenced("r", "notify-2", a_gen))
        assert a_other.json()["code"] == "stale_generation"  # and no new step either
    assert len(receiver.seen) == 1


def test_the_example_configs_upstream_is_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    text = (Path(__file__).parents[2] / "config" / "fencegate.example.toml").read_text()
    block = text[text.index("# [upstreams.") :]
    data = tomllib.loads("\n".join(ln[2:] for ln in block.splitlines() if ln.startswith("# ")))
    monkeypatch.setenv("ACME_STRIPE_SECRET_KEY", "sk_test_x")
    [upstream] = load_upstreams(data["upstreams"], {"acme", "globex"}, read_secret).values()
    assert upstream.credential("acme") == ("Authorization", "Bearer sk_test_x")
    assert upstream.serves("acme") and not upstream.serves("globex")


async def test_a_key_longer_than_255_characters_is_sent_hashed(
    gw: Gateway, receiver: Receiver
) -> None:
    job, step = "j" * 128, "s" * 128
    gen = await register(gw, job)
    resp = await gw.client.post("/proxy/pay/v1/charges", data=b"x", headers=fenced(job, step, gen))
    assert resp.status == 200
    full = f"acme/{job}:{step}"
    assert receiver.seen[0].headers["Idempotency-Key"] == "fg-" + key_digest(full)


async def test_a_response_over_the_cap_is_streamed_recorded_by_digest_never_sent_again(
    make_gateway: Any, receiver: Receiver, secrets: None
) -> None:
    g: Gateway = await make_gateway(
        auth=auth(), upstreams=upstreams(receiver.url, max_response_bytes=8)
    )
    gen = await register(g, "r")
    h = fenced("r", "charge", gen)
    first = await g.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)
    assert first.status == 200  # this call gets the upstream's answer, streamed
    assert first.headers["Fencegate-Outcome"] == "forwarded"
    assert first.headers["Request-Id"] == "req_1" and "Content-Length" not in first.headers
    streamed = await first.read()
    assert json.loads(streamed) == {"n": 1, "path": "/api/v1/charges"}
    for _ in range(2):  # a later call: nothing recorded to replay, nothing sent again
        resp = await g.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)
        assert resp.status == 502
        body = await resp.json()
        assert (body["code"], body["upstream_status"]) == ("replay_unavailable", 200)
        assert (body["size"], body["sha256"]) == (len(streamed), key_digest_bytes(streamed))
        assert resp.headers["Stripe-Should-Retry"] == "false"
    assert len(receiver.seen) == 1


def key_digest_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def test_an_encoded_body_is_decoded_pinned_and_forwarded_unencoded(
    gw: Gateway, receiver: Receiver
) -> None:
    gen = await register(gw, "r")
    body = b'{"amount": 5, "currency": "eur"}'
    h = fenced("r", "charge", gen, **{"Content-Type": "application/json"})
    for step, (coding, data) in {
        "charge": ("gzip", gzip.compress(body)),
        "deflated": ("deflate", zlib.compress(body)),
        "twice": ("gzip, deflate", zlib.compress(gzip.compress(body))),
    }.items():
        resp = await gw.client.post(
            "/proxy/pay/v1/charges", data=data,
            headers={**h, "Fencegate-Step": step, "Content-Encoding": coding},
        )  # fmt: skip
        assert resp.status == 200, await resp.text()
        seen = receiver.seen[-1]
        assert seen.body == body  # the decoded body, with no Content-Encoding of its own
        assert "Content-Encoding" not in seen.headers
        assert seen.headers["Content-Length"] == str(len(body))
    # the intent is the decoded body's: the same request unencoded is the step's replay, and
    # gzip of another body is a different request
    plain = await gw.client.post("/proxy/pay/v1/charges", data=body, headers=h)
    assert plain.headers["Fencegate-Outcome"] == "replayed"
    other = await gw.client.post(
        "/proxy/pay/v1/charges", data=gzip.compress(b'{"amount": 6, "currency": "eur"}'),
        headers={**h, "Content-Encoding": "gzip"},
    )  # fmt: skip
    assert other.status == 422 and (await other.json())["code"] == "intent_mismatch"
    assert len(receiver.seen) == 3


async def test_bad_encoded_or_oversized_bodies_are_refused_and_pin_nothing(
    gw: Gateway, receiver: Receiver
) -> None:
    gen = await register(gw, "r")
    h = fenced("r", "charge", gen)
    body = b'{"amount": 5}'
    good = gzip.compress(body)
    limit = gw.settings.server.max_body_bytes
    refused = {
        "cut": ("gzip", good[:-6], 400),
        "corrupt": ("gzip", good[:10] + b"\xff" * 6 + good[16:], 400),
        "trailing": ("gzip", good + b"x", 400),
        "not gzip": ("x-gzip", body, 400),
        "bomb": ("gzip", gzip.compress(b"\0" * (64 * limit)), 413),
        "unknown": ("compress", body, 415),
        "brotli": ("br", body, 415),
        "one of two headers": ("identity", body, 415),  # with a second header: "zstd"
    }
    for case, (coding, data, status) in refused.items():
        headers = [*h.items(), ("Content-Encoding", coding)]
        if case == "one of two headers":  # a second header is read too, not only the first
            headers.append(("Content-Encoding", "zstd"))
        resp = await gw.client.post("/proxy/pay/v1/charges", data=data, headers=headers)
        assert resp.status == status, case
        assert resp.headers["Fencegate-Outcome"] == "refused", case
    big = await gw.client.post("/proxy/pay/v1/charges", data=b"x" * (limit + 1), headers=h)
    assert big.status == 413
    assert receiver.seen == []
    # nothing was pinned by a refused body: the step is still free for the real request
    ok = await gw.client.post(
        "/proxy/pay/v1/charges", data=good, headers={**h, "Content-Encoding": "gzip"}
    )
    assert ok.status == 200 and receiver.seen[0].body == body


async def test_the_credentials_and_the_workers_key_are_never_logged(
    gw: Gateway, receiver: Receiver, capsys: pytest.CaptureFixture[str]
) -> None:
    gen = await register(gw, "r")
    receiver.statuses = [503]
    for token in (gen, gen, 99):  # forwarded (unknown), refused (unknown), refused (fence)
        await gw.client.post("/proxy/pay/v1/charges", data=b"x", headers=fenced("r", "c", token))
    await gw.client.post("/proxy/shared/hook", data=b"x", headers=fenced("r", "d", gen))
    out = capsys.readouterr()
    logged = out.out + out.err
    assert "/proxy/pay/v1/charges" in logged  # the request lines are there
    for secret in (*SECRETS.values(), KEYS["acme"]):
        assert secret not in logged
    # and `fencegate serve` hands every upstream credential to the log redactor
    assert set(SECRETS.values()) <= set(_configured_secrets(gw.settings))


async def test_a_signed_token_must_be_signed_for_the_job_the_header_names(
    make_gateway: Any, receiver: Receiver, secrets: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROXY_SIGNING_KEY", "k" * 40)
    g: Gateway = await make_gateway(
        auth={**auth(), "token_signing_key_env": "PROXY_SIGNING_KEY"},
        upstreams=upstreams(receiver.url),
    )
    tokens = {}
    for job in ("r", "other"):
        resp = await g.client.post(
            f"/v1/jobs/{job}/generations", json={},
            headers={"Authorization": f"Bearer {KEYS['sched']}"},
        )  # fmt: skip
        tokens[job] = (await resp.json())["token"]
    h = fenced("r", "charge", 0)
    h["Fencing-Token"] = tokens["other"]  # a valid token, of another job
    resp = await g.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)
    assert resp.status == 400
    assert (await resp.json())["code"] == "bad_token"
    assert resp.headers["Stripe-Should-Retry"] == "false"
    h["Fencing-Token"] = tokens["r"]
    ok = await g.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)
    assert ok.status == 200, await ok.text()
    assert len(receiver.seen) == 1
    audit = await g.client.get(
        "/v1/audit/rejections", headers={"Authorization": f"Bearer {KEYS['audit']}"}
    )
    assert [i["reason"] for i in (await audit.json())["items"]] == ["bad_token"]


async def test_in_open_mode_the_sdks_api_key_is_stripped_too(
    make_gateway: Any, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPEN_PAY_KEY", "sk_open_secret")
    g: Gateway = await make_gateway(
        upstreams={
            "pay": {
                "base_url": receiver.url,
                "routes": ["POST /v1/charges"],
                "credential_env": "OPEN_PAY_KEY",
                "inject_header": "X-Api-Key",
                "allow_private": True,
            }
        }
    )
    resp = await g.client.post("/v1/jobs/r/generations", json={})
    gen = (await resp.json())["generation"]
    h = {"Authorization": "Bearer whatever-the-sdk-holds", "Fencing-Token": str(gen),
         "Fencegate-Job": "r", "Fencegate-Step": "charge"}  # fmt: skip
    resp = await g.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)
    assert resp.status == 200, await resp.text()
    [seen] = receiver.seen
    assert seen.headers["X-Api-Key"] == "sk_open_secret"
    assert "Authorization" not in seen.headers
    assert seen.headers["Idempotency-Key"] == "default/r:charge"


@pytest.mark.parametrize("status", [302, 307])
async def test_a_redirect_is_the_recorded_answer_and_never_followed(
    gw: Gateway, receiver: Receiver, status: int
) -> None:
    gen = await register(gw, "r")
    receiver.statuses = [status]
    h = fenced("r", "charge", gen, **{"Idempotency-Key": "sdk-key-9"})
    resp = await gw.client.post(
        "/proxy/pay/v1/charges", data=b"x", headers=h, allow_redirects=False
    )
    assert resp.status == status
    assert resp.headers["Location"] == f"{receiver.url}/elsewhere"  # passed on as answered
    assert [s.path_qs for s in receiver.seen] == ["/api/v1/charges"]  # never followed
    record = await gw.client.get(
        "/v1/jobs/r/effects/charge", headers={"Authorization": f"Bearer {KEYS['audit']}"}
    )
    body = await record.json()
    assert body["state"] == "failed"
    assert body["error"]["status"] == status
    assert body["error"]["client_key"] == "sdk-key-9"  # the client's own key, kept


async def test_one_tenants_stalled_upstream_calls_do_not_hold_anothers(
    make_gateway: Any, receiver: Receiver, secrets: None
) -> None:
    """Bulkheads: each tenant has its own bounded pool to a shared upstream."""
    g: Gateway = await make_gateway(
        auth=auth(),
        upstreams=upstreams(receiver.url),
        bulkheads={"connections_per_pool": 1, "pool_wait_seconds": 0.3},
    )
    acme = await register(g, "r")
    globex = await register(g, "r", "sched-globex")
    receiver.hold()
    stalled = asyncio.create_task(
        g.client.post("/proxy/shared/hook", data=b"x", headers=fenced("r", "a", acme))
    )
    await asyncio.wait_for(receiver.arrived.wait(), 5)
    # acme's one connection is taken: its next step waits for the pool, then is not sent
    waited = await g.client.post("/proxy/shared/hook", data=b"x", headers=fenced("r", "b", acme))
    assert waited.status == 502
    assert (await waited.json())["code"] == "adapter_unavailable"  # released: nothing sent
    receiver.arrived.clear()
    other = asyncio.create_task(
        g.client.post("/proxy/shared/hook", data=b"x", headers=fenced("r", "a", globex, "globex"))
    )
    await asyncio.wait_for(receiver.arrived.wait(), 5)  # globex's own pool: it got through
    receiver.gate.set()
    assert (await other).status == 200
    assert (await stalled).status == 200
    assert [s.headers["Idempotency-Key"] for s in receiver.seen] == ["acme/r:a", "globex/r:a"]


async def test_a_read_route_is_passed_through_unfenced_and_unrecorded(
    gw: Gateway, receiver: Receiver
) -> None:
    worker = {"Authorization": f"Bearer {KEYS['acme']}", "Idempotency-Key": "sdk-k"}
    resp = await gw.client.get("/proxy/pay/v1/charges/ch_1?expand=x", headers=worker)
    assert resp.status == 200, await resp.text()
    assert resp.headers["Fencegate-Outcome"] == "forwarded"
    assert "Idempotent-Replayed" not in resp.headers
    again = await gw.client.get("/proxy/pay/v1/charges/ch_1?expand=x", headers=worker)
    assert (await again.json())["n"] == 2  # not a replay: a read is sent every time
    [first, _] = receiver.seen
    assert (first.method, first.path_qs) == ("GET", "/api/v1/charges/ch_1?expand=x")
    assert first.headers["Authorization"] == f"Bearer {SECRETS['PAY_ACME']}"
    assert "Idempotency-Key" not in first.headers
    foreign = await gw.client.get(
        "/proxy/pay/v1/charges/ch_1", headers={"Authorization": f"Bearer {KEYS['globex']}"}
    )
    assert foreign.status == 404
    anonymous = await gw.client.get("/proxy/pay/v1/charges/ch_1")
    assert anonymous.status == 401
    with_body = await gw.client.get("/proxy/pay/v1/charges/ch_1", headers=worker, data=b"x")
    assert with_body.status == 400
    assert len(receiver.seen) == 2


async def test_a_duplicate_in_flight_waits_for_the_first_calls_outcome(
    gw: Gateway, receiver: Receiver
) -> None:
    gen = await register(gw, "r")
    receiver.hold()
    h = fenced("r", "charge", gen)
    first = asyncio.create_task(gw.client.post("/proxy/pay/v1/charges", data=b"x", headers=h))
    await asyncio.wait_for(receiver.arrived.wait(), 5)
    duplicate = asyncio.create_task(
        gw.client.post("/proxy/pay/v1/charges", data=b"x", headers=h)  # an SDK's retry
    )
    await asyncio.sleep(0.3)  # well within in_flight_wait_seconds (1.0)
    assert not duplicate.done()
    receiver.gate.set()
    answer, again = await first, await duplicate
    assert (answer.status, again.status) == (200, 200)
    assert again.headers["Fencegate-Outcome"] == "replayed"
    assert await again.json() == await answer.json()
    assert len(receiver.seen) == 1


async def test_the_openapi_document_has_the_proxy_route_and_no_upstream_names(
    gw: Gateway, make_gateway: Any
) -> None:
    doc = await (await gw.client.get("/openapi.json")).json()
    route = doc["paths"]["/proxy/{upstream}/{path}"]
    assert set(route) == {"post", "put", "patch", "delete", "get", "head"}
    required = {p["name"] for p in route["post"]["parameters"] if p["required"]}
    assert {"upstream", "path", "Fencing-Token", "Fencegate-Job", "Fencegate-Step"} <= required
    assert {p["name"] for p in route["get"]["parameters"]} == {"upstream", "path"}
    assert {"default", "409", "415", "422"} <= set(route["post"]["responses"])
    text = json.dumps(doc)
    assert '"pay"' not in text and "/api" not in text and "shared" not in text
    plain: Gateway = await make_gateway()  # no [upstreams.*]: no proxy route to describe
    other = await (await plain.client.get("/openapi.json")).json()
    assert not [p for p in other["paths"] if p.startswith("/proxy/")]
