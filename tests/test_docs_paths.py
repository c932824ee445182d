"""Every `scripts/...` and `experiments/...` path that the docs, the README or a source comment
names exists: tools and probes move (issue 45 moved the one-question probes to experiments/),
and a doc that cites a figure must still name the command that reproduces it. And scripts/ stays
what STYLE.md says: a few maintained tools, each named in a doc, none reaching below the engine's
contract. Reads and parses files only."""

from __future__ import annotations

import ast
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


# The engine's internals below the contract that a maintained tool must not reach: a tool that
# needs them is a probe (experiments/).
INTERNAL = ("jengine.core", "jengine.runtime", "jengine.scheduling")
CONTRACT = ("jengine.core.contract",)
NOT_YET_ON_THE_API: set[str] = set()
MAX_SCRIPTS = 11  # gpu_step_profile.py: issue 51 asks for it by name


def _tools() -> list[Path]:
    return sorted(p for p in (ROOT / "scripts").iterdir() if p.is_file())


def test_scripts_are_few_and_each_named_in_a_doc():
    tools = _tools()
    assert len(tools) <= MAX_SCRIPTS, "one-question probes belong in experiments/"
    named = {name for path in _docs() for _, name in _named_paths(path)}
    unnamed = [p.name for p in tools if f"scripts/{p.name}" not in named]
    assert not unnamed, f"maintained tools no doc names: {unnamed}"


def test_scripts_stay_on_the_public_api():
    reaching = {}
    for path in _tools():
        if path.suffix != ".py" or path.name in NOT_YET_ON_THE_API:
            continue
        modules = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules.append(node.module)
        bad = [m for m in modules if m.startswith(INTERNAL) and not m.startswith(CONTRACT)]
        if bad:
            reaching[path.name] = bad
    assert not reaching, f"scripts reaching engine internals (a probe: experiments/): {reaching}"
