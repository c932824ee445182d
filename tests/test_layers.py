"""The import rules that keep jengine's layers apart, checked by walking every module's AST:
the host-side layers never reach JAX, nothing imports the command line, no two modules import
each other (directly or around a loop, at any depth of the file), and files stay short enough
to read in one sitting. Nothing is imported or compiled here."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("jengine", "converters")
# Plain Python and NumPy: the scheduler and everything it hands around, text in and out, and
# the public value types. Testable without compiling anything.
HOST_PACKAGES = ("jengine.scheduling", "jengine.text")
HOST_MODULES = ("jengine.sampling_params", "jengine.outputs", "jengine.config")
MAX_LINES = 400  # a file to read in one sitting; model files (jengine/models/) may be longer

# The layers, top first. A module may import its own layer and the layers below it, never one
# above; a name covers a module or a package with everything under it, the longest name wins.
# docs/design.md ("Layers") draws the same table.
LAYERS = (
    ("cli", ("jengine.cli",)),
    ("serving", ("jengine.server", "jengine.bench")),
    # The public engine, the package's face (its lazy exports name the engine) and the engine
    # flags every command shares (flags -> `Engine`).
    ("engine", ("jengine.engine", "jengine.async_engine", "jengine.engine_flags", "jengine")),
    ("core", ("jengine.core",)),
    ("step", ("jengine.runtime", "jengine.scheduling")),
    # Weights from files onto devices: checkpoint readers and placement, the mesh and the
    # logical-axis rules. Both read the models' parameter specs; neither imports the other.
    ("weights", ("converters", "jengine.sharding")),
    ("model", ("jengine.models", "jengine.structured", "jengine.text", "jengine.vision")),
    # The attention backends (pallas_kernels) reach the native CPU kernels' `cpu` backend.
    ("kernels", ("jengine.pallas_kernels", "jengine.cpu_kernels")),
    # Values and helpers with no project import above them.
    ("base", ("jengine.config", "jengine.cpu_info", "jengine.sampling_params",
              "jengine.pooling_params", "jengine.outputs", "jengine.progress",
              "jengine.lora_request")),
)
# The engine's inside: above the engine layer nothing imports these. The server, the CLI and
# the benchmarks talk to `Engine` / `AsyncEngine`, and to the core only through `CoreContract`.
BEHIND_THE_ENGINE = ("core", "step")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_file(name: str) -> Path | None:
    parts = name.split(".")
    for candidate in (ROOT.joinpath(*parts).with_suffix(".py"),
                      ROOT.joinpath(*parts, "__init__.py")):
        if candidate.exists():
            return candidate
    return None


def _sources() -> list[Path]:
    return sorted(p for top in TOPS for p in (ROOT / top).rglob("*.py"))


def _import_statements(path: Path) -> list[tuple[str, list[str]]]:
    """Each import of `path`, at any depth of the file (function-local imports too), as (module,
    names): `import a.b` is ("a.b", []), `from .c import d` is (the resolved "pkg.c", ["d"])."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out.append((base, [alias.name for alias in node.names]))
    return out


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, with the packages Python imports on the way (`a.b.c` runs
    `a` and `a.b` first)."""
    names: set[str] = set()
    for base, members in _import_statements(path):
        names.add(base)
        names.update(f"{base}.{m}" for m in members)
    out = set()
    for name in names:
        parts = name.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return out


@functools.cache
def _graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (names that resolve to a file of this tree)."""
    graph = {}
    for path in _sources():
        me = _module_name(path)
        graph[me] = {n for n in _imports(path)
                     if n.split(".")[0] in TOPS and n != me and _module_file(n) is not None}
    return graph


def _direct_imports(path: Path) -> set[str]:
    """The project modules `path` names in its imports (not the packages Python runs on the way):
    `from a.b import c` is `a.b.c` when that is a module, else `a.b`."""
    names: set[str] = set()
    for base, members in _import_statements(path):
        if not members:  # `import a.b`
            names.add(base)
        names.update(f"{base}.{m}" if _module_file(f"{base}.{m}") else base for m in members)
    me = _module_name(path)
    return {n for n in names if n.split(".")[0] in TOPS and n != me and _module_file(n)}


def _layer(module: str, layers=LAYERS) -> int:
    """The index of `module`'s layer in `layers` (0 = top)."""
    best = None
    for depth, (_, names) in enumerate(layers):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (
                    best is None or len(name) > len(best[1])):
                best = (depth, name)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return best[0]


def _breaks(imports: dict[str, set[str]], layers=LAYERS, behind=BEHIND_THE_ENGINE,
            engine="engine") -> list[str]:
    """Every import that runs up the table, or from above `engine` into a layer `behind` it."""
    names = [name for name, _ in layers]
    found = []
    for module, deps in imports.items():
        mine = _layer(module, layers)
        for dep in deps:
            theirs = _layer(dep, layers)
            if theirs < mine or (mine < names.index(engine) and names[theirs] in behind):
                found.append(f"{module} ({names[mine]}) imports {dep} ({names[theirs]})")
    return sorted(found)


def test_every_module_imports_only_its_layer_and_below():
    imports = {_module_name(p): _direct_imports(p) for p in _sources()}
    assert _breaks(imports) == []


