"""The peer: a minimal nginx + Lua gateway running fencegate's own admit script (rows P2, P3, P3f).

The peer answers ``POST /v1/jobs/{job}/effects/{step}`` for a replay and a stale call by
running ``admit-8`` — as :func:`gateway.store.scripts.lua_source` assembles it, SCRIPT LOADed
here — with EVALSHA against the bench's durable Redis, and renders the gateway's answers
byte for byte (``fencegate_peer.lua``). Port P3f also copies a rejection's audit entry to the
tenant's feed, as the gateway does — unless the admit script does so itself (its trailer names
the feed: ``feed_in_script``, a standalone Redis), and then P3 and P3f make the same calls.

Where its KEYS and ARGV come from: from the running gateway itself. :func:`capture` watches
Redis (``MONITOR``) while the gateway serves one probe call with unmistakable values (job, step,
generation, operation), and turns the admit's EVALSHA into a plan: every argument a list of
literal pieces and per-call slots (job, step, slot, gen, sha, rid, adapter, operation,
run_before). Whatever the gateway's store sends — the argument order, its trailer, the
registration mode, retention, the audit chain key — the peer sends the same; a layout the plan
cannot follow (a per-call value it does not know) fails :func:`capture` with
:class:`PlanError`, and the parity check (benchmarks/run.py) catches any answer that differs.

Needs Debian's ``nginx``, ``libnginx-mod-http-lua``, ``lua-nginx-redis`` (lua-resty-redis) and
``lua-cjson``: ``make bench-peer-deps`` installs them; :func:`missing` says what is absent.
"""

from __future__ import annotations

import asyncio
import glob
import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from gateway.core.intents import intent_digest
from gateway.store.keys import audit_feed, key_slot, slot_tags
from gateway.store.scripts import lua_source

HERE = Path(__file__).parent
TENANT = "default"  # an open gateway's tenant (no API keys configured)
MODULES = Path("/usr/lib/nginx/modules")
# the probe call's values: nothing else in an admit's arguments looks like them
PROBE_JOB, PROBE_STEP, PROBE_GEN, PROBE_OP = "peerprobeJ7q", "peerprobeS3k", "7919", "peerprobeOp"
PROBE_ADAPTER = "hook"


class PlanError(RuntimeError):
    """The gateway's admit call cannot be turned into the peer's plan."""


def missing() -> str | None:
    """Why the peer cannot run on this machine (None: it can)."""
    if shutil.which("nginx") is None:
        return "nginx is not installed"
    for name in ("ndk_http_module.so", "ngx_http_lua_module.so"):
        if not (MODULES / name).exists():
            return f"{MODULES / name} is missing (libnginx-mod-http-lua)"
    if not Path("/usr/share/lua/5.1/nginx/redis.lua").exists():
        return "lua-resty-redis is missing (Debian: lua-nginx-redis)"
    if not _cjson_dir():
        return "Lua cjson for 5.1 is missing (Debian: lua-cjson)"
    return None


def _cjson_dir() -> str | None:
    found = sorted(glob.glob("/usr/lib/*/lua/5.1/cjson.so"))
    return str(Path(found[0]).parent) if found else None


_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "a": "\a", "b": "\b", '"': '"', "\\": "\\"}


def monitor_args(line: str) -> list[str]:
    """The arguments of one MONITOR line (Redis's sdscatrepr quoting: \\" \\\\ \\n … \\xHH)."""
    out = []
    for raw in _QUOTED.findall(line.split("]", 1)[1]):
        text = re.sub(
            r"\\(x[0-9a-fA-F]{2}|.)",
            lambda m: chr(int(m[1][1:], 16)) if m[1][0] == "x" and len(m[1]) == 3
            else _ESCAPES.get(m[1], m[1]),
            raw,
        )  # fmt: skip
        out.append(text)
    return out


def template(args: list[str], t0_ms: float, t1_ms: float) -> tuple[list[list[Any]], int]:
    """The admit's EVALSHA arguments (after numkeys) as pieces; and the run-before offset."""
    sha = intent_digest(PROBE_ADAPTER, PROBE_OP, {"probe": 1})
    slot = "{{{}}}".format(slot_tags()[key_slot(f"{TENANT}/{PROBE_JOB}")])
    rids = [m[1] for a in args if (m := re.fullmatch(r"fg:\{.+\}:req:(.+)", a))]
    if len(rids) != 1:
        raise PlanError(f"no single request key among the admit's arguments: {args}")
    whole = {PROBE_GEN: "gen", sha: "sha", PROBE_OP: "operation", PROBE_ADAPTER: "adapter"}
    parts = {rids[0]: "rid", PROBE_JOB: "job", PROBE_STEP: "step", slot: "slot"}
    split = re.compile("(" + "|".join(re.escape(p) for p in sorted(parts, key=len)[::-1]) + ")")
    offset = None
    out: list[list[Any]] = []
    seen: set[str] = set()
    for arg in args:
        if arg in whole:
            out.append([[whole[arg]]])
            seen.add(whole[arg])
            continue
        if arg.isdigit() and t0_ms - 600_000 <= int(arg) <= t1_ms + 86_400_000 and len(arg) >= 13:
            offset = round((int(arg) - (t0_ms + t1_ms) / 2) / 1000) * 1000
            out.append([["run_before"]])
            seen.add("run_before")
            continue
        pieces: list[Any] = []
        for piece in split.split(arg):
            if piece in parts:
                name = parts[piece]
                pieces += ["{", [name], "}"] if name == "slot" else [[name]]
                seen.add(name)
            elif piece:
                pieces.append(piece)
        out.append(pieces or [""])
    lost = {"job", "step", "slot", "gen", "sha", "rid", "run_before"} - seen
    if lost or offset is None:
        raise PlanError(f"the admit's arguments carry no {sorted(lost)}: {args}")
    return out, offset


