"""The host CPU as Linux describes it in /proc/cpuinfo, read once per process.

Its feature flags decide where jengine's native CPU kernels pay (XLA:CPU runs bf16 and int8
dots on the AMX tiles where the CPU has them: `jengine.models.matmul`), what `dtype: auto`
means on CPU (`jengine.core.build`), and part of a stored program's key (XLA:CPU compiles for
the host's instruction set: `jengine.runtime.executables`).
"""

from __future__ import annotations

import functools
from pathlib import Path


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
def flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (`amx_bf16`, `amx_int8`, `avx512_bf16`, ...)."""
    return frozenset(fields().get("flags", "").split())
