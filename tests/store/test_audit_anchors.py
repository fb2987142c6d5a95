"""A keyed audit chain, and chain heads anchored outside Redis.

Every tamper below is done the way someone with write access to Redis but without the audit
key would do it: with a plain Redis client, on the real streams a real gateway wrote.
`fencegate audit verify` runs as a process, as an operator runs it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gateway.core.records import chain_hash
from gateway.runtime.settings import ConfigError
from gateway.store.anchors import anchor_mac, key_id
from tests.conftest import Gateway
from tests.support.processes import Serve, write_config

KEY = "audit-key-for-tests-0123456789abcdef"
ENV = "FG_TEST_AUDIT_KEY"
STREAM = "fg:{default/r}:audit"
JOB = "fg:{default/r}:job"
Rows = list[tuple[str, dict[str, str]]]


async def verify(redis_url: str, *args: str, key: str | None = KEY) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
    if key is not None:
        env.update({"FENCEGATE_AUDIT__KEY_ENV": ENV, ENV: key})
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "audit", "verify", "--redis-url", redis_url, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


@pytest.fixture
def keyed(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(ENV, KEY)
    return ENV


async def gateway(make_gateway: Any, interval: float = 0.1, key_env: str = ENV) -> Gateway:
    g: Gateway = await make_gateway(audit={"key_env": key_env, "anchor_interval_seconds": interval})
    return g


def anchor_file(gw: Gateway) -> Path:
    return Path(gw.settings.redis.data_dir) / "audit-anchors.jsonl"


def anchors(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


async def anchored(path: Path, entry: str) -> dict[str, Any]:
    """Wait until an anchor covers this entry (the gateway anchors on its own clock)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for a in anchors(path):
            if a["entry"] == entry:
                return a
        await asyncio.sleep(0.05)
    raise AssertionError(f"no anchor for {entry} in {path}: {anchors(path)}")


async def rejections(gw: Gateway, n: int, job: str = "r", start: int = 0) -> None:
    await gw.register(job, generation=5)
    for i in range(start, start + n):
        assert (await gw.effect(job, f"s{i}", 1)).status == 409


def rewrite(redis_sync: Any, rows: Rows) -> None:
    """Replace the stream with these entries under their own ids (XADD cannot go back)."""
    redis_sync.delete(STREAM)
    for entry_id, fields in rows:
        redis_sync.xadd(STREAM, fields, id=entry_id)


def rehash(rows: Rows, start: int, key: bytes | None = None) -> Rows:
    """Recompute prev/hash from entry `start` on, as a forger would (SHA-1, or with a key)."""
    out = [(i, dict(f)) for i, f in rows]
    for n in range(start, len(out)):
        fields = out[n][1]
        if n > 0:
            fields["prev"] = out[n - 1][1]["hash"]
        fields["hash"] = chain_hash([(k, v) for k, v in fields.items() if k != "hash"], key)
    return out


# -- (a) a keyed chain ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        "k" * 16,
        "k" * 63,
        "k" * 64,  # the block size: used as is
        "k" * 65,  # longer: hashed first (RFC 2104), in Lua as in Python's hmac
        "a-long-key-" * 20,
        "clé-ünïcode-🔑-long-enough",
    ],
)
async def test_lua_hmac_matches_python_for_every_key_length(
    make_gateway: Any, redis_sync: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch, key: str
) -> None:
    monkeypatch.setenv(ENV, key)
    gw = await gateway(make_gateway)
    await rejections(gw, 2)
    rows = redis_sync.xrange(STREAM)
    for _, fields in rows:
        items = [(k, v) for k, v in fields.items() if k != "hash"]
        assert fields["hash"] == chain_hash(items, key.encode())
        assert fields["hash"] != chain_hash(items)  # not the unkeyed SHA-1
    code, out = await verify(redis_url, "--anchors", os.devnull, key=key)
    assert code == 0, out
    # the registration and the two rejections
    assert f"1 jobs, 3 entries, intact; keyed (kid {key_id(key)})" in out


