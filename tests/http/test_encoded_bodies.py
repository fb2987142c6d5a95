"""Request bodies sent gzip- or deflate-encoded, by a real HTTP client on loopback: decoded by
the gateway (its HTTP server's own inflating is off), strictly and bounded after decoding, on
the effect route, a checkpoint and a completion. A cut or corrupt stream is 400, a stream that
inflates past the body limit 413, another coding 415 — and none of them changes anything."""

from __future__ import annotations

import gzip
import json
import zlib
from typing import Any

import pytest

from tests.conftest import Gateway, Upstream
from tests.support.calls import EFFECT, assert_untouched, problem

BODY = json.dumps({**EFFECT, "payload": {"to": "gzip@example.com"}}).encode()


def bomb(limit: int) -> bytes:
    """A gzip stream of a few kilobytes that inflates to 64 times ``limit``."""
    return gzip.compress(b"\0" * (64 * limit))


def refusals(limit: int) -> dict[str, tuple[str, bytes, int, str]]:
    """name → (Content-Encoding, the raw body, the status, the code)."""
    good = gzip.compress(BODY)
    return {
        "cut gzip": ("gzip", good[: len(good) // 2], 400, "invalid_request"),
        "gzip without its trailer": ("gzip", good[:-4], 400, "invalid_request"),
        "corrupt gzip": ("gzip", good[:10] + b"\xff" * 8 + good[18:], 400, "invalid_request"),
        "not gzip at all": ("gzip", BODY, 400, "invalid_request"),
        "gzip with trailing bytes": ("gzip", good + b"{}", 400, "invalid_request"),
        "cut deflate": ("deflate", zlib.compress(BODY)[:-3], 400, "invalid_request"),
        "bomb": ("gzip", bomb(limit), 413, "payload_too_large"),
        "bomb in two codings": (
            "deflate, gzip",
            gzip.compress(zlib.compress(b"\0" * 64 * limit)),
            413,
            "payload_too_large",
        ),
        "brotli": ("br", BODY, 415, "unsupported_media_type"),
        "compress": ("compress", BODY, 415, "unsupported_media_type"),
        "three codings": ("gzip, gzip, gzip", BODY, 415, "unsupported_media_type"),
    }


CASES = list(refusals(262_144))


async def post_effect(gw: Gateway, job: str, step: str, data: bytes, coding: str) -> Any:
    headers = {"Fencing-Token": "1", "Content-Type": "application/json"}
    return await gw.client.post(
        f"/v1/jobs/{job}/effects/{step}", data=data, headers={**headers, "Content-Encoding": coding}
    )


@pytest.mark.parametrize(
    ("coding", "encode"),
    [("gzip", gzip.compress), ("x-gzip", gzip.compress), ("deflate", zlib.compress),
     ("identity", bytes), ("gzip, identity", gzip.compress)],
)  # fmt: skip
async def test_an_encoded_effect_body_is_decoded_and_sent(
    gw: Gateway, upstream: Upstream, coding: str, encode: Any
) -> None:
    await gw.register("r", generation=1, lease_ms=60_000)
    resp = await post_effect(gw, "r", "send", encode(BODY), coding)
    assert resp.status == 200, await resp.text()
    assert [json.loads(r.body)["to"] for r in upstream.received] == ["gzip@example.com"]
    # the record's intent is the decoded body's: the same call unencoded is its replay
    again = await post_effect(gw, "r", "send", BODY, "identity")
    assert again.status == 200 and (await again.json())["replayed"] is True
    assert len(upstream.received) == 1


async def test_raw_deflate_and_two_codings_are_decoded_in_order(
    gw: Gateway, upstream: Upstream
) -> None:
    await gw.register("r", generation=1, lease_ms=60_000)
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    resp = await post_effect(gw, "r", "a", raw.compress(BODY) + raw.flush(), "deflate")
    assert resp.status == 200, await resp.text()
    # applied gzip first, then deflate: listed in that order, undone the other way round
    twice = zlib.compress(gzip.compress(BODY))
    resp = await post_effect(gw, "r", "b", twice, "gzip, deflate")
    assert resp.status == 200, await resp.text()
    assert len(upstream.received) == 2


@pytest.mark.parametrize("case", CASES)
async def test_a_bad_encoded_effect_body_is_refused_and_changes_nothing(
    gw: Gateway, upstream: Upstream, redis_sync: Any, case: str
) -> None:
    await gw.register("r", generation=1, lease_ms=60_000)
    coding, data, status, code = refusals(gw.settings.server.max_body_bytes)[case]
    call = post_effect(gw, "r", "send", data, coding)
    await assert_untouched(gw, upstream, redis_sync, call, status, code)


async def test_encoded_checkpoints_and_completions_are_decoded_or_refused(
    gw: Gateway, upstream: Upstream, redis_sync: Any
) -> None:
    await gw.register("r", generation=1, lease_ms=60_000)
    h = {"Fencing-Token": "1", "Content-Type": "application/json"}
    url = "/v1/jobs/r/checkpoints/progress"
    value = {"page": 7, "cursor": "x" * 2000}
    put = await gw.client.put(
        url,
        data=gzip.compress(json.dumps(value).encode()),
        headers={**h, "Content-Encoding": "gzip"},
    )
    assert put.status in (200, 201), await put.text()
    got = await gw.client.get(url, headers=h)
    assert (await got.json())["value"] == value
    limit = min(gw.settings.checkpoints.max_bytes, gw.settings.server.max_body_bytes)
    for coding, data, status, code in refusals(limit).values():
        resp = gw.client.put(url, data=data, headers={**h, "Content-Encoding": coding})
        await assert_untouched(gw, upstream, redis_sync, resp, status, code)
    assert (await (await gw.client.get(url, headers=h)).json())["value"] == value
    cut = gzip.compress(b'{"result": {"ok": true}}')[:-6]
    resp = gw.client.post(
        "/v1/jobs/r/complete", data=cut, headers={**h, "Content-Encoding": "gzip"}
    )
    await assert_untouched(gw, upstream, redis_sync, resp, 400, "invalid_request")
    done = await gw.client.post(
        "/v1/jobs/r/complete",
        data=gzip.compress(b'{"result": {"ok": true}}'),
        headers={**h, "Content-Encoding": "gzip"},
    )
    assert done.status == 200, await done.text()
    await problem(
        await gw.client.post(
            "/v1/jobs/r/complete", data=b"{}", headers={**h, "Content-Encoding": "zstd"}
        ),
        415,
        "unsupported_media_type",
    )
