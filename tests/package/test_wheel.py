"""The package as a user installs it: `python -m build`, then the wheel in a fresh venv.

The sdist and the wheel are built once per module the way `python -m build` makes them (the
wheel from the unpacked sdist, so a file the sdist forgets is missing from the wheel too). The
wheel is installed with its `embedded` extra into a new venv (no editable install, no
--system-site-packages; its dependencies come from PyPI through pip's cache), and every command
runs from a directory outside the repository with a clean environment (no PYTHONPATH), so the
source tree cannot stand in for anything the package forgot.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

import aiohttp
import pytest

import gateway
from gateway.store.embedded import free_port
from tests.conftest import Upstream

ROOT = Path(__file__).parents[2]

pytestmark = [pytest.mark.wheel, pytest.mark.slow, pytest.mark.timeout(600)]


def sources(package: str, pattern: str) -> set[str]:
    """Files of the source tree (as wheel paths) under `package` matching `pattern`."""
    base = ROOT / package
    return {
        f"{package}/{p.relative_to(base).as_posix()}"
        for p in base.rglob(pattern)
        if "__pycache__" not in p.parts
    }


@dataclass
class Built:
    sdist: Path
    wheel: Path


@dataclass
class Installed:
    venv: Path
    home: Path  # cwd for every command: outside the repository
    env: dict[str, str]
    install_seconds: float

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, cwd=self.home, env=self.env, capture_output=True, text=True, timeout=timeout
        )


def clone_like_copy(dest: Path) -> Path:
    """The files a fresh clone (plus uncommitted work) has: tracked and untracked files that
    .gitignore does not exclude, links kept as links. Building in the working tree would let
    leftovers (an old fencegate.egg-info from `pip install -e`, whose SOURCES.txt setuptools
    reads back) put files into the sdist that a clone would not get."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for raw in filter(None, listed):
        rel = raw.decode()
        src, dst = ROOT / rel, dest / rel
        if not src.is_symlink() and not src.exists():
            continue  # deleted in the working tree, not yet committed
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dst)
    return dest


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    src = clone_like_copy(tmp_path_factory.mktemp("clone"))
    out = tmp_path_factory.mktemp("dist")
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(f"\npython -m build (sdist, then the wheel from it): {time.monotonic() - t0:.1f} s")
    (sdist,) = out.glob("fencegate-*.tar.gz")
    (wheel,) = out.glob("fencegate-*-py3-none-any.whl")
    return Built(sdist, wheel)


@pytest.fixture(scope="module")
def installed(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("user")
    venv, home = base / "venv", base / "home"
    home.mkdir()
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", str(home)),  # pip's cache lives under it
        "LANG": "C.UTF-8",
    }
    proc = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-compile",
            f"fencegate[embedded] @ {built.wheel.as_uri()}",
        ],
        cwd=home,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seconds = time.monotonic() - t0
    print(f"\nfresh venv + pip install fencegate[embedded] from the wheel: {seconds:.1f} s")
    return Installed(venv, home, env, seconds)


def test_the_wheel_holds_every_module_script_and_data_file(built: Built) -> None:
    with zipfile.ZipFile(built.wheel) as whl:
        names = set(whl.namelist())
        meta = Parser().parsestr(
            whl.read(f"fencegate-{gateway.__version__}.dist-info/METADATA").decode()
        )
        entry_points = whl.read(f"fencegate-{gateway.__version__}.dist-info/entry_points.txt")
    lua = sources("gateway", "*.lua")
    assert lua and lua <= names, lua - names  # every Lua script of the source tree
    for package in ("gateway", "adapters"):
        modules = sources(package, "*.py")
        assert modules <= names, modules - names
        assert f"{package}/py.typed" in names
    for static in sources("gateway", "static/**/*") | sources("gateway", "templates/**/*"):
        assert static in names or not (ROOT / static).is_file(), static
    examples = {f"gateway/examples/{p.name}" for p in (ROOT / "config").iterdir()}
    assert {"gateway/examples/fencegate.example.toml", "gateway/examples/redis.conf"} <= examples
    assert examples <= names, examples - names
    for name in examples:  # the installed copies are the repository's files, not stale ones
        with zipfile.ZipFile(built.wheel) as whl:
            assert whl.read(name) == (ROOT / "config" / Path(name).name).read_bytes(), name
    assert not any(n.startswith(("tests/", "benchmarks/", "config/")) for n in names)
    # metadata: one version, the licence, who, what
    assert meta["Name"] == "fencegate" and meta["Version"] == gateway.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    assert f"fencegate-{gateway.__version__}.dist-info/licenses/LICENSE" in names
    assert meta["Author"] == "fencegate developers"
    assert meta["Requires-Python"] == ">=3.11"
    classifiers = meta.get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers
    assert "Programming Language :: Python :: 3.11" in classifiers
    assert meta["Keywords"] and "fencing token" in meta["Keywords"]
    assert "embedded" in (meta.get_all("Provides-Extra") or [])
    script = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert f"fencegate = {script['fencegate']}".encode() in entry_points