async def test_altering_one_field_of_a_keyed_entry_is_detected(
    make_gateway: Any, keyed: str, redis_sync: Any, redis_url: str
) -> None:
    gw = await gateway(make_gateway)
    await rejections(gw, 3)
    rows = redis_sync.xrange(STREAM)
    rows[1][1]["presented"] = "4"  # "the zombie was only one generation behind"
    rewrite(redis_sync, rows)
    code, out = await verify(redis_url, "--anchors", "/nonexistent")
    assert code == 1
    assert f"BROKEN  {STREAM} {rows[1][0]}: entry altered (its HMAC does not match)" in out


async def test_altered_entry_rehashed_with_sha1_is_detected_when_keyed(
    make_gateway: Any, keyed: str, redis_sync: Any, redis_url: str
) -> None:
    gw = await gateway(make_gateway)
    await rejections(gw, 3)
    rows = redis_sync.xrange(STREAM)
    rows[1][1]["presented"] = "4"
    forged = rehash(rows, 1)  # a consistent unkeyed chain from there on, head updated
    rewrite(redis_sync, forged)
    redis_sync.hset(JOB, mapping={"audit_head": forged[-1][1]["hash"]})
    code, out = await verify(redis_url, "--anchors", "/nonexistent")
    assert code == 1
    for entry_id, _ in forged[1:]:
        assert f"{entry_id}: entry hashed without the audit key" in out


async def test_unkeyed_chain_rehashed_by_a_forger_passes_verify(
    make_gateway: Any, redis_sync: Any, redis_url: str
) -> None:
    """The limitation of an unkeyed chain, asserted: it catches accidental damage only."""
    gw = await gateway(make_gateway, key_env="")
    await rejections(gw, 3)
    rows = redis_sync.xrange(STREAM)
    rows[1][1]["presented"] = "4"
    forged = rehash(rows, 1)
    rewrite(redis_sync, forged)
    redis_sync.hset(JOB, mapping={"audit_head": forged[-1][1]["hash"]})
    code, out = await verify(redis_url, "--anchors", "/nonexistent", key=None)
    assert code == 0 and "4 entries, intact; unkeyed" in out
    assert "unkeyed chain: detects accidental damage only" in out


async def test_wrong_key_fails_every_entry(
    make_gateway: Any, keyed: str, redis_sync: Any, redis_url: str
) -> None:
    gw = await gateway(make_gateway)
    await rejections(gw, 2)
    code, out = await verify(redis_url, "--anchors", "/nonexistent", key="another-key-16-bytes!")
    # the registration and both rejections
    assert code == 1 and out.count("entry altered (its HMAC does not match)") == 3


async def test_a_short_audit_key_is_refused(
    make_gateway: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "short")
    with pytest.raises(ConfigError, match=r"audit\.key_env"):
        await gateway(make_gateway)


# -- (b) the hole: the newest entries deleted and the head reset ----------------------------


async def truncate(redis_sync: Any, keep: int) -> Rows:
    """Delete every entry after the first `keep` and point the job's head at the last kept."""
    rows: Rows = redis_sync.xrange(STREAM)
    for entry_id, _ in rows[keep:]:
        redis_sync.xdel(STREAM, entry_id)
    last_id, last = rows[keep - 1]
    redis_sync.hset(JOB, mapping={"audit_head": last["hash"], "audit_last": last_id})
    return rows


async def test_deleting_anchored_newest_entries_and_resetting_the_head_is_detected(
    make_gateway: Any, keyed: str, redis_sync: Any, redis_url: str
) -> None:
    """Without anchors, verify would call such a chain "intact"."""
    gw = await gateway(make_gateway)
    await rejections(gw, 4)
    path = anchor_file(gw)
    newest_id = redis_sync.xrevrange(STREAM, count=1)[0][0]
    anchor = await anchored(path, newest_id)
    # the registration and four rejections
    assert anchor["head"] == redis_sync.hget(JOB, "audit_head") and anchor["count"] == 5
    assert anchor["kid"] == key_id(KEY) and anchor["mac"] == anchor_mac(anchor, KEY)

    rows = await truncate(redis_sync, keep=3)

    # the chain alone (verify without anchors) cannot see it ...
    code, out = await verify(redis_url, "--anchors", "/nonexistent")
    assert code == 0 and "3 entries, intact" in out
    # ... the anchor can
    code, out = await verify(redis_url, "--anchors", str(path))
    assert code == 1, out
    assert f"BROKEN  {STREAM}: anchored entry {rows[4][0]} missing" in out
    assert "anchors: " in out and " checked" in out


