"""The native CPU kernels (paged attention, KV write and zeros that touch no page; the small-row
matmul), built against the XLA FFI headers that jaxlib ships.

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


def _kernel(name: str, sources: list[str], *headers: str) -> Extension:
    csrc = "jengine/pallas_kernels/csrc/"
    return Extension(
        f"jengine.pallas_kernels.{name}",
        sources=[csrc + source for source in sources],
        depends=[csrc + h for h in ("isa.h", "parallel_for.h", "per_isa.h", *headers)],
        include_dirs=[_xla_ffi_include()],
        language="c++",
        extra_compile_args=["-std=c++17", "-O3", "-g0", "-fvisibility=hidden", "-w"],
    )


setup(
    ext_modules=[
        # One library, so that the attention and the matmuls share one SpinHelper thread.
        _kernel("_cpu_kernels",
                ["paged_attention.cc", "kv_zeros.cc", "small_matmul.cc", "int8_matmul.cc",
                 "rms_norm.cc"],
                "paged_attention_impl.h", "amx_tiles.h", "amx_attention.h", "small_matmul_impl.h",
                "amx_bf16.h", "amx_swiglu.h", "amx_int8.h", "spin_helper.h", "rms_norm_impl.h",
                "bf16.h"),
    ]
)