def test_the_sdist_builds_the_same_package(built: Built) -> None:
    prefix = f"fencegate-{gateway.__version__}/"
    with tarfile.open(built.sdist) as sdist:
        members = {m.name.removeprefix(prefix): m for m in sdist.getmembers()}
    for name in sources("gateway", "*.lua") | {"LICENSE", "README.md", "pyproject.toml"}:
        assert name in members, name
    example = members["gateway/examples/fencegate.example.toml"]
    assert example.isfile(), "the example config must be a real file in the sdist, not a link"


def test_installed_cli_version_and_example_config(installed: Installed) -> None:
    out = installed.run(installed.bin("fencegate"), "--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"fencegate {gateway.__version__}"
    # the package imported is the installed one, not this source tree
    probe = installed.run(
        installed.bin("python"),
        "-c",
        "import gateway, importlib.metadata as m, importlib.resources as r, json, sys;"
        "print(json.dumps({'file': gateway.__file__, 'version': m.version('fencegate'),"
        " 'example': str(r.files('gateway') / 'examples' / 'fencegate.example.toml'),"
        " 'path': sys.path}))",
    )
    assert probe.returncode == 0, probe.stderr
    facts = json.loads(probe.stdout)
    assert Path(facts["file"]).is_relative_to(installed.venv), facts["file"]
    assert facts["version"] == gateway.__version__
    assert not any(str(ROOT) in p for p in facts["path"] if p), facts["path"]
    example = Path(facts["example"])
    assert example.is_relative_to(installed.venv) and example.is_file()
    for config in (example, installed.home / "fencegate.toml"):
        if not config.exists():  # the way the README says: fencegate example-config > file
            printed = installed.run(installed.bin("fencegate"), "example-config")
            assert printed.returncode == 0, printed.stderr
            assert printed.stdout == (ROOT / "config" / "fencegate.example.toml").read_text()
            config.write_text(printed.stdout)
        check = installed.run(installed.bin("fencegate"), "check-config", str(config))
        assert check.returncode == 0, check.stdout + check.stderr
        ok = r": ok \(\d+ adapters, 0 upstreams, 0 keys, registration=required\)"
        assert re.search(ok, check.stdout)
    folder = installed.run(installed.bin("fencegate"), "example-config", "--path")
    assert Path(folder.stdout.strip()) == example.parent, folder.stdout + folder.stderr


async def test_installed_serve_register_and_effect(
    installed: Installed, upstream: Upstream, tmp_path: Path
) -> None:
    """`fencegate serve` from the venv, with the example config and the embedded Redis of the
    `embedded` extra: one registration, one effect delivered to a loopback receiver, one
    zombie refused, then SIGTERM stops it (and its Redis) cleanly."""
    folder = installed.run(installed.bin("fencegate"), "example-config", "--path")
    example = Path(folder.stdout.strip()) / "fencegate.example.toml"
    assert example.is_relative_to(installed.venv), example
    text = example.read_text()
    hook = 'url = "http://127.0.0.1:9000/hook"'
    assert text.count(hook) == 1, "the example's webhook adapter moved: update this test"
    config = installed.home / "fencegate.toml"
    config.write_text(text.replace(hook, f'url = "{upstream.url}"'))
    port = free_port()
    log = (tmp_path / "serve.log").open("w+")
    proc = await asyncio.create_subprocess_exec(
        installed.bin("fencegate"), "serve", "--config", str(config), "--port", str(port),
        cwd=installed.home, env=installed.env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip

    def output() -> str:
        log.flush()
        log.seek(0)
        return log.read()

    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(base) as http:
            deadline = time.monotonic() + 60
            while True:
                assert proc.returncode is None, output()
                assert time.monotonic() < deadline, "not ready: " + output()
                try:
                    async with http.get("/readyz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            for gen in (1, 2):
                async with http.post("/v1/jobs/r/generations", json={"generation": gen}) as r:
                    assert r.status == 201, await r.text()
            effect = {"adapter": "hook", "operation": "notify", "payload": {"to": "c@example.com"}}
            async with http.post(
                "/v1/jobs/r/effects/notify", json=effect, headers={"Fencing-Token": "2"}
            ) as r:
                body = await r.json()
                assert r.status == 200, body
            assert body["idempotency_key"] == "r:notify" and body["replayed"] is False
            async with http.post(
                "/v1/jobs/r/effects/notify", json=effect, headers={"Fencing-Token": "1"}
            ) as r:
                assert r.status == 409 and (await r.json())["code"] == "stale_generation"
        assert [x.headers["Idempotency-Key"] for x in upstream.received] == ["r:notify"]
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0, output()
        lines = [json.loads(x) for x in output().splitlines() if x.startswith("{")]
        events = [x.get("event") for x in lines]
        assert "embedded_redis_started" in events and "embedded_redis_stopped" in events
        # the embedded Redis is the `embedded` extra's binary, inside the venv
        assert (installed.venv / "bin" / "redis-server").is_file()
        assert (installed.home / ".fencegate").is_dir()  # data_dir of the example, in the cwd
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        log.close()
