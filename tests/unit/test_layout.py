"""The layout of gateway/ stays readable: modules a reader can hold in mind, layers that only
import downwards (the import-linter contracts in pyproject.toml, run by `make lint`), and an SDK
that does not drag the server in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    assert "0 broken" in run.stdout and "6 kept" in run.stdout


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
    # tests/integration/test_downstream_and_registry.py)
    assert registry.ENTRY_POINT_GROUP == "fencegate.adapters"


def test_each_scripts_name_says_how_many_keys_it_takes() -> None:
    """``admit-6`` takes six KEYS (before the prelude's trailer): the name is the contract a
    reader checks the store's call against."""
    import re

    from gateway.store.scripts import SCRIPT_NAMES

    lua = ROOT / "gateway" / "store" / "lua"
    assert {p.stem for p in lua.glob("*-*.lua")} == set(SCRIPT_NAMES)
    for name in SCRIPT_NAMES:
        used = {int(k) for k in re.findall(r"KEYS\[(\d+)\]", (lua / f"{name}.lua").read_text())}
        assert used == set(range(1, int(name.rsplit("-", 1)[1]) + 1)), name
