"""The native small-row f32 matmul on CPU: `x [R, K] @ w [K, N]` inside a jitted program.

XLA:CPU's dot of a few rows costs far more than one row's (2 / 4 / 8 / 16 rows ran 1.6 / 2.5 /
3.3 / 3.5x one row, `scripts/small_row_dots.py`), while a step of that shape should cost what
streaming the weights costs. The C++ kernel (`csrc/small_matmul.cc`, built into
`_cpu_matmul*.so` by the package's install) keeps each output tile's R rows in registers so
every weight row segment is read once for all of them, splits the columns over XLA's intra-op
threads, and picks AVX-512, AVX2+FMA or portable code at run time.

The FFI target is registered when this module is imported (jengine.pallas_kernels imports it),
before any program that calls it is compiled or loaded from the persistent compilation cache.
If the library is missing, importing still succeeds; `available()` says so and the engine
keeps XLA's dot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jengine.pallas_kernels.native_library import load_native, missing

_TARGET = "jengine_small_matmul"
ISAS = {"auto": 0, "portable": 1, "avx2": 2, "avx512": 3}  # instruction set of the kernel

_LIB, _LOAD_ERROR = load_native("_cpu_matmul", {_TARGET: "JengineSmallMatmul"})


def available() -> bool:
    """Whether the native library was built and its FFI target is registered."""
    return _LIB is not None


def require() -> None:
    """Raises a `RuntimeError` naming the fix when the native library is unavailable."""
    if _LIB is None:
        raise missing("matmul backend 'native'", _LOAD_ERROR, "matmul_backend 'xla'")


def best_isa() -> str:
    """The instruction set `isa="auto"` runs on this CPU."""
    require()
    return {v: k for k, v in ISAS.items()}[_LIB.JengineMatmulIsa(0)]


def supports(isa: str) -> bool:
    """Whether this CPU runs the kernel's `isa` path."""
    require()
    return bool(_LIB.JengineMatmulIsa(ISAS[isa]))


def small_matmul(
    x: jax.Array,  # [R, K] float32
    w: jax.Array,  # [K, N] float32, row-major as the model stores it; [N, K] with transpose_w
    *,
    transpose_w: bool = False,  # x @ w.T (a tied embedding [V, E] as the output head)
    isa: str = "auto",
    max_threads: int = 0,  # 0: all of XLA's intra-op threads
) -> jax.Array:  # [R, N] float32
    """`x @ w` (or `x @ w.T`) by the native kernel; each weight element is read from memory
    once for all R rows."""
    require()
    if x.dtype != jnp.float32 or w.dtype != jnp.float32 or x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"small_matmul takes 2-D float32 operands, got {x.dtype}{x.shape} and "
                         f"{w.dtype}{w.shape}")
    n = w.shape[0] if transpose_w else w.shape[1]
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x, w, isa=np.int32(ISAS[isa]), transpose_w=np.int32(transpose_w),
                max_threads=np.int32(max_threads))
