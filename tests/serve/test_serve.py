"""`fencegate serve` as a real process: embedded durable Redis, restarts, no orphans, refusals."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.store.embedded import EmbeddedRedis
from tests.support.processes import Serve, alive, children_of, init, wait_dead, write_config


def test_fence_survives_gateway_restart_and_redis_stops_with_it(
    tmp_path: Path, serves: list[Serve]
) -> None:
    cfg = write_config(tmp_path)
    first = Serve(tmp_path, cfg)
    serves.append(first)
    first.wait_ready()
    assert first.call("POST", "/v1/jobs/r/generations", {"generation": 3})[0] == 201
    redis_pid = first.redis_pid()
    assert alive(redis_pid)
    assert first.stop(signal.SIGTERM) == 0
    assert wait_dead(redis_pid), "embedded redis-server outlived the gateway"

    second = Serve(tmp_path, cfg)
    serves.append(second)
    second.wait_ready()
    status, job = second.call("GET", "/v1/jobs/r")
    assert status == 200 and job["fence"] == 3
    status, body = second.call(
        "POST",
        "/v1/jobs/r/effects/s",
        {"adapter": "hook", "operation": "x", "payload": {}},
        {"Fencing-Token": "2", "Content-Type": "application/json"},
    )
    assert (status, body["code"], body["current"]) == (409, "stale_generation", 3)
    redis_pid = second.redis_pid()
    assert second.stop(signal.SIGINT) == 0
    assert wait_dead(redis_pid)


@pytest.mark.parametrize("choice", ["auto", "asyncio"])
def test_event_loop_choice_and_json_log_lines(
    tmp_path: Path, serves: list[Serve], choice: str
) -> None:
    """uvloop when installed (auto), asyncio's loop on request; either way the log is JSON
    lines (rendered by orjson) with one complete canonical line per request."""
    s = Serve(tmp_path, write_config(tmp_path, f"[server]\nevent_loop = '{choice}'"))
    serves.append(s)
    s.wait_ready()
    assert s.call("POST", "/v1/jobs/loop/generations", {"generation": 1})[0] == 201
    assert s.call("POST", "/v1/jobs/loop/fence", headers={"Fencing-Token": "1"})[0] == 200
    assert s.stop() == 0
    events = [json.loads(line) for line in s.output().splitlines() if line.startswith("{")]
    (listening,) = [e for e in events if e["event"] == "listening"]
    installed = importlib.util.find_spec("uvloop") is not None
    assert listening["event_loop"] == ("uvloop" if choice == "auto" and installed else "asyncio")
    requests = [e for e in events if e["event"] == "request" and e["path"].startswith("/v1/")]
    assert [(e["status"], e["job_id"], e.get("generation")) for e in requests] == [
        (201, "loop", 1),
        (200, "loop", 1),
    ]
    assert all(e["level"] == "info" and e["timestamp"].endswith("Z") for e in requests)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_sigkilled_gateway_leaves_no_orphan_redis(tmp_path: Path, serves: list[Serve]) -> None:
    s = Serve(tmp_path, write_config(tmp_path))
    serves.append(s)
    s.wait_ready()
    redis_pid = s.redis_pid()
    s.stop(signal.SIGKILL)
    assert wait_dead(redis_pid), "redis-server survived a SIGKILLed gateway"


def test_second_gateway_on_same_data_dir_is_refused(tmp_path: Path, serves: list[Serve]) -> None:
    cfg = write_config(tmp_path)
    first = Serve(tmp_path, cfg)
    serves.append(first)
    first.wait_ready()
    second = Serve(tmp_path, cfg)
    serves.append(second)
    assert second.proc.wait(20) == 1
    assert "two Redis servers must never share one AOF" in second.output()


def test_refuses_public_bind_without_keys(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--config",
            str(write_config(tmp_path)),
            "--host",
            "0.0.0.0",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
    )
    assert out.returncode == 3
    assert "not a loopback address" in out.stderr


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ("[server]\nportt = 1", "server.portt"),
        ("[server]\nport = 'abc'", "server.port"),
        ("[fencing]\nregistration = 'sometimes'", "fencing.registration"),
        ("[adapters.x]\ntype = 'webhook'\nurl = 'not a url'", "adapters.x.url"),
        ("[adapters.y]\ntype = 'carrier-pigeon'", "carrier-pigeon"),
        ("[server]\nevent_loop = 'trio'", "server.event_loop"),
        (
            "[upstreams.p]\nbase_url = 'http://10.0.0.1'\nroutes = ['POST /x']",
            "upstreams.p.base_url",
        ),
        (
            "[upstreams.p]\nbase_url = 'https://example.com'\nroutes = ['TRACE /x']",
            "upstreams.p.routes",
        ),
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, extra: str, needle: str) -> None:
    cfg = write_config(tmp_path, extra)
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2, out
    assert needle in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
    )
    assert out.returncode == 2 and needle in out.stderr


def test_env_overrides_file(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "FENCEGATE_FENCING__REGISTRATION": "implicit",
        "FENCEGATE_SERVER__PORTT": "1",
    }
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", str(write_config(tmp_path))],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    # an unknown key from the environment is an error too
    assert out.returncode == 2 and "portt" in out.stderr
    env.pop("FENCEGATE_SERVER__PORTT")
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", str(write_config(tmp_path))],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert out.returncode == 0 and "registration=implicit" in out.stdout


def test_external_redis_must_be_durable(tmp_path: Path, serves: list[Serve]) -> None:
    volatile = EmbeddedRedis(tmp_path / "volatile", use_socket=False)
    volatile.start()
    try:
        import redis

        c = redis.Redis.from_url(volatile.url)
        c.config_set("appendonly", "no")
        c.config_set("maxmemory-policy", "allkeys-lru")
        c.close()
        cfg = write_config(tmp_path)
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway",
                "serve",
                "--config",
                str(cfg),
                "--redis-url",
                volatile.url,
            ],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=tmp_path,
        )
        assert out.returncode == 3
        assert "appendonly" in out.stderr and "maxmemory-policy" in out.stderr
        init(cfg, tmp_path, "--redis-url", volatile.url)  # an external Redis: init once
        s = Serve(tmp_path, cfg, "--redis-url", volatile.url, "--allow-volatile-redis")
        serves.append(s)
        s.wait_ready()
        assert "REDIS_NOT_DURABLE" in s.output()
        assert s.stop() == 0
    finally:
        volatile.stop()


def test_external_redis_with_appendfsync_everysec_is_refused(
    tmp_path: Path, serves: list[Serve]
) -> None:
    """appendonly yes is not enough: with appendfsync everysec a crash of the host loses the
    last second of acknowledged writes (a registration, a recorded outcome)."""
    server = EmbeddedRedis(tmp_path / "everysec", use_socket=False)
    server.start()
    try:
        import redis

        c = redis.Redis.from_url(server.url, decode_responses=True)
        c.config_set("appendfsync", "everysec")  # appendonly yes, noeviction: all else durable
        assert c.config_get("appendonly")["appendonly"] == "yes"
        c.close()
        cfg = write_config(tmp_path)
        out = subprocess.run(
            [sys.executable, "-m", "gateway", "serve", "--config", str(cfg),
             "--redis-url", server.url],
            capture_output=True, text=True, timeout=30, cwd=tmp_path,
        )  # fmt: skip
        assert out.returncode == 3, out.stderr
        refusal = next(
            json.loads(line) for line in out.stderr.splitlines() if "redis_not_durable" in line
        )
        assert refusal["detail"].startswith("appendfsync is 'everysec' (need 'always'): ")
        # the operator's explicit waiver starts it, loudly
        init(cfg, tmp_path, "--redis-url", server.url)
        s = Serve(tmp_path, cfg, "--redis-url", server.url, "--allow-volatile-redis")
        serves.append(s)
        s.wait_ready()
        assert "REDIS_NOT_DURABLE" in s.output() and "appendfsync" in s.output()
        assert s.stop() == 0
    finally:
        server.stop()


def test_init_command(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)

    def run(*a: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gateway", "init", "--config", str(cfg), *a],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )

    first = run()
    assert first.returncode == 0 and "initialised" in first.stdout
    assert run().stdout.startswith("already initialised")
    # wipe the embedded Redis's data: the state file remembers it was initialised
    for f in (tmp_path / "data").glob("appendonly*"):
        if f.is_dir():
            import shutil

            shutil.rmtree(f)
        else:
            f.unlink()
    refused = run()
    assert refused.returncode == 3 and "--confirm-data-loss" in refused.stdout
    assert run("--confirm-data-loss").returncode == 0


def test_workers_share_the_port_and_one_redis(tmp_path: Path, serves: list[Serve]) -> None:
    s = Serve(tmp_path, write_config(tmp_path), "--workers", "2")
    serves.append(s)
    s.wait_ready()
    redis_pid = s.redis_pid()
    workers = [p for p in children_of(s.proc.pid) if p != redis_pid]
    assert len(workers) == 2
    assert s.call("POST", "/v1/jobs/r/generations", {"generation": 4})[0] == 201
    statuses = {s.call("GET", "/v1/jobs/r")[1]["fence"] for _ in range(40)}
    assert statuses == {4}  # every worker process sees the same Redis
    assert s.stop(signal.SIGTERM) == 0
    assert all(wait_dead(p) for p in workers)
    assert wait_dead(redis_pid), "embedded redis-server outlived the workers"


def test_second_sigterm_cuts_the_grace_short_and_records_unknown(
    tmp_path: Path, serves: list[Serve]
) -> None:
    import socket
    import threading

    hang = socket.socket()  # a "downstream" that accepts the request and never answers
    hang.bind(("127.0.0.1", 0))
    hang.listen(8)
    slow_url = f"http://127.0.0.1:{hang.getsockname()[1]}/x"
    extra = (
        "[server]\nshutdown_grace_seconds = 60\n"
        f'[adapters.slow]\ntype = "webhook"\nurl = "{slow_url}"\ntimeout_seconds = 120\n'
    )
    cfg = write_config(tmp_path, extra)
    s = Serve(tmp_path, cfg)
    serves.append(s)
    s.wait_ready()
    assert s.call("POST", "/v1/jobs/r/generations", {"generation": 1})[0] == 201
    body = {"adapter": "slow", "operation": "x", "payload": {}}
    headers = {"Fencing-Token": "1", "Content-Type": "application/json"}

    def call() -> None:
        with contextlib.suppress(OSError):  # cut short: the caller gets no answer
            s.call("POST", "/v1/jobs/r/effects/s", body, headers)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    conn, _ = hang.accept()  # the dispatch is in flight
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert s.proc.poll() is None, "the first SIGTERM must wait for in-flight dispatches"
    started = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(15) == 0
    assert time.monotonic() - started < 10
    conn.close()
    hang.close()
    with EmbeddedRedis(tmp_path / "data") as redis_after:
        import redis as redis_lib

        c = redis_lib.Redis.from_url(redis_after.url, decode_responses=True)
        effect = c.hgetall("fg:{default/r}:fx:s")
        c.close()
    assert effect["state"] == "unknown" and "shut down" in effect["error"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_sigkilled_supervisor_leaves_no_orphan_workers(tmp_path: Path, serves: list[Serve]) -> None:
    s = Serve(tmp_path, write_config(tmp_path), "--workers", "2")
    serves.append(s)
    s.wait_ready()
    kids = children_of(s.proc.pid)
    assert len(kids) == 3  # two workers and the embedded Redis
    s.stop(signal.SIGKILL)
    # a worker drains first (SIGTERM); /readyz answered from one worker, so the other may
    # still be starting (its signal lands in its app's start-up: tests/serve/test_shutdown.py)
    survivors = [p for p in kids if not wait_dead(p, 30)]
    assert not survivors, (
        "outlived a SIGKILLed supervisor: "
        + subprocess.run(["ps", "-o", "pid,stat,etime,args", "-p", ",".join(map(str, survivors))],
                         capture_output=True, text=True).stdout
        + "\n" + s.output()[-4000:]
    )  # fmt: skip
