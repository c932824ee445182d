"""The native CPU kernels (jengine/cpu_kernels/csrc: paged attention, KV write and zeros that
touch no page, the small-row, AMX and int8 matmuls, RMSNorm), built against the XLA FFI headers
that jaxlib ships.

Everything else about the package is in pyproject.toml; this file only declares the extensions.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import Extension, setup


def _xla_ffi_include() -> str:
    # jaxlib/include holds xla/ffi/api/ffi.h (what jax.ffi.include_dir() returns); found without
    # importing jaxlib, so the build environment needs only the jaxlib wheel.
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("building jengine's CPU kernel needs jaxlib (for the XLA FFI headers)")
    include = Path(next(iter(spec.submodule_search_locations))) / "include"
    if not (include / "xla" / "ffi" / "api" / "ffi.h").exists():
        raise RuntimeError(f"no XLA FFI headers under {include}; jaxlib >= 0.4.31 ships them")
    return str(include)


CSRC = Path("jengine/cpu_kernels/csrc")


def _native_kernels() -> Extension:
    """Every `csrc/*.cc` in one library, `jengine.cpu_kernels._cpu_kernels` (one library so that
    the attention and the matmuls share one SpinHelper thread); each file adds its own FFI
    targets and ISA codes to the library's table (csrc/registry.h), so a new kernel is a new
    file here and nothing to list."""
    return Extension(
        "jengine.cpu_kernels._cpu_kernels",
        sources=sorted(str(p) for p in CSRC.glob("*.cc")),
        depends=sorted(str(p) for p in CSRC.glob("*.h")),
        include_dirs=[_xla_ffi_include()],
        language="c++",
        extra_compile_args=["-std=c++17", "-O3", "-g0", "-fvisibility=hidden", "-w"],
    )


setup(ext_modules=[_native_kernels()])
