"""The README's curl walk-through, the examples and the compose file, executed and checked."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import sqlite3
import sys
from pathlib import Path
from typing import Any

import yaml

from gateway.runtime.settings import load_settings
from tests.conftest import Gateway, Upstream
from tests.support.docs import docs_text

ROOT = Path(__file__).parents[2]


def walkthrough() -> list[tuple[list[str], int]]:
    """(curl argv, expected status) for every command of the README's walk-through."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Walk-through with curl", 1)[1]
    block = section.split("```sh", 1)[1].split("```", 1)[0]
    logical: list[str] = []
    for line in block.splitlines():
        if logical and logical[-1].endswith("\\"):
            logical[-1] = logical[-1][:-1] + " " + line.strip()
        else:
            logical.append(line.strip())
    calls: list[tuple[list[str], int]] = []
    for i, line in enumerate(logical):
        if not line.startswith("curl "):
            continue
        expected = 200
        following = logical[i + 1] if i + 1 < len(logical) else ""
        m = re.match(r"# (\d{3})\b", following)
        if m:
            expected = int(m.group(1))
        calls.append((shlex.split(line), expected))
    return calls


async def run_curl(gw: Gateway, argv: list[str]) -> Any:
    method, headers, data, url = "GET", {}, None, ""
    args = iter(argv[1:])
    for a in args:
        if a in ("-s", "-i"):
            continue
        if a.startswith("-X"):
            method = a[2:] or next(args)
        elif a == "-H":
            k, v = next(args).split(":", 1)
            headers[k.strip()] = v.strip()
        elif a == "-d":
            data = next(args)
            method = "POST" if method == "GET" else method
        else:
            url = a
    path = url.replace("$B", "")
    return await gw.client.request(method, path, data=data, headers=headers)


async def test_readme_walkthrough_status_codes(gw: Gateway, upstream: Upstream) -> None:
    calls = walkthrough()
    assert len(calls) >= 7
    for argv, expected in calls:
        resp = await run_curl(gw, argv)
        assert resp.status == expected, (argv, await resp.text())
    assert len(upstream.received) == 1  # one notification, despite the zombie and the retry


async def run(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=ROOT, env=env
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_sdk_worker_example(gw: Gateway, upstream: Upstream, tmp_path: Path) -> None:
    url = str(gw.client.make_url("")).rstrip("/")
    db = tmp_path / "jobs.sqlite"
    code, out = await run(
        sys.executable, "examples/sdk_worker.py", "--gateway", url, "--db", str(db),
        "--enqueue", "order-1", "--enqueue", "order-2",
    )  # fmt: skip
    assert code == 0, out
    assert out.split() == ["done", "done"]
    assert sorted(r.headers["Idempotency-Key"] for r in upstream.received) == [
        "order-1:notify",
        "order-2:notify",
    ]
    with sqlite3.connect(db) as conn:
        assert conn.execute(
            "SELECT job_id, attempt, state FROM jobs ORDER BY job_id"
        ).fetchall() == [
            ("order-1", 1, "succeeded"),
            ("order-2", 1, "succeeded"),
        ]
    for job in ("order-1", "order-2"):  # completed in the gateway too, by attempt 1
        view = await (await gw.client.get(f"/v1/jobs/{job}")).json()
        assert view["completion"]["generation"] == 1
        assert view["checkpoints"]["progress"]["generation"] == 1


async def test_curl_flow_example(gw: Gateway, upstream: Upstream, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "GATEWAY": str(gw.client.make_url("")).rstrip("/"),
        "DB": str(tmp_path / "j.sqlite"),
    }
    code, out = await run("bash", "examples/curl_flow.sh", "c", env=env)
    assert code == 0, out
    assert "claimed c as generation 1" in out and out.strip().endswith("done")
    # the job is done: a second run claims nothing
    code, out = await run("bash", "examples/curl_flow.sh", "c", env=env)
    assert code == 0 and "nothing to claim" in out
    # a takeover registers generation 2: a zombie still holding 1 is refused
    await gw.register("c", generation=2)
    zombie = await gw.effect(
        "c", "notify", 1, operation="order.shipped", payload={"message": "your order shipped"}
    )
    assert zombie.status == 409 and (await zombie.json())["code"] == "stale_generation"
    assert [r.headers["Idempotency-Key"] for r in upstream.received] == ["c:notify"]


def test_compose_file_is_consistent() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "gateway", "receiver"} <= set(services)
    assert any(p.endswith(":8080") for p in services["gateway"]["ports"])
    for svc in services.values():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).is_file(), source
    gw_cfg = next(
        v.split(":")[0] for v in services["gateway"]["volumes"] if v.endswith("fencegate.toml:ro")
    )
    env = services["gateway"]["environment"]
    os.environ.update({k: v for k, v in env.items()})
    try:
        settings = load_settings(ROOT / gw_cfg)
    finally:
        for k in env:
            os.environ.pop(k, None)
    assert settings.redis.url.startswith("redis://redis:")
    assert settings.adapters["hook"]["url"].startswith("http://receiver:9000/")
    assert settings.auth.keys, "the compose gateway binds 0.0.0.0, so it must have keys"
    assert {k.key_env for k in settings.auth.keys} <= set(env)
    redis_conf = (ROOT / "config" / "redis.conf").read_text().split("\n")
    for line in ("appendonly yes", "appendfsync always", "maxmemory-policy noeviction"):
        assert line in redis_conf
    assert (ROOT / "Dockerfile").is_file()
    # the state file outlives the container: a wiped Redis is never taken for a new one
    assert settings.redis.auto_init is False
    assert f"fencegate-state:{settings.redis.data_dir}" in services["gateway"]["volumes"]
    assert "fencegate-state" in compose["volumes"]
    assert f"mkdir -p {settings.redis.data_dir}" in (ROOT / "Dockerfile").read_text()
    # the one-time init shares that state, and `docker compose up` does not run it
    init = services["init"]
    assert init["profiles"] == ["init"] and init["command"][0] == "init"
    assert f"fencegate-state:{settings.redis.data_dir}" in init["volumes"]
    assert "docker compose run --rm init" in docs_text()