def test_the_layer_check_finds_a_break():
    layers = (("top", ("a",)), ("engine", ("e",)), ("inner", ("i",)), ("low", ("a.b", "c")))
    imports = {"c": {"a"}, "a.x": {"c", "a.b.y", "e"}, "a.b": {"c"}, "a.y": {"i.z"},
               "e": {"i", "c"}, "i": {"c"}}
    assert _breaks(imports, layers, behind=("inner",)) == [
        "a.y (top) imports i.z (inner)", "c (low) imports a (top)"]


def test_nothing_imports_the_command_line():
    graph = _graph()
    offenders = [m for m, deps in graph.items() if not m.startswith("jengine.cli")
                 and any(d == "jengine.cli" or d.startswith("jengine.cli.") for d in deps)]
    assert offenders == []


def _host_modules() -> list[str]:
    found = [m for m in _graph() if any(m == p or m.startswith(p + ".") for p in HOST_PACKAGES)]
    return sorted(found) + list(HOST_MODULES)


@pytest.mark.parametrize("module", _host_modules())
def test_host_side_modules_never_import_jax(module):
    """Follows the project's own imports transitively; no path may reach jax, jaxlib or flax."""
    seen, stack, reached = set(), [module], []
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _module_file(name)
        if path is None:
            continue
        for imported in _imports(path):
            root = imported.split(".")[0]
            if root in ("jax", "jaxlib", "flax"):
                reached.append(f"{name} imports {imported}")
            elif root in TOPS:
                stack.append(imported)
    assert reached == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    # A package's __init__ importing its own submodules is how a package exposes them, not a
    # cycle between layers: those edges are left out.
    graph = {m: {d for d in deps if not (_is_package(m) and d.startswith(m + "."))}
             for m, deps in _graph().items()}
    assert _cycles(graph) == []


def _is_package(name: str) -> bool:
    path = _module_file(name)
    return path is not None and path.name == "__init__.py"


def test_the_cycle_finder_finds_a_loop():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _class_members(path: Path, name: str) -> set[str]:
    """Names a class defines: its methods, properties and annotated fields, and the attributes
    its methods assign on `self`."""
    [cls] = [n for n in ast.walk(ast.parse(path.read_text()))
             if isinstance(n, ast.ClassDef) and n.name == name]
    members = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            members.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members.add(node.target.id)
    for node in ast.walk(cls):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        for target in targets:
            for t in ast.walk(target):
                if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                        and t.value.id == "self"):
                    members.add(t.attr)
    return members


def _contract() -> set[str]:
    return {m for m in _class_members(ROOT / "jengine/core/contract.py", "CoreContract")
            if not m.startswith("_")}


@pytest.mark.parametrize("path, name", [("jengine/core/engine_core.py", "EngineCore"),
                                        ("jengine/core/replicas.py", "ReplicaSet")])
def test_both_cores_keep_the_engine_contract(path, name):
    assert _contract() - _class_members(ROOT / path, name) == set()


def test_nothing_above_the_core_reaches_past_the_contract():
    """`X.core.NAME` in the public engine, the server, the CLI and the benchmarks names only
    what `CoreContract` declares (tests may look deeper)."""
    contract = _contract()
    above = [ROOT / "jengine/engine.py"] + [
        p for part in ("server", "cli", "bench") for p in (ROOT / "jengine" / part).rglob("*.py")]
    reached = set()
    for path in above:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "core" and node.attr not in contract):
                reached.add(f"{path.relative_to(ROOT)}: .core.{node.attr}")
    assert sorted(reached) == []
    assert {"add_request", "step", "abort", "model", "stats"} <= contract


def test_files_stay_short():
    long = {str(p.relative_to(ROOT)): n for p in _sources()
            if p.relative_to(ROOT).parts[:2] != ("jengine", "models")
            and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


# tests/ mirrors the package: a folder per layer's package (named as in jengine/, plus
# `converters`, `kernels` for pallas_kernels and the native CPU kernels, `base` for the
# top-level value modules, `accelerator` for the GPU/TPU suite). Shared test helpers and the two
# checks over the whole tree (this file, test_docs_paths.py) stay at the top.
TEST_FOLDERS = {"cli": "jengine/cli", "server": "jengine/server", "engine": "jengine/engine.py",
                "core": "jengine/core", "runtime": "jengine/runtime",
                "scheduling": "jengine/scheduling", "converters": "converters",
                "sharding": "jengine/sharding", "models": "jengine/models",
                "structured": "jengine/structured", "text": "jengine/text",
                "vision": "jengine/vision",
                "kernels": "jengine/pallas_kernels", "base": "jengine/config.py",
                "accelerator": "jengine/pallas_kernels"}
TREE_CHECKS = {"test_layers.py", "test_docs_paths.py"}


def test_tests_mirror_the_package():
    tests = ROOT / "tests"
    loose = sorted(p.name for p in tests.glob("test_*.py") if p.name not in TREE_CHECKS)
    assert loose == [], "a test module belongs in its layer's folder, tests/<package>/"
    folders = {p.relative_to(tests).parts[0] for p in tests.rglob("test_*.py")} - TREE_CHECKS
    assert folders <= set(TEST_FOLDERS), folders - set(TEST_FOLDERS)
    assert all((ROOT / path).exists() for path in TEST_FOLDERS.values())
