"""The layout of ``gateway/`` drawn from its imports, for docs/architecture.md.

    python -m tests.support.layout_map                 # this tree
    python -m tests.support.layout_map --root /tmp/old # another checkout (e.g. `git archive`)

Prints, from the source alone (grimp's import graph and ``ast``): the packages with their
modules and lines; the imports between packages as a matrix (a row imports the columns; an
arrow up the layer order is marked ``!``); and the figures the house rules are about: import
cycles, imports of another module's private names, private attributes used on anything but
``self``/``cls``, classes extending a class of another gateway module, ``# fmt: skip`` lines,
the largest modules.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from collections import Counter
from pathlib import Path

# the layers, top to bottom; modules beside them (client, downstream, ...) come last
ORDER = (
    "cli",
    "http",
    "console",
    "proxy",
    "integrations",
    "fencing",
    "store",
    "objects",
    "runtime",
    "core",
)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(root)"


def _figures(root: Path) -> dict[str, object]:
    sources = sorted((root / "gateway").rglob("*.py"))
    lines = {p: len(p.read_text(encoding="utf-8").splitlines()) for p in sources}
    private_imports = private_attrs = inherit = skips = 0
    for path in sources:
        text = path.read_text(encoding="utf-8")
        skips += text.count("# fmt: skip")
        tree = ast.parse(text)
        imported = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gateway"):
                for alias in node.names:
                    imported[alias.asname or alias.name] = node.module
                    private_imports += _private(alias.name)
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                owner = node.value
                if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                    private_attrs += ast.unparse(node) != "os._exit"
            elif isinstance(node, ast.ClassDef):
                inherit += sum(isinstance(b, ast.Name) and b.id in imported for b in node.bases)
    by_package: Counter[str] = Counter()
    modules: Counter[str] = Counter()
    for path, n in lines.items():
        rel = path.relative_to(root / "gateway").parts
        pkg = rel[0] if len(rel) > 1 else "(root)"
        by_package[pkg] += n
        modules[pkg] += 1
    largest = sorted(lines.items(), key=lambda kv: -kv[1])[:5]
    return {
        "lines": by_package,
        "modules": modules,
        "private_imports": private_imports,
        "private_attrs": private_attrs,
        "inherit": inherit,
        "skips": skips,
        "largest": [(str(p.relative_to(root)), n) for p, n in largest],
    }


def _graph() -> tuple[Counter[tuple[str, str]], int]:
    import grimp

    graph = grimp.build_graph("gateway", include_external_packages=False, cache_dir=None)
    edges: Counter[tuple[str, str]] = Counter()
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            a, b = _package(importer), _package(imported)
            if a != b:
                edges[(a, b)] += 1
    from tests.house.test_layout import import_cycles

    return edges, len(import_cycles("gateway"))


def render(root: Path) -> str:
    figures = _figures(root)
    edges, loops = _graph()
    packages = [p for p in ORDER if p in figures["lines"]]  # type: ignore[operator]
    packages += sorted(set(figures["lines"]) - set(packages))  # type: ignore[arg-type]
    rank = {p: i for i, p in enumerate(ORDER)}
    out = ["package        modules  lines"]
    for p in packages:
        out.append(f"{p:<14} {figures['modules'][p]:>7}  {figures['lines'][p]:>5}")  # type: ignore[index]
    width = max(len(p) for p in packages)
    out += ["", "imports (row imports column; ! = an arrow up the layers)"]
    out.append(" " * (width + 1) + " ".join(f"{p[:4]:>4}" for p in packages))
    for a in packages:
        cells = []
        for b in packages:
            n = edges.get((a, b), 0)
            up = a in rank and b in rank and rank[b] < rank[a] and n
            cells.append(f"{(str(n) + ('!' if up else '')) if n else '.':>4}")
        out.append(f"{a:<{width}} " + " ".join(cells))
    out += [
        "",
        f"import cycles (groups of modules importing each other): {loops}",
        f"imports of another module's private names: {figures['private_imports']}",
        f"private attributes used on anything but self/cls: {figures['private_attrs']}",
        f"classes extending a class of another gateway module: {figures['inherit']}",
        f"'# fmt: skip' lines: {figures['skips']}",
        "largest modules: " + ", ".join(f"{p} ({n})" for p, n in figures["largest"]),  # type: ignore[attr-defined]
    ]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2])
    args = parser.parse_args()
    root = args.root.resolve()
    here = Path(__file__).resolve().parents[2]
    if root != here:  # grimp imports nothing, but finds "gateway" on sys.path: run from there
        code = (
            "import sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[2]);"
            "from pathlib import Path; from tests.support.layout_map import render;"
            "print(render(Path(sys.argv[1])))"
        )
        subprocess.run([sys.executable, "-c", code, str(root), str(here)], check=True)
        return
    print(render(root))


if __name__ == "__main__":
    main()