async def capture(redis_host: str, redis_port: int, gateway_port: int) -> dict[str, Any]:
    """Watch Redis while the gateway serves one probe effect call; its admit's EVALSHA, as a plan.

    The probe job is never registered: the gateway answers 409 unregistered_generation (audited
    under that job, nothing else touched)."""
    reader, writer = await asyncio.open_connection(redis_host, redis_port)
    writer.write(b"MONITOR\r\n")
    await writer.drain()
    assert (await reader.readline()).startswith(b"+OK")
    body = json.dumps({"adapter": PROBE_ADAPTER, "operation": PROBE_OP, "payload": {"probe": 1}})
    probe = urllib.request.Request(
        f"http://127.0.0.1:{gateway_port}/v1/jobs/{PROBE_JOB}/effects/{PROBE_STEP}",
        data=body.encode(), method="POST",
        headers={"Content-Type": "application/json", "Fencing-Token": PROBE_GEN},
    )  # fmt: skip
    t0 = time.time() * 1000

    def send() -> None:
        try:
            urllib.request.urlopen(probe, timeout=10).close()
        except urllib.error.HTTPError as exc:  # the 409 expected
            exc.close()

    sent = asyncio.get_running_loop().run_in_executor(None, send)
    admit: list[str] | None = None
    source = lua_source("admit-8")
    try:
        async with asyncio.timeout(15):
            while admit is None:
                line = (await reader.readline()).decode("utf-8", "replace")
                if '"EVALSHA"' in line.split("]", 1)[-1][:12] and PROBE_JOB in line:
                    args = monitor_args(line)
                    if args[0].upper() == "EVALSHA":
                        admit = args
            await sent
    finally:
        writer.close()
    t1 = time.time() * 1000
    _, sha, numkeys, *rest = admit
    pieces, offset = template(rest, t0, t1)
    return {"sha": sha, "numkeys": int(numkeys), "args": pieces, "run_before_offset_ms": offset,
            "script_source_chars": len(source)}  # fmt: skip


class Peer:
    """nginx with fencegate_peer.lua on two ports: ``port`` (P2, P3) and ``feed_port`` (P3f)."""

    def __init__(self, workdir: Path, plan: dict[str, Any], port: int, feed_port: int) -> None:
        self.prefix = workdir / "peer"
        for sub in ("", "body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.prefix / sub).mkdir(parents=True, exist_ok=True)
        conf = (HERE / "nginx.conf").read_text()
        for name, value in (("@PREFIX@", str(self.prefix)), ("@LUA@", str(HERE)),
                            ("@CPATH@", _cjson_dir() or ""), ("@PORT@", str(port)),
                            ("@FEED_PORT@", str(feed_port))):  # fmt: skip
            conf = conf.replace(name, value)
        (self.prefix / "nginx.conf").write_text(conf)
        (self.prefix / "plan.json").write_text(json.dumps(plan, indent=1))
        self.port, self.feed_port = port, feed_port
        self.process = subprocess.Popen(
            ["nginx", "-p", str(self.prefix), "-c", str(self.prefix / "nginx.conf"),
             "-e", str(self.prefix / "error.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        deadline = time.monotonic() + 15
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                    return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the peer did not start: {self.errors()}") from None
                time.sleep(0.05)

    def errors(self) -> str:
        log = self.prefix / "error.log"
        return log.read_text()[-2000:] if log.exists() else ""

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def load_script(client_url: str) -> str:
    """SCRIPT LOAD the admit as the store assembles it; its SHA1 (the gateway's, if the same)."""
    import redis

    client = redis.Redis.from_url(client_url)
    try:
        return str(client.script_load(lua_source("admit-8")))
    finally:
        client.close()


async def plan_for(
    redis_url: str, gateway_port: int, retention_seconds: int, capture_timeout: float = 20
) -> dict[str, Any]:
    """The peer's plan: SCRIPT LOAD the admit, capture the gateway's call, the feed's key."""
    host, port = re.fullmatch(r"redis://([^:/]+):(\d+).*", redis_url).groups()  # type: ignore[union-attr]
    sha = load_script(redis_url)
    plan = await asyncio.wait_for(capture(host, int(port), gateway_port), capture_timeout)
    if plan["sha"] != sha:
        raise PlanError(f"the gateway runs admit {plan['sha']}, lua_source gives {sha}")
    plan.update(redis_host=host, redis_port=int(port), tenant=TENANT, feed_key=audit_feed(TENANT),
                retention_ms=retention_seconds * 1000, slot_tags=list(slot_tags()))  # fmt: skip
    # the admit names the tenant feed in its trailer: the script copies a rejection there
    # itself (includes/feed), so the peer's P3f port must not copy it a second time
    plan["feed_in_script"] = [audit_feed(TENANT)] in plan["args"]
    return plan