async def test_rewriting_an_anchor_to_match_a_truncated_chain_is_detected(
    make_gateway: Any, keyed: str, redis_sync: Any, redis_url: str, tmp_path: Path
) -> None:
    gw = await gateway(make_gateway)
    await rejections(gw, 3)
    newest_id = redis_sync.xrevrange(STREAM, count=1)[0][0]
    anchor = await anchored(anchor_file(gw), newest_id)
    rows = await truncate(redis_sync, keep=1)
    forged = {**anchor, "entry": rows[0][0], "head": rows[0][1]["hash"], "count": 1}
    path = tmp_path / "forged.jsonl"
    path.write_text(json.dumps(forged) + "\n")
    code, out = await verify(redis_url, "--anchors", str(path))
    assert code == 1 and "anchor altered (its MAC does not match)" in out


async def test_anchor_of_a_deleted_stream_is_broken_unless_retention_expired_it(
    redis_sync: Any, redis_url: str, tmp_path: Path
) -> None:
    now_ms = int(time.time() * 1000)
    lines = []
    for job, entry in (("gone", f"{now_ms}-0"), ("old", "1000-0")):
        record: dict[str, Any] = {
            "v": 1, "at": now_ms, "tenant": "default", "job_id": job, "entry": entry,
            "head": "0" * 40, "count": 1, "kid": key_id(KEY),
        }  # fmt: skip
        record["mac"] = anchor_mac(record, KEY)
        lines.append(json.dumps(record))
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code, out = await verify(redis_url, "--anchors", str(path))
    assert code == 1
    assert "fg:{default/gone}:audit: the job's audit stream is gone" in out
    assert "{default/old}" not in out and "(1 past retention, not checkable)" in out


async def test_entries_deleted_before_the_anchor_was_taken_are_noticed(
    make_gateway: Any, keyed: str, redis_sync: Any, redis_url: str
) -> None:
    """Truncated between the rejections and the next anchor: the anchor is taken from the
    truncated Redis, but it names the newest entry the gateway saw in a reply (`seen`)."""
    gw = await gateway(make_gateway, interval=3600)
    await rejections(gw, 3)
    rows = await truncate(redis_sync, keep=1)
    await gw.client.close()  # the shutdown anchor
    path = anchor_file(gw)
    [anchor] = anchors(path)
    # rows: the registration, then three rejections; only the registration is left
    assert anchor["entry"] == rows[0][0] and anchor["seen"] == rows[3][0]
    code, out = await verify(redis_url, "--anchors", str(path))
    assert code == 1, out
    assert f"{STREAM}: entry {rows[3][0]}, written through the gateway, missing" in out


async def test_torn_or_malformed_anchor_lines_are_reported(
    redis_sync: Any, redis_url: str, tmp_path: Path
) -> None:
    path = tmp_path / "a.jsonl"
    bad = {"tenant": "default", "job_id": "r", "entry": "1-0; DROP"}
    path.write_text('{"v":1,"at":17\n' + json.dumps(bad) + '\n{"event":"request"}\n')
    code, out = await verify(redis_url, "--anchors", str(path))
    assert code == 1
    assert f"BROKEN  {path}:1: unreadable anchor line" in out
    assert f"BROKEN  {path}:2: not an anchor" in out
    assert ":3:" not in out  # another line of a gateway log: not an anchor, not a problem


# -- (c) the documented limitation ---------------------------------------------------------


async def test_entries_newer_than_the_last_anchor_can_be_deleted_undetected(
    make_gateway: Any, keyed: str, redis_sync: Any, redis_url: str
) -> None:
    """The limitation the README states: deleting the entries written since the newest
    anchor of their job, and resetting the job's head, is NOT detected (until the gateway
    writes its next anchor). Anchors bound the window to `[audit] anchor_interval_seconds`;
    they cannot close it."""
    first = await gateway(make_gateway, interval=3600)
    await rejections(first, 2)
    await first.client.close()  # shutdown anchors the heads of its last interval
    path = anchor_file(first)
    assert [a["count"] for a in anchors(path)] == [3]  # the registration, two rejections

    second = await gateway(make_gateway, interval=3600)  # its next anchor is an hour away
    await rejections(second, 2, start=2)  # generation 5 is current already: no new entry
    await truncate(redis_sync, keep=3)

    code, out = await verify(redis_url, "--anchors", str(path))
    assert code == 0, out  # not detected: the limitation, asserted
    assert "3 entries, intact" in out and "anchors: 1 checked" in out
    assert "not detectable: deleting a job's entries newer than its newest anchor" in out


