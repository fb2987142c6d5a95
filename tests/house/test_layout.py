"""The layout of gateway/ stays readable: modules a reader can hold in mind, layers that only
import downwards (the import-linter contracts in pyproject.toml, run by `make lint`), modules that
meet at public seams (nobody uses another module's private names), and an SDK that does not drag
the server in."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
# A soft guideline, not a cut: a module owns one concept and may need the room; past this
# bound it probably holds two. (module -> why it may be longer: a reason, not a silent bump)
MAX_LINES = 800
EXCEPTIONS: dict[str, str] = {}


def test_no_module_passes_the_size_bound() -> None:
    sources = sorted((ROOT / "gateway").rglob("*.py")) + sorted((ROOT / "adapters").rglob("*.py"))
    assert len(sources) > 40
    long = {
        str(p.relative_to(ROOT)): n
        for p in sources
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
        and str(p.relative_to(ROOT)) not in EXCEPTIONS
    }
    assert long == {}, f"split these modules (or list them in EXCEPTIONS with a reason): {long}"


def test_the_formatters_layout_holds_everywhere() -> None:
    """No ``# fmt: skip`` in gateway/ or adapters/: with no line cap to fit, a statement
    keeps the layout ``ruff format`` gives it."""
    sources = sorted((ROOT / "gateway").rglob("*.py")) + sorted((ROOT / "adapters").rglob("*.py"))
    skipped = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sources
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if "fmt: " + "skip" in line or "fmt: " + "off" in line
    ]
    assert skipped == []


def test_every_layer_is_a_package_named_for_what_it_holds() -> None:
    layers = {p.name for p in (ROOT / "gateway").iterdir() if (p / "__init__.py").exists()}
    assert {"cli", "http", "fencing", "store", "objects", "runtime", "core", "client"} <= layers
    flat = {p.name for p in (ROOT / "gateway").glob("*.py")}
    assert flat == {"__init__.py", "__main__.py", "downstream.py"}, flat


def test_the_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    run = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
    declared = len(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    )
    assert "0 broken" in run.stdout and f"{declared} kept" in run.stdout  # every one checked


def _redis_contract() -> dict[str, object]:
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c.get("id") == "redis-in-store")


def test_no_redis_outside_the_store_covers_every_package_but_the_store_and_the_cli() -> None:
    contract = _redis_contract()
    assert contract["type"] == "forbidden" and contract["forbidden_modules"] == ["redis"]
    packages = {
        f"gateway.{p.name}" for p in (ROOT / "gateway").iterdir() if (p / "__init__.py").exists()
    }
    sources = contract["source_modules"]
    assert isinstance(sources, list)
    assert set(sources) == packages - {"gateway.store", "gateway.cli"}


def test_no_redis_outside_the_store_fails_on_a_planted_import(tmp_path: Path) -> None:
    """A copy of the tree with one redis import planted above the store: the contract breaks
    and names the module; the same copy without it keeps the contract."""
    import shutil

    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for tree in ("gateway", "adapters"):
        shutil.copytree(ROOT / tree, tmp_path / tree, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    lint = [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"]
    lint += ["--contract", "redis-in-store"]

    def run() -> subprocess.CompletedProcess[str]:
        # the copy comes first on the path: lint-imports must read it, not the installed tree
        env = {"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(tmp_path)}
        return subprocess.run(
            lint, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )

    clean = run()
    assert clean.returncode == 0, clean.stdout + clean.stderr
    quotas = tmp_path / "gateway" / "fencing" / "quotas.py"
    source = quotas.read_text(encoding="utf-8")
    planted = source.replace(
        "import structlog\n", "import structlog\nfrom redis.exceptions import RedisError\n", 1
    )
    assert planted != source
    quotas.write_text(planted, encoding="utf-8")
    broken = run()
    assert broken.returncode != 0
    assert "gateway.fencing.quotas -> redis" in broken.stdout, broken.stdout + broken.stderr


def test_the_sdk_imports_without_the_servers_dependencies() -> None:
    code = (
        "import sys; import gateway.client, gateway.downstream; "
        "server = {'redis', 'pydantic', 'pydantic_settings', 'structlog', 'prometheus_client', "
        "'gateway.store', 'gateway.http', 'gateway.fencing', 'gateway.runtime'}; "
        "loaded = sorted(m for m in server if m in sys.modules and m != 'redis'); "
        "print(loaded)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
    sdk = subprocess.run(
        [sys.executable, "-c", "import sys, gateway.client; print('redis' in sys.modules)"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert sdk.stdout.strip() == "False", sdk.stderr


def test_public_import_paths_keep_working() -> None:
    """What users import: the SDK, target-side fencing, the adapter base, the entry point group."""
    from importlib.metadata import entry_points

    import adapters.base as base
    import adapters.registry as registry
    import gateway.client as sdk
    import gateway.downstream as downstream

    for name in ("Scheduler", "FencedJob", "SyncScheduler", "SyncFencedJob", "StaleGeneration"):
        assert name in sdk.__all__ and hasattr(sdk, name)
    for name in ("MemoryFenceKeeper", "RedisFenceKeeper", "fencing_middleware"):
        assert hasattr(downstream, name)
    for name in ("Adapter", "EffectRequest", "Delivered", "NotDelivered", "Unknown", "Failed"):
        assert hasattr(base, name)
    assert sdk.StaleGeneration is __import__("gateway.core.errors").core.errors.StaleGeneration
    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("fencegate") == "gateway.cli.main:main"
    # third-party adapters register here (exercised with a real dist-info in
    # tests/adapters/test_downstream_and_registry.py)
    assert registry.ENTRY_POINT_GROUP == "fencegate.adapters"


def test_each_scripts_name_says_how_many_keys_it_takes() -> None:
    """``admit-8`` takes six KEYS (before the prelude's trailer): the name is the contract a
    reader checks the store's call against."""
    import re

    from gateway.store.scripts import SCRIPT_NAMES

    lua = ROOT / "gateway" / "store" / "lua"
    assert {p.stem for p in lua.glob("*-*.lua")} == set(SCRIPT_NAMES)
    for name in SCRIPT_NAMES:
        used = {int(k) for k in re.findall(r"KEYS\[(\d+)\]", (lua / f"{name}.lua").read_text())}
        assert used == set(range(1, int(name.rsplit("-", 1)[1]) + 1)), name


def test_no_lua_is_written_in_a_python_string() -> None:
    """The store's scripts are files under gateway/store/lua/ (the fenced ones, and lua/plain/
    for those without the prelude), shared code through includes: no ``redis.call(`` in a
    Python module. gateway.downstream is the exception: the target-side helper ships alone,
    without the store (the SDK's import contract)."""
    found = [
        rel
        for path in sorted((ROOT / "gateway").rglob("*.py"))
        if (rel := path.relative_to(ROOT).as_posix()) != "gateway/downstream.py"
        and "redis.call(" in path.read_text(encoding="utf-8")
    ]
    assert found == [], f"move the Lua into gateway/store/lua/: {found}"


def script_calls(root: Path) -> dict[str, list[str]]:
    """Each script name a module of gateway/ sends through the link (``run_script`` /
    ``run_bounded`` with the name written out), and where: ``module:line``."""
    calls: dict[str, list[str]] = {}
    for path in sorted((root / "gateway").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("run_script", "run_bounded")
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                where = f"{path.relative_to(root).as_posix()}:{node.lineno}"
                calls.setdefault(str(node.args[0].value), []).append(where)
    return calls


def test_each_script_has_one_call_site_in_the_store() -> None:
    """One owner per script: a method that builds its KEYS and ARGV, in the store module of
    its concept (docs/architecture.md, "The store boundary"), and no second caller."""
    from gateway.store.scripts import SCRIPT_NAMES

    calls = script_calls(ROOT)
    assert set(calls) == set(SCRIPT_NAMES), set(calls) ^ set(SCRIPT_NAMES)
    for name, sites in calls.items():
        assert len(sites) == 1 and sites[0].startswith("gateway/store/"), (name, sites)


# Attributes that start with an underscore and are public all the same: expression -> why.
PUBLIC_UNDERSCORED: dict[str, str] = {
    "os._exit": "the standard library's exit without finalisation (documented, public)",
    "sys._current_frames": "the standard library's frames of every thread (documented, public)",
}
# A dependency's internal, used where it offers no public seam: each named with why, and held
# by a test that fails when the dependency changes it.
THIRD_PARTY_INTERNALS: dict[str, str] = {
    "request._match_info": "aiohttp: what Application._handle sets after routing; the hot lane "
    "(gateway.http.hotlane) sets it for the two routes it serves without the router "
    "(tests/http/test_hot_lane.py)",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_access(source: str) -> list[tuple[int, str, str]]:
    """Every use in ``source`` of a private name that is not its own, as (line, name, code):
    ``from m import _name``, and ``x._attr`` on anything but ``self`` or ``cls`` (another
    module, another object, ``super()``). Dunders are public; so is :data:`PUBLIC_UNDERSCORED`;
    :data:`THIRD_PARTY_INTERNALS` are allowed, each for its reason."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            found += [
                (node.lineno, alias.name, f"from {node.module} import {alias.name}")
                for alias in node.names
                if _private(alias.name)
            ]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            code = ast.unparse(node)
            if code not in PUBLIC_UNDERSCORED and code not in THIRD_PARTY_INTERNALS:
                found.append((node.lineno, node.attr, code))
    return sorted(found)


def test_the_private_access_check_finds_each_kind_of_use() -> None:
    planted = (
        "from gateway.store.scripts import _oom, lua_source\n"
        "import os\n"
        "class Reader:\n"
        "    def __init__(self, store):\n"
        "        self._store = store\n"
        "    async def read(self, other):\n"
        "        self._store.__class__\n"
        "        await self._store._run('x')\n"
        "        other._cache.clear()\n"
        "        super()._read()\n"
        "        return cls._count, os._exit\n"
    )
    assert private_access(planted) == [
        (1, "_oom", "from gateway.store.scripts import _oom"),
        (8, "_run", "self._store._run"),
        (9, "_cache", "other._cache"),
        (10, "_read", "super()._read"),
    ]


def test_no_module_uses_another_modules_private_names() -> None:
    sources = sorted((ROOT / "gateway").rglob("*.py"))
    assert len(sources) > 40
    found = [
        f"{path.relative_to(ROOT)}:{line}: {code}"
        for path in sources
        for line, _, code in private_access(path.read_text(encoding="utf-8"))
    ]
    assert found == [], "use a public name (or give the owner a public seam):\n" + "\n".join(found)


# Where the raw Redis client (a store's or its link's ``.client``) may be read: inside the store,
# and where the "redis-in-store" import contract allows redis (the CLI's admin paths, the
# target-side helper). Above the store, the store hands out its parts instead.
CLIENT_READERS = ("gateway/store/", "gateway/cli/", "gateway/downstream.py")


def client_reads(source: str) -> list[tuple[int, str]]:
    """Every read of a ``.client`` attribute in ``source``, as (line, code), whatever it is
    read on: above the store no object has a client to hand out but the store."""
    return sorted(
        (node.lineno, ast.unparse(node))
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and node.attr == "client"
    )


def modules_reading_the_client(root: Path) -> list[str]:
    return [
        f"{rel}:{line}: {code}"
        for path in sorted((root / "gateway").rglob("*.py"))
        if not (rel := path.relative_to(root).as_posix()).startswith(CLIENT_READERS)
        for line, code in client_reads(path.read_text(encoding="utf-8"))
    ]


def test_no_module_above_the_store_reads_a_stores_client() -> None:
    found = modules_reading_the_client(ROOT)
    assert found == [], "ask the store for its part (store.output_records, …):\n" + "\n".join(found)


def test_the_client_check_fails_on_a_planted_read(tmp_path: Path) -> None:
    """A copy of gateway/ with the client read planted back above the store: the check names
    it; the same read inside the store or the CLI is allowed."""
    import shutil

    shutil.copytree(ROOT / "gateway", tmp_path / "gateway", ignore=shutil.ignore_patterns("*.pyc"))
    assert modules_reading_the_client(tmp_path) == []
    outputs = tmp_path / "gateway" / "fencing" / "outputs.py"
    source = outputs.read_text(encoding="utf-8")
    planted = source.replace(
        "self.records = store.output_records",
        "self.records = OutputRecords(store.link.client, store.batcher)",
        1,
    )
    assert planted != source
    outputs.write_text(planted, encoding="utf-8")
    (tmp_path / "gateway" / "cli" / "planted.py").write_text(
        "def f(store):\n    return store.client\n"
    )
    found = modules_reading_the_client(tmp_path)
    assert len(found) == 1 and found[0].startswith("gateway/fencing/outputs.py:"), found
    assert found[0].endswith(": store.link.client")


def _a_value_or_an_interface(base: type) -> bool:
    """A base a class of another module may extend: a Protocol (an interface), an enum, an
    exception, a dataclass (a value type): what it inherits is a shape, not behaviour."""
    import dataclasses
    import enum

    from typing_extensions import is_protocol

    return (
        is_protocol(base)
        or issubclass(base, enum.Enum | BaseException)
        or dataclasses.is_dataclass(base)
    )


def inheritance_across_modules(source: str, module: str) -> list[str]:
    """The classes of ``source`` (the module ``module``) that extend a class of another
    ``gateway`` module which is not :func:`_a_value_or_an_interface`, as ``Class(Base) from
    module``. Third-party bases (a redis client, ``RuntimeError``) are not looked at."""
    import importlib

    tree = ast.parse(source)
    imported = {
        alias.asname or alias.name: (node.module or "", alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gateway.")
        for alias in node.names
    }
    found = []
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for base in cls.bases:
            if not isinstance(base, ast.Name) or base.id not in imported:
                continue
            owner, name = imported[base.id]
            if owner == module:
                continue
            value = getattr(importlib.import_module(owner), name)
            if not (isinstance(value, type) and _a_value_or_an_interface(value)):
                found.append(f"{cls.name}({base.id}) from {owner}")
    return found


def test_the_inheritance_check_finds_a_class_extending_another_modules_class() -> None:
    planted = (
        "from gateway.core.errors import StoreUnavailable\n"
        "from gateway.core.records import AuditCheck\n"
        "from gateway.store.budget import RejectionBudget\n"
        "from gateway.store.replies import Reply\n"
        "from gateway.store.link import RedisLink\n"
        "class Refused(StoreUnavailable): ...\n"
        "class Check(AuditCheck): ...\n"
        "class Budget(RejectionBudget): ...\n"
        "class Code(Reply): ...\n"
        "class Reads(RedisLink): ...\n"
    )
    assert inheritance_across_modules(planted, "gateway.store.reads") == [
        "Reads(RedisLink) from gateway.store.link"
    ]
    assert inheritance_across_modules(planted, "gateway.store.link") == []  # its own class


def test_the_fencing_layer_and_the_store_compose_instead_of_inheriting_across_modules() -> None:
    """No class of gateway/fencing or gateway/store extends a class of another gateway module
    (Protocols, enums, exceptions and dataclasses excepted: interfaces and values, no
    behaviour): collaborators are held, each owning its state -- the effect service's
    dispatcher, relay and admission hook; the store's link to Redis, given to its decisions,
    relay queue, reads and index. Within one module a class may extend another."""
    sources = [
        path
        for package in ("fencing", "store")
        for path in sorted((ROOT / "gateway" / package).glob("*.py"))
    ]
    assert len(sources) > 30
    across = [
        f"{path.relative_to(ROOT)}: {found}"
        for path in sources
        for found in inheritance_across_modules(
            path.read_text(encoding="utf-8"),
            ".".join(path.relative_to(ROOT).with_suffix("").parts),
        )
    ]
    assert across == []


def import_cycles(package: str) -> list[list[str]]:
    """The groups of modules of ``package`` that import each other, directly or round a loop
    (strongly connected components of its import graph: deferred and ``TYPE_CHECKING``
    imports count; a package's ``__init__`` importing its own submodules does not)."""
    import grimp

    graph = grimp.build_graph(package, include_external_packages=False, cache_dir=None)
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for other in graph.find_modules_directly_imported_by(module):
            if other not in order:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], order[other])
        if low[module] == order[module]:
            group = [stack.pop()]
            while group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in order:
            visit(module)
    return cycles


def test_no_modules_import_each_other() -> None:
    assert import_cycles("gateway") == []


def test_the_cycle_check_finds_a_planted_loop(tmp_path: Path, monkeypatch: Any) -> None:
    pkg = tmp_path / "planted"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from planted import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from planted import c\n"
    )
    (pkg / "c.py").write_text("def f():\n    from planted import a\n")
    (pkg / "d.py").write_text("from planted import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("planted") == [["planted.a", "planted.b", "planted.c"]]


def test_the_call_site_check_finds_a_second_caller(tmp_path: Path) -> None:
    (tmp_path / "gateway" / "store").mkdir(parents=True)
    (tmp_path / "gateway" / "fencing").mkdir()
    call = "async def f(link, keys):\n    return await link.run_script('cancel-1', keys, (), ())\n"
    (tmp_path / "gateway" / "store" / "owner.py").write_text(call)
    (tmp_path / "gateway" / "fencing" / "second.py").write_text(call.replace("f(", "g("))
    assert script_calls(tmp_path) == {
        "cancel-1": ["gateway/fencing/second.py:2", "gateway/store/owner.py:2"]
    }
