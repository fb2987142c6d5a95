"""The configuration reference (docs/configuration.md) and the example config are what
gateway.cli.configdoc writes from the settings models' field docstrings."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from gateway.cli import configdoc
from gateway.runtime.settings import Settings, load_settings

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
FIX = "run `make config-docs` (python -m gateway.cli.configdoc) and commit the result"


def test_every_setting_has_a_description() -> None:
    missing = configdoc.undocumented()
    assert not missing, (
        "settings without a description (write a docstring right under each field in "
        f"gateway/runtime/settings.py, then {FIX}): " + ", ".join(missing)
    )


def test_the_committed_reference_and_example_are_what_the_generator_writes() -> None:
    docs = (ROOT / configdoc.DOCS).read_text(encoding="utf-8")
    example = (ROOT / configdoc.EXAMPLE).read_text(encoding="utf-8")
    want_docs, want_example = configdoc.render(docs, example)
    assert docs == want_docs, f"{configdoc.DOCS} differs from the settings models: {FIX}"
    assert example == want_example, f"{configdoc.EXAMPLE} differs from the settings models: {FIX}"


def test_every_key_is_in_the_reference_and_the_example() -> None:
    docs = (ROOT / configdoc.DOCS).read_text(encoding="utf-8")
    example = (ROOT / configdoc.EXAMPLE).read_text(encoding="utf-8").splitlines()
    absent_docs = [k.path for k in configdoc.config_keys() if f"| `{k.path}` |" not in docs]
    absent_example = []
    for key in configdoc.config_keys():
        section, _, rest = key.path.partition(".")
        if section in ("adapters", "upstreams"):  # the adapter and upstream tables: by hand
            continue
        at = next(i for i, ln in enumerate(example) if ln.startswith(f"[{section}]"))
        end = next((i for i in range(at + 1, len(example)) if example[i].startswith("[")), None)
        lines = example[at:end]
        table, _, sub = rest.replace("[]", "").replace(".<tenant>", "").partition(".")
        headers = (f"# [[{section}.{table}]]", f"# [{section}.{table}.")
        if sub:  # a key of a table inside the section: in its commented-out table
            block = lines[next(i for i, ln in enumerate(lines) if ln.startswith(headers)) :]
            found = any(ln.startswith(f"# {sub} = ") for ln in block)
        elif configdoc.section_model(key.field.annotation) is not None:
            found = any(ln.startswith(headers) for ln in lines)
        else:
            found = any(ln.startswith((f"{rest} = ", f"# {rest} = ")) for ln in lines)
        if not found:
            absent_example.append(key.path)
    assert not absent_docs, f"not in {configdoc.DOCS}: {absent_docs}"
    assert not absent_example, f"not in {configdoc.EXAMPLE}: {absent_example}"
    paths = {k.path for k in configdoc.config_keys()}
    assert {"redis.request_memory_seconds", "fencing.relay_sweep_seconds"} <= paths


def test_the_example_sets_every_key_to_its_default() -> None:
    example = ROOT / configdoc.EXAMPLE
    loaded = load_settings(example).model_dump(exclude={"adapters"})
    assert loaded == Settings().model_dump(exclude={"adapters"})
    assert tomllib.loads(example.read_text(encoding="utf-8"))  # valid TOML as a whole


class _Knobs(BaseModel):
    """A section."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    documented: int = 1
    """Described."""
    bare: int = 2


class _Root(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    knobs: _Knobs = _Knobs()


def test_a_setting_without_a_docstring_is_named_and_stops_the_generator() -> None:
    assert configdoc.undocumented(_Root) == ["knobs.bare (_Knobs.bare)"]
    with pytest.raises(SystemExit, match=r"no description .*: knobs\.bare \(_Knobs\.bare\)$"):
        configdoc.reference_table(_Root)
    with pytest.raises(SystemExit, match=r"knobs\.bare"):
        configdoc.example_section(_Root)


def test_check_names_a_stale_file_and_the_command_and_a_run_rewrites_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for rel in (configdoc.DOCS, configdoc.EXAMPLE):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    assert configdoc.main(["--check", "--root", str(tmp_path)]) == 0
    docs = tmp_path / configdoc.DOCS
    fresh = docs.read_text(encoding="utf-8")
    docs.write_text(fresh.replace("| `server.port` | `8080` |", "| `server.port` | `80` |"))
    assert configdoc.main(["--check", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "docs/configuration.md" in err and "make config-docs" in err
    assert "fencegate.example.toml" not in err
    assert configdoc.main(["--root", str(tmp_path)]) == 0
    assert docs.read_text(encoding="utf-8") == fresh
    assert configdoc.main(["--check", "--root", str(tmp_path)]) == 0
