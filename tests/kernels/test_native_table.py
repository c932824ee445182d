"""The native library's one table of FFI targets and instruction-set codes (csrc/registry.h),
shared by the C++ handlers and the Python wrappers: every target the table holds is registered
with XLA, every target and code a wrapper names is one the library defines, and a name it does
not define is an error before any kernel runs. Reads the wrappers' source and asks the loaded
library; nothing is compiled."""

from __future__ import annotations

import ast
from pathlib import Path

import jax
import pytest
from jax._src.lib import xla_client

from jengine.cpu_kernels import attention, library

pytestmark = pytest.mark.skipif(not library.available(), reason="native library not built")
PACKAGE = Path(library.__file__).parent


def _calls(name: str, owner: str | None = "library") -> list[tuple[str, tuple]]:
    """(file, the literal arguments) of every `library.<name>(...)` call in the package (or,
    `owner` None, every plain `<name>(...)` call)."""
    found = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if owner is None:
                hit = isinstance(func, ast.Name) and func.id == name
            else:
                hit = (isinstance(func, ast.Attribute) and func.attr == name
                       and isinstance(func.value, ast.Name) and func.value.id == owner)
            if hit:
                args = tuple(a.value for a in node.args if isinstance(a, ast.Constant))
                found.append((path.name, args))
    return found


def _constants() -> dict[str, str]:
    """Module-level string constants of the package (`_TARGET = "jengine_zeros"`)."""
    out = {}
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)):
                out.update({(path.name, t.id): node.value.value for t in node.targets
                            if isinstance(t, ast.Name)})
    return out


def test_every_target_in_the_table_is_registered_with_xla():
    jax.devices()  # XLA takes the registrations queued before its CPU client starts
    registered = set(xla_client.custom_call_targets("cpu"))
    table = library.targets()
    assert len(table) >= 10 and len(set(table)) == len(table)  # no name added twice
    assert set(table) <= registered


def test_every_target_a_wrapper_calls_is_in_the_table():
    named = []
    constants = _constants()
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) in (
                    "target", "has_target") and getattr(node.func.value, "id", None) == "library"):
                continue
            (arg,) = node.args
            if isinstance(arg, ast.Name):
                named.append(constants[path.name, arg.id])
            else:
                named.append(arg.value)
    assert len(named) >= 10
    assert sorted(set(named) - set(library.targets())) == []
    # Each handler the table holds is called by some wrapper (or it is dead C++).
    assert sorted(set(library.targets()) - set(named)) == []


def test_every_isa_a_wrapper_names_is_defined_by_the_library():
    asked = [args for _, args in _calls("isa_code") + _calls("runs") if len(args) == 2]
    kernels = {args[0] for _, args in _calls("isa_code") + _calls("runs")}
    assert kernels == {"attention", "matmul", "int8_matmul", "rms_norm", "amx", "w4_matmul",
                       "packed_bf16", "vnni_int8_packed"}
    # The names the wrappers pass on: `supports("amx")` in attention.py, `granted("bf16")`.
    of_file = {"attention.py": "attention", "matmul.py": "matmul", "rms_norm.py": "rms_norm"}
    asked += [(of_file[file], args[0]) for file, args in _calls("supports", None) if args]
    asked += [("amx", args[0]) for _, args in _calls("granted", None) if args]
    assert ("attention", "amx") in asked and ("amx", "int8") in asked
    for kernel, isa in asked:
        assert isa in library.isas(kernel), (kernel, isa)
        library.isa_code(kernel, isa)


@pytest.mark.parametrize("kernel", ["attention", "matmul", "rms_norm"])
def test_the_vector_paths_share_their_codes(kernel):
    """The kernels built per ISA by per_isa.h take isa.h's codes; `auto` is always 0."""
    assert library.isas(kernel)[:4] == ("auto", "portable", "avx2", "avx512")
    assert [library.isa_code(kernel, i) for i in library.isas(kernel)[:4]] == [0, 1, 2, 3]
    assert library.runs(kernel, "portable") == 1
    assert library.runs(kernel, "auto") == library.isa_code(kernel, attention.best_isa())


def test_a_name_the_library_does_not_define_is_an_error():
    with pytest.raises(ValueError, match="attention kernel has no instruction set 'avx1024'"):
        library.isa_code("attention", "avx1024")
    with pytest.raises(ValueError, match="no instruction set 'amx'.*'avx512'"):
        library.isa_code("matmul", "amx")  # the AMX codes are the "amx" rows
    with pytest.raises(RuntimeError, match="no FFI target 'jengine_flash'.*rebuild"):
        library.target("jengine_flash")
