"""The native kernel library's one loader: loads `_cpu_kernels*.so`, reads its table of FFI
targets and instruction-set codes, and registers every target with XLA.

The table is written once, in C++, beside the handlers (`csrc/registry.h`: `JE_FFI_TARGET`,
`JE_ISAS`); nothing here lists a target or a code. The wrappers (attention.py, matmul.py, ...)
ask for a target by its name (`target`) and for a code by its kernel and instruction-set name
(`isa_code`), and either raises an error naming what the library lacks, so a Python wrapper
and a C++ handler cannot disagree silently.

Loaded when this module is first imported (every wrapper imports it, and the models import the
wrappers), so the targets are registered before any program that calls them is compiled or
loaded from the persistent compilation cache. A missing or broken library leaves the table
empty and `available()` false: importing still succeeds, and `require` raises the error
naming the fix when a native kernel is asked for.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
from pathlib import Path
from typing import NamedTuple

import jax

_STEM = "_cpu_kernels"


class IsaRow(NamedTuple):
    """One `isa` code of one kernel, as the library defines it."""
    kernel: str  # "attention", "matmul", "amx", "int8_matmul", "rms_norm"
    name: str  # "auto", "portable", "avx2", ...
    code: int
    index: int  # the row's place in the library's table (what JengineTableIsaRuns takes)


def _find(here: Path) -> Path | None:
    found = [p for suffix in importlib.machinery.EXTENSION_SUFFIXES
             if (p := here / f"{_STEM}{suffix}").exists()]
    return found[0] if found else None


def _text(raw: bytes | None) -> str:
    return (raw or b"").decode()


def _read_table(lib: ctypes.CDLL) -> tuple[dict[str, int], dict[tuple[str, str], IsaRow]]:
    """(FFI target name -> handler address, (kernel, isa name) -> row) from the library."""
    lib.JengineTableTargetName.restype = ctypes.c_char_p
    lib.JengineTableTargetHandler.restype = ctypes.c_void_p
    lib.JengineTableIsaKernel.restype = ctypes.c_char_p
    lib.JengineTableIsaName.restype = ctypes.c_char_p
    targets = {_text(lib.JengineTableTargetName(i)): lib.JengineTableTargetHandler(i)
               for i in range(lib.JengineTableTargets())}
    isas = {}
    for i in range(lib.JengineTableIsas()):
        row = IsaRow(_text(lib.JengineTableIsaKernel(i)), _text(lib.JengineTableIsaName(i)),
                     lib.JengineTableIsaCode(i), i)
        isas[row.kernel, row.name] = row
    return targets, isas


def _load() -> tuple[ctypes.CDLL | None, dict[str, int], dict[tuple[str, str], IsaRow], str]:
    here = Path(__file__).parent
    path = _find(here)
    if path is None:
        return None, {}, {}, f"no {_STEM} library in {here}"
    try:
        lib = ctypes.CDLL(str(path))
        targets, isas = _read_table(lib)
        for name, handler in targets.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform="cpu")
    except (OSError, AttributeError) as e:
        return None, {}, {}, f"{path.name} failed to load: {e}"
    return lib, targets, isas, ""


_LIB, _TARGETS, _ISAS, _LOAD_ERROR = _load()


def available() -> bool:
    """Whether the library loaded and every target in its table is registered."""
    return _LIB is not None


def require(feature: str, alternative: str) -> None:
    """Raises a `RuntimeError` naming the fix when the library did not load: `feature` needs
    it, `alternative` is what to use instead."""
    if _LIB is None:
        raise RuntimeError(
            f"{feature} needs jengine's native kernel ({_LOAD_ERROR}). Reinstall jengine with a "
            "C++ compiler present (`pip install -e .` builds it; in a source tree `python "
            f"setup.py build_ext --inplace`), or use {alternative}.")


def targets() -> tuple[str, ...]:
    """The FFI targets in the library's table (all registered); empty without the library."""
    return tuple(_TARGETS)


def has_target(name: str) -> bool:
    """Whether the loaded library's table holds the FFI target `name`."""
    return name in _TARGETS


def target(name: str) -> str:
    """`name`, checked against the library's table: what a wrapper passes to
    `jax.ffi.ffi_call`. Raises `RuntimeError` (the library is stale: rebuild it) when absent."""
    if _LIB is not None and name not in _TARGETS:
        raise RuntimeError(f"{_STEM} has no FFI target {name!r} (it has {sorted(_TARGETS)}); "
                           "rebuild it: `python setup.py build_ext --inplace`")
    return name


def isas(kernel: str) -> tuple[str, ...]:
    """The instruction-set names the library defines for `kernel`, in its table's order."""
    return tuple(name for k, name in _ISAS if k == kernel)


def _row(kernel: str, isa: str) -> IsaRow:
    row = _ISAS.get((kernel, isa))
    if row is None:
        raise ValueError(f"the {kernel} kernel has no instruction set {isa!r}; the library "
                         f"defines {isas(kernel) or 'none'}")
    return row


def isa_code(kernel: str, isa: str) -> int:
    """The code `kernel`'s `isa` attribute takes for `isa`. Raises `ValueError` for a name the
    library does not define for that kernel."""
    return _row(kernel, isa).code


def runs(kernel: str, isa: str) -> int:
    """The kernel's own answer for `isa` on this CPU: for `auto`, the code auto picks; else 1
    when that path runs here, 0 when not (the CPU's features, and for AMX Linux's grant of the
    tile state, which the first ask requests)."""
    return int(_LIB.JengineTableIsaRuns(_row(kernel, isa).index))

