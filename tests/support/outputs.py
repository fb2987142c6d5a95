"""The outputs tests' object store, file or S3, and their helpers (registered for every test
by ``pytest_plugins`` in tests/conftest.py).

``objects`` is parametrised over the local filesystem and a real S3-compatible server
(moto in server mode, one process per test session, a fresh bucket per test); ``ogw`` is
a gateway whose outputs go there. What a test asserts about the store it reads back
without the gateway (:class:`Objects`).
"""

from __future__ import annotations

import hashlib
import io
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.store.embedded import EmbeddedRedis
from tests.support.s3peer import MotoServer

JOB = "render-7"
KEY_ID_ENV, SECRET_ENV = "FG_TEST_S3_KEY_ID", "FG_TEST_S3_SECRET"


@pytest.fixture(scope="session")
def moto() -> Iterator[MotoServer]:
    server = MotoServer()
    server.start()
    yield server
    server.stop()


@dataclass
class Objects:
    """The object store under test, read back without the gateway."""

    kind: str
    section: dict[str, Any]
    root: Path | None = None
    moto: MotoServer | None = None
    bucket: str = ""
    prefix: str = ""

    def stored(self) -> dict[str, int]:
        """Every stored key (without the configured prefix) and its size."""
        if self.root is not None:
            return {
                str(p.relative_to(self.root)): p.stat().st_size
                for p in self.root.rglob("*")
                if p.is_file()
            }
        assert self.moto is not None
        keys = self.moto.keys(self.bucket, self.prefix)
        return {k[len(self.prefix) :]: size for k, size in keys.items()}

    def write(self, key: str, data: bytes) -> None:
        """Replace an object behind the gateway's back."""
        if self.root is not None:
            (self.root / key).write_bytes(data)
            return
        assert self.moto is not None
        self.moto.client().put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)

    def read(self, key: str) -> bytes:
        if self.root is not None:
            return (self.root / key).read_bytes()
        assert self.moto is not None
        return self.moto.get(self.bucket, self.prefix + key)


@pytest.fixture(params=["file", "s3"])
def objects(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Objects:
    if request.param == "file":
        root = tmp_path / "objects"
        return Objects("file", {"store": "file", "path": str(root)}, root=root)
    server: MotoServer = request.getfixturevalue("moto")
    bucket = "fg-" + uuid.uuid4().hex[:12]
    server.create_bucket(bucket)
    monkeypatch.setenv(KEY_ID_ENV, "testing")
    monkeypatch.setenv(SECRET_ENV, "testing")
    section = {
        "store": "s3",
        "bucket": bucket,
        "prefix": "outputs/",
        "endpoint": server.endpoint,
        "allow_http": True,
        "access_key_id_env": KEY_ID_ENV,
        "secret_access_key_env": SECRET_ENV,
    }
    return Objects("s3", section, moto=server, bucket=bucket, prefix="outputs/")


@pytest.fixture
async def ogw(make_gateway: Any, objects: Objects) -> Any:
    """A gateway whose outputs go to ``objects``; the sweeper runs only when a test says."""
    return await make_gateway(
        outputs={**objects.section, "sweep_interval_seconds": 0, "max_bytes": 1024 * 1024}
    )


async def register(gw: Any, job: str = JOB) -> int:
    resp = await gw.register(job)
    assert resp.status == 201, await resp.text()
    return int((await resp.json())["generation"])


async def put(
    gw: Any, token: int, data: Any, *, name: str = "report", job: str = JOB, **headers: str
) -> aiohttp.ClientResponse:
    h = {**gw.headers, "Fencing-Token": str(token), **headers}
    if isinstance(data, bytes) and len(data) > 512 * 1024:
        data = io.BytesIO(data)  # aiohttp warns about large raw bytes (its Content-Length stays)
    resp: aiohttp.ClientResponse = await gw.client.put(
        f"/v1/jobs/{job}/outputs/{name}", data=data, headers=h
    )
    return resp


async def complete(gw: Any, token: int, outputs: list[str], result: Any = None) -> Any:
    """The completion of :data:`JOB` by generation ``token`` naming ``outputs``."""
    return await gw.client.post(
        f"/v1/jobs/{JOB}/complete",
        json={"outputs": outputs, "result": result},
        headers={**gw.headers, "Fencing-Token": str(token)},
    )


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def metric(gw: Any, line_start: str) -> float:
    text = await (await gw.client.get("/metrics")).text()
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    return 0.0


def write_config(tmp_path: Path, redis_url: str, objects: Objects) -> Path:
    """A TOML config for a `fencegate` process on the same Redis and object store."""
    lines = [
        "[redis]",
        f'url = "{redis_url}"',
        f'data_dir = "{tmp_path / "state"}"',
        "auto_init = true",
        "[outputs]",
        *(
            f"{k} = {str(v).lower()}" if isinstance(v, bool) else f'{k} = "{v}"'
            for k, v in objects.section.items()
        ),
        "sweep_interval_seconds = 0",
    ]
    cfg = tmp_path / "outputs.toml"
    cfg.write_text("\n".join(lines) + "\n")
    return cfg


@pytest.fixture
async def own_redis(tmp_path: Path) -> AsyncIterator[EmbeddedRedis]:
    """A Redis of the test's own (killed, restarted, wiped by the test), not the session's."""
    server = EmbeddedRedis(tmp_path / "own-redis", use_socket=False)
    server.start()
    yield server
    server.stop()
