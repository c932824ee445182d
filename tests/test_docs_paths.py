"""Every `scripts/...` and `experiments/...` path that the docs, the README or a source comment
names exists: tools and probes move (issue 45 moved the one-question probes to experiments/),
and a doc that cites a figure must still name the command that reproduces it. Reads files only."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A path relative to the repository root, not one inside another tree (`/tmp/x/scripts/...`);
# it ends on a word character, so a sentence's full stop is not part of it.
PATH = re.compile(r"(?<![\w/.-])(?:scripts|experiments)/[\w./-]*\w")


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "experiments").glob("*.md"))]


def _sources() -> list[Path]:
    """Comments and docstrings cite the probe that measured a choice."""
    return [p for top in ("jengine", "converters", "tests", "scripts", "experiments")
            for p in sorted((ROOT / top).rglob("*.py"))]


def _named_paths(path: Path) -> list[tuple[int, str]]:
    return [(number, match.group(0))
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            for match in PATH.finditer(line)]


def _missing(paths: list[Path]) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{number}: {name}"
            for path in paths if path.exists()
            for number, name in _named_paths(path) if not (ROOT / name).exists()]


def test_the_scan_finds_paths():
    """A pattern that matched nothing would pass the tests below vacuously."""
    found = {name for path in _docs() + _sources() for _, name in _named_paths(path)}
    assert "scripts/supported_models.py" in found
    assert "experiments/step_ab.py" in found
    assert not PATH.search("/tmp/old/scripts/x.py"), "another tree's path is not ours to check"


def test_paths_named_in_docs_exist():
    missing = _missing(_docs())
    assert not missing, "docs name paths that are not in the tree:\n" + "\n".join(missing)


def test_paths_named_in_sources_exist():
    missing = _missing(_sources())
    assert not missing, "sources name paths that are not in the tree:\n" + "\n".join(missing)
