"""A real `fencegate serve` keeps its secrets and its Redis to itself: the embedded Redis never
listens on TCP (however long the data dir's path), and no secret is on a command line."""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from gateway.store import embedded
from gateway.store.embedded import EmbeddedRedis, find_redis_server, free_port
from tests.support.processes import Serve, alive, children_of, write_config


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _tcp_listen_inodes() -> set[str]:
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] == "0A":  # LISTEN
                    found.add(cols[9])
    return found


@pytest.fixture
def long_dir(tmp_path: Path) -> Path:
    deep = tmp_path
    while len(str(deep)) < 160:
        deep = deep / ("long-directory-name-" + "x" * 12)
    deep.mkdir(parents=True)
    return deep


def test_embedded_redis_never_listens_on_tcp_with_a_long_data_dir(
    long_dir: Path, serves: list[Serve]
) -> None:
    data_dir = long_dir / "data"
    assert len(str(data_dir / "redis.sock")) > 150
    cfg = write_config(long_dir)  # [redis] data_dir = <long_dir>/data
    s = Serve(long_dir, cfg)
    serves.append(s)
    s.wait_ready()
    redis_pid = s.redis_pid()
    assert alive(redis_pid)
    # no TCP listener of the Redis process at all
    assert not (_socket_inodes(redis_pid) & _tcp_listen_inodes()), "redis-server listens on TCP"
    # the socket was moved to a short private directory, recorded in the data dir
    sock = embedded.socket_of(data_dir)
    assert sock != data_dir.resolve() / "redis.sock" and len(str(sock)) <= 100
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
    # and the gateway works through it
    assert s.call("POST", "/v1/jobs/r/generations", {"generation": 3})[0] == 201
    assert s.call("GET", "/v1/jobs/r")[1]["fence"] == 3
    assert s.stop() == 0
    assert not sock.parent.exists(), "the private socket directory outlived the gateway"


def test_embedded_redis_with_short_data_dir_keeps_its_socket_there(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "d") as server:
        assert server.url == f"unix://{tmp_path.resolve() / 'd' / 'redis.sock'}"
        assert server.socket_path is not None
        assert not (_socket_inodes(server.process.pid) & _tcp_listen_inodes())  # type: ignore[union-attr]


@pytest.fixture
def redis_with_password(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A real redis-server on loopback with requirepass (given on stdin, not argv)."""
    password = "pw-" + secrets.token_hex(12)
    port = free_port()
    proc = subprocess.Popen(
        [find_redis_server(), "-", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "yes", "--appendfsync", "always", "--dir", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stdin is not None
    proc.stdin.write(f"requirepass {password}\n".encode())
    proc.stdin.close()
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    client.close()
    yield url, password
    proc.terminate()
    proc.wait()


def test_workers_get_the_redis_password_by_environment_not_argv(
    tmp_path: Path, serves: list[Serve], redis_with_password: tuple[str, str]
) -> None:
    url, password = redis_with_password
    cfg = write_config(tmp_path)
    cfg.write_text(cfg.read_text().replace("[redis]\n", f'[redis]\nurl = "{url}"\n', 1))
    init = [sys.executable, "-m", "gateway", "init", "--config", str(cfg)]
    assert subprocess.run(init, cwd=tmp_path, capture_output=True, timeout=60).returncode == 0
    s = Serve(tmp_path, cfg, "--workers", "2")
    serves.append(s)
    s.wait_ready()
    workers = children_of(s.proc.pid)
    assert len(workers) == 2
    for pid in [s.proc.pid, *workers]:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        assert password.encode() not in cmdline, f"the Redis password is on pid {pid}'s argv"
    assert s.call("POST", "/v1/jobs/r/generations", {"generation": 2})[0] == 201
    assert {s.call("GET", "/v1/jobs/r")[1]["fence"] for _ in range(10)} == {2}
    assert s.stop() == 0


def test_embedded_redis_password_is_not_on_its_command_line(tmp_path: Path) -> None:
    password = "pw-" + secrets.token_hex(12)
    with EmbeddedRedis(tmp_path / "ext", use_socket=False, password=password) as ext:
        assert ext.process is not None
        with open(f"/proc/{ext.process.pid}/cmdline", "rb") as f:
            assert password.encode() not in f.read()
        assert redis.Redis.from_url(ext.url).ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=ext.port).ping()
