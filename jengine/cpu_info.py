"""The host CPU as Linux describes it in /proc/cpuinfo, read once per process.

Its feature flags decide where jengine's native CPU kernels pay (XLA:CPU runs bf16 and int8
dots on the AMX tiles where the CPU has them: `jengine.models.matmul`), what `dtype: auto`
means on CPU (`jengine.core.build`), and part of a stored program's key (XLA:CPU compiles for
the host's instruction set: `jengine.runtime.executables`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path

_hidden: frozenset[str] = frozenset()


@functools.cache
def fields() -> dict[str, str]:
    """Each /proc/cpuinfo key with its first value (the first core's: `model name`, `flags` on
    x86, `Features` on Arm, ...); empty where there is no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        out.setdefault(key.strip(), value.strip())
    return out


@functools.cache
def _host_flags() -> frozenset[str]:
    return frozenset(fields().get("flags", "").split())


def flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (`amx_bf16`, `amx_int8`, `avx512_bf16`, ...),
    less any that `hiding` hides: every choice of a native kernel, its instruction set and the
    `auto` dtype reads them here, so one place decides what a process runs."""
    return _host_flags() - _hidden


# The Linux flags each instruction set of the native kernels needs (their `isa` names).
ISA_FLAGS = {
    "portable": (),
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f",),
    "avx512_vnni": ("avx512f", "avx512_vnni"),
    "avx_vnni": ("avx2", "fma", "avx_vnni"),
    "avx512_bf16": ("avx512f", "avx512_bf16"),
    "amx": ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16"),
    "amx_int8": ("avx512f", "amx_tile", "amx_int8"),
}


def allows(isa: str) -> bool:
    """Whether `flags()` has every feature the kernels' instruction set `isa` needs (the native
    library also asks the CPU itself, and Linux for the AMX tile state, before it runs one)."""
    have = flags()
    return all(f in have for f in ISA_FLAGS[isa])


def best_vector_isa(runs: Callable[[str], bool]) -> str:
    """What a native kernel's `isa="auto"` takes: the widest of AVX-512F, AVX2+FMA and portable
    C++ that `flags()` allows and the library's own check `runs(isa)` accepts."""
    return next(isa for isa in ("avx512", "avx2", "portable") if allows(isa) and runs(isa))


def hidden() -> frozenset[str]:
    """The flags `hiding` hides now (part of a stored program's key)."""
    return _hidden


@contextlib.contextmanager
def hiding(*names: str) -> Iterator[None]:
    """Runs the block as on a CPU without the features `names` (`"amx_bf16"`, `"avx512f"`, ...):
    engines built inside pick the kernels and dtype such a CPU gets. This is how the tests run
    the AMD EPYC (AVX-512, no AMX) and AVX2-only paths on a Xeon with AMX; it can only take
    features away, never grant one the CPU lacks."""
    global _hidden
    before = _hidden
    _hidden = before | frozenset(names)
    try:
        yield
    finally:
        _hidden = before
