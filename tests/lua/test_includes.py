"""The scripts' includes (``--- @include "includes/<name>"``, resolved by
:func:`gateway.store.scripts.lua_source` when the store is built): each include once, before
what uses it; an unknown include or a cycle fails the boot; an include reads no KEYS/ARGV."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.store.scripts import SCRIPT_NAMES, ScriptSourceError, lua_source

pytestmark = pytest.mark.fast

LUA = Path(__file__).resolve().parents[2] / "gateway" / "store" / "lua"
FENCED = ("admit-8", "checkpoint-3", "complete-3", "output-stage-3", "heartbeat-2", "check-2")


def tree(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "includes").mkdir()
    (tmp_path / "_prelude.lua").write_text("-- prelude\n")
    for name, text in files.items():
        (tmp_path / f"{name}.lua").write_text(text)
    return tmp_path


def test_every_fenced_script_runs_the_one_fence_guard() -> None:
    guard = (LUA / "includes" / "fence.lua").read_text()
    for name in FENCED:
        source = lua_source(name)
        assert source.count("local function fence_guard(") == 1, name
        assert guard in source
        assert source.count("local function reject_call(") == 1, name  # fence includes reject
        # the guard's own code is nowhere copied into a body
        body = (LUA / f"{name}.lua").read_text()
        assert "lease_exp', '0'" not in body and "'stale_generation'" not in body, name


def test_an_include_is_placed_once_after_the_prelude_and_before_its_user(tmp_path: Path) -> None:
    lua = tree(tmp_path, {
        "s-1": '--- @include "includes/b"\n--- @include "includes/a"\nbody()\n',
        "includes/a": '--- @include "includes/b"\nA = 1\n',
        "includes/b": "B = 1\n",
    })  # fmt: skip
    source = lua_source("s-1", lua)
    assert source.count("B = 1") == 1 and source.count("A = 1") == 1
    assert source.index("-- prelude") < source.index("B = 1") < source.index("A = 1")
    assert source.index("A = 1") < source.index("return run_script(function()")
    assert source.endswith("body()\n\nend)\n")


def test_an_unknown_include_is_refused(tmp_path: Path) -> None:
    lua = tree(tmp_path, {"s-1": '--- @include "includes/nope"\n'})
    with pytest.raises(ScriptSourceError, match="unknown include 'nope'"):
        lua_source("s-1", lua)


def test_an_include_cycle_is_refused(tmp_path: Path) -> None:
    lua = tree(tmp_path, {
        "s-1": '--- @include "includes/a"\n',
        "includes/a": '--- @include "includes/b"\n',
        "includes/b": '--- @include "includes/a"\n',
    })  # fmt: skip
    with pytest.raises(ScriptSourceError, match="include cycle a -> b -> a"):
        lua_source("s-1", lua)


def test_a_store_with_an_unknown_include_fails_when_it_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store assembles every source in its constructor, before any script is loaded."""
    import redis.asyncio as aioredis

    from gateway.store import link
    from gateway.store.store import Store

    lua = tree(tmp_path, {"admit-8": '--- @include "includes/missing"\n'})

    def broken(name: str) -> str:
        return lua_source(name, lua if name == "admit-8" else None)

    monkeypatch.setattr(link, "lua_source", broken)
    with pytest.raises(ScriptSourceError, match="missing"):
        Store(aioredis.Redis(), registration="required", dispatch_timeout_ms=1,
              retention_seconds=1)  # fmt: skip


def test_an_include_takes_everything_it_uses_as_arguments() -> None:
    """No KEYS or ARGV in an include: every script passes its own (its names say how many KEYS
    it takes, tests/house/test_layout.py)."""
    for path in (LUA / "includes").glob("*.lua"):
        code = re.sub(r"--\[\[.*?\]\]|--[^\n]*", "", path.read_text(), flags=re.S)
        assert "KEYS" not in code and "ARGV" not in code, path.name
    for name in SCRIPT_NAMES:  # every include line names an include that exists
        for wanted in re.findall(
            r'^--- @include "includes/(.+)"$', (LUA / f"{name}.lua").read_text(), re.M
        ):
            assert (LUA / "includes" / f"{wanted}.lua").is_file(), (name, wanted)


SHARED = {  # each shared function: the include that defines it
    "audit": "audit",
    "hmac": "audit",
    "index": "index",
    "feed_copy": "feed",
    "reject_call": "reject",
    "fence_guard": "fence",
    "fenced_call": "fence",
}


def test_each_shared_function_is_written_once_in_its_include() -> None:
    """The audit chain, the index, the feed copy, the rejection and the guard live in their
    includes only: no script body and no other include (nor the prelude) defines them."""
    defined = re.compile(r"^local function ([a-z_]+)\(", re.M)
    texts = {f"includes/{p.stem}": p.read_text() for p in (LUA / "includes").glob("*.lua")}
    texts["_prelude"] = (LUA / "_prelude.lua").read_text()
    texts.update({name: (LUA / f"{name}.lua").read_text() for name in SCRIPT_NAMES})
    for where, text in texts.items():
        for function in defined.findall(text):
            if function in SHARED:
                assert where == f"includes/{SHARED[function]}", (function, where)


def test_a_script_carries_the_shared_functions_it_calls_and_no_others() -> None:
    """Each assembled source defines a shared function exactly when the script (or one of its
    includes) calls it: a script that audits nothing carries no audit chain code."""
    for name in SCRIPT_NAMES:
        source = lua_source(name)
        for function in SHARED:
            count = source.count(f"local function {function}(")
            called = re.search(rf"(?<![\w.]){function}\(", source.replace(
                f"local function {function}(", ""))  # fmt: skip
            assert count == (1 if called else 0), (name, function, count)