def test_docs_link_only_inside_the_repository_or_to_public_urls() -> None:
    """Every relative link of the README and docs/ resolves to a file of this repository (and
    its #anchor to a heading there); nothing points outside the tree (a clone has no ../shared)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

    def anchors(page: Path) -> set[str]:
        heads = re.findall(r"^#{1,6} (.*)$", page.read_text(), flags=re.M)
        return {re.sub(r"[^a-z0-9 \-]", "", h.lower()).replace(" ", "-") for h in heads}

    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if ROOT.resolve() not in dest.parents and dest != ROOT.resolve():
                broken.append(f"{page.name}: {target} (outside the repository)")
            elif not dest.exists():
                broken.append(f"{page.name}: {target} (missing)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_docs_site_covers_every_page_and_readme_points_into_it() -> None:
    """mkdocs.yml's nav lists every page of docs/ (and nothing else), the README links to each
    page, carries the architecture diagram as Mermaid, and names no file outside the tree."""
    config = yaml.safe_load(re.sub(r"!!python/name:\S+", "null", (ROOT / "mkdocs.yml").read_text()))
    assert config["docs_dir"] == "docs" and config["site_dir"] == "site"
    nav = {next(iter(entry.values())) for entry in config["nav"]}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert nav == pages
    readme = (ROOT / "README.md").read_text()
    for page in pages - {"index.md"}:
        assert f"](docs/{page})" in readme, page
    assert "```mermaid\nflowchart" in readme
    assert "site/" in (ROOT / ".gitignore").read_text().split()
    for text in (readme, docs_text()):
        assert "SPEC" not in text and "../shared" not in text
    # nor does the code send a reader to a contract file that a clone does not have
    code = [
        p
        for folder in ("gateway", "adapters", "tests", "benchmarks", "examples", "config")
        for p in (ROOT / folder).rglob("*")
        if p.suffix in {".py", ".lua", ".toml", ".conf", ".sh"} and p != Path(__file__)
    ]
    outside = [p for p in code if re.search(r"\bSPEC\b|\.\./shared", p.read_text())]
    assert not outside, outside


def test_contract_lists_every_problem_code_with_its_status() -> None:
    """docs/contract.md's outcome table has a row for every code the gateway can answer with,
    at the status it is answered with (a new error class without a row fails here)."""
    import gateway.core.errors as errors

    contract = (ROOT / "docs" / "contract.md").read_text()
    rows = set(re.findall(r"^\| (\d{3}) \| `([a-z_]+)` \|", contract, flags=re.M))
    expected = {
        (str(cls.status), cls.code)
        for cls in vars(errors).values()
        if isinstance(cls, type)
        and issubclass(cls, errors.FencegateError)
        and cls
        not in (
            errors.FencegateError,
            errors.Rejection,
            errors.Superseded,
            errors.TryLater,
            errors.GatewayUnreachable,
        )
    }
    expected |= {("504", "outcome_unknown"), ("503", "too_many_connections")}
    assert expected <= rows, expected - rows
    assert rows <= expected, rows - expected


async def test_example_config_command_prints_the_checked_example(tmp_path: Path) -> None:
    """`fencegate example-config > fencegate.toml` (README) gives the repository's example,
    and that file passes check-config; --path names the folder that holds all examples."""
    code, out = await run(sys.executable, "-m", "gateway", "example-config")
    assert code == 0 and out == (ROOT / "config" / "fencegate.example.toml").read_text()
    config = tmp_path / "fencegate.toml"
    config.write_text(out)
    code, out = await run(sys.executable, "-m", "gateway", "check-config", str(config))
    assert code == 0 and ": ok (" in out, out
    code, out = await run(sys.executable, "-m", "gateway", "example-config", "--path")
    folder = Path(out.strip())
    assert code == 0, out
    assert (folder / "redis.conf").read_bytes() == (ROOT / "config" / "redis.conf").read_bytes()
