"""The project's documentation as the tests read it: the README and every page of docs/."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).parents[2]


def docs_text() -> str:
    """The README followed by every page of docs/ (claims are checked wherever they stand)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n".join(p.read_text(encoding="utf-8") for p in pages)