# -- (d) several worker processes, one anchor file ------------------------------------------


def post(s: Serve, path: str, body: Any, token: int | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Fencing-Token"] = str(token)
    req = urllib.request.Request(
        s.url(path), data=json.dumps(body).encode(), method="POST", headers=headers
    )
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_two_worker_processes_append_whole_anchors_to_one_file(
    tmp_path: Path, serves: list[Serve], keyed: str
) -> None:
    cfg = write_config(tmp_path, f'[audit]\nkey_env = "{ENV}"\nanchor_interval_seconds = 0.2\n')
    s = Serve(tmp_path, cfg, "--workers", "2")
    serves.append(s)
    s.wait_ready()
    path = tmp_path / "data" / "audit-anchors.jsonl"
    jobs: list[str] = []
    # a new connection each: the kernel spreads them over both workers (once both are up: on a
    # busy machine the second may start late, so go on until both have anchored, bounded)
    for i in range(400):
        job = f"j{i}"
        jobs.append(job)
        assert post(s, f"/v1/jobs/{job}/generations", {"generation": 2}) == 201
        body = {"adapter": "hook", "operation": "send", "payload": {}}
        assert post(s, f"/v1/jobs/{job}/effects/s", body, token=1) == 409
        if i >= 23 and i % 8 == 7:
            time.sleep(0.5)
            if path.exists():
                pids = {json.loads(line)["pid"] for line in path.read_text().splitlines()}
                if len(pids) == 2:
                    break
    time.sleep(0.6)
    assert s.stop(signal.SIGTERM) == 0
    out = s.output()
    assert KEY not in out

    text = path.read_text()
    assert KEY not in text
    lines = [json.loads(line) for line in text.splitlines()]  # every line whole
    assert {a["job_id"] for a in lines} == set(jobs)
    assert len({a["pid"] for a in lines}) == 2, "both workers anchored"
    assert all(a["mac"] == anchor_mac(a, KEY) for a in lines)
    assert out.count('"event":"audit_anchor"') == len(lines)  # the log line of each

    env = {**os.environ, ENV: KEY}
    verified = subprocess_run(["audit", "verify", "--config", str(cfg)], env, tmp_path)
    assert verified.returncode == 0, verified.stdout
    # per job its registration and one rejection
    n = len(jobs)  # 24 or more: until both workers had anchored
    assert f"{n} jobs, {2 * n} entries, intact; keyed (kid {key_id(KEY)})" in verified.stdout
    assert f"anchors: {len(lines)} checked" in verified.stdout
    # the gateway's own log is an anchor source too
    log = tmp_path / "serve.log"
    log.write_text(out)
    verified = subprocess_run(
        ["audit", "verify", "--config", str(cfg), "--anchors", str(log)], env, tmp_path
    )
    assert verified.returncode == 0 and f"anchors: {len(lines)} checked" in verified.stdout


def subprocess_run(args: list[str], env: dict[str, str], cwd: Path) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


# -- (e) no key ----------------------------------------------------------------------------


async def test_unkeyed_chain_is_said_to_be_unkeyed(
    make_gateway: Any, redis_sync: Any, redis_url: str
) -> None:
    gw = await gateway(make_gateway, key_env="")
    await rejections(gw, 2)
    newest_id = redis_sync.xrevrange(STREAM, count=1)[0][0]
    anchor = await anchored(anchor_file(gw), newest_id)
    assert "mac" not in anchor and anchor["kid"] == ""
    code, out = await verify(redis_url, "--anchors", str(anchor_file(gw)), key=None)
    assert code == 0, out
    assert "1 jobs, 3 entries, intact; unkeyed" in out
    assert "unkeyed chain: detects accidental damage only" in out
    assert "note: anchor MACs not checked (no key)" in out
