"""A bf16 projection packed at load time (`matmul.amx_tiles`) on CPUs without AMX: `x @ w` and
the fused SwiGLU by VDPBF16PS on AVX-512-BF16 (where it issues fast enough to pay:
`dp_bf16_pays`), by f32 FMA over the bf16 pairs widened in registers on AVX-512F or AVX2, or by
portable C++ anywhere (`csrc/packed_bf16.cc`).

Why: off AMX, XLA:CPU's bf16 dot of a prefill chunk ran well below its own f32 dot's rate, so a
bf16 model prefilled slower than the same model in f32 (docs/kernels.md, "bf16 projections
without AMX"). The AMX tiles' layout holds each k pair of 16 columns as one 64-byte row, which is
VDPBF16PS's operand as it stands, so both kernels read the one packed weight: a model packed on
an AMX machine or off one has the same arrays. x is rounded to bf16 as the AMX kernel rounds
it; the sums are f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jengine import cpu_info
from jengine.cpu_kernels import library
from jengine.cpu_kernels import matmul as cpu_matmul

# The widest first: what `isa="auto"` takes of those `cpu_info.flags()` allow.
ISAS = ("avx512_bf16", "avx512", "avx2", "portable")


def available() -> bool:
    """Whether the native library was built with this kernel (a stale build lacks it)."""
    return library.has_target("jengine_packed_bf16_matmul")


def supports(isa: str) -> bool:
    """Whether the library's `isa` path of this kernel runs on this CPU."""
    cpu_matmul.require()
    return bool(library.runs("packed_bf16", isa))


def dp_bf16_pays() -> bool:
    """Whether this CPU issues VDPBF16PS fast enough to beat f32 FMA over the widened pairs (the
    library times both once per process: a Sapphire Rapids Xeon issues it at half its FMA
    rate, so one does no more work a cycle than f32; Zen 4 and 5 at their FMA rate)."""
    cpu_matmul.require()
    return library.runs("packed_bf16", "auto") == library.isa_code("packed_bf16", "avx512_bf16")


def best_isa() -> str:
    """The path `isa="auto"` runs here, of those `cpu_info.flags()` allows (so `cpu_info.hiding`
    steers it: hiding `avx512_bf16` runs the AVX-512F path, `avx512f` the AVX2 one), VDPBF16PS
    only where `dp_bf16_pays`."""
    return next(isa for isa in ISAS if cpu_info.allows(isa) and supports(isa)
                and (isa != "avx512_bf16" or dp_bf16_pays()))


def _checked(name: str, x: jax.Array, tiles: tuple[jax.Array, ...], n: int, isa: str,
             max_threads: int) -> dict:
    """Checks the operands of kernel `name`; returns its FFI attributes (the isa resolved)."""
    cpu_matmul.require()
    for t in tiles:
        cpu_matmul.amx_matmul_check(x, t, n, name)
    isa = best_isa() if isa == "auto" else isa
    if isa not in ISAS:
        raise ValueError(f"{name}: unknown isa {isa!r}; expected auto or one of {ISAS}")
    return {"n": np.int64(n), "isa": np.int32(library.isa_code("packed_bf16", isa)),
            "max_threads": np.int32(max_threads)}


def packed_matmul(
    x: jax.Array,  # [R, K] bfloat16, or float32 (rounded to bf16 first)
    tiles: jax.Array,  # amx_tiles(w) for w [K, N] bf16
    n: int,  # N
    *,
    out_dtype=jnp.float32,  # or bfloat16: the f32 sums rounded to nearest even
    isa: str = "auto",
    max_threads: int = 0,  # 0: all of XLA's intra-op threads
) -> jax.Array:  # [R, N] out_dtype
    """`x @ w` from the packed weight, f32 sums; the columns split over the threads."""
    if jnp.dtype(out_dtype) not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"packed_bf16_matmul returns float32 or bfloat16, not {out_dtype}")
    attrs = _checked("packed_bf16_matmul", x, (tiles,), n, isa, max_threads)
    call = jax.ffi.ffi_call(library.target("jengine_packed_bf16_matmul"),
                            jax.ShapeDtypeStruct((x.shape[0], n), out_dtype))
    return call(x, tiles, **attrs)


def packed_swiglu(
    x: jax.Array,  # [R, K] bfloat16, or float32 (rounded to bf16 first)
    gate_tiles: jax.Array,  # amx_tiles(w_gate) for w_gate [K, N] bf16
    up_tiles: jax.Array,  # amx_tiles(w_up), the same shape
    n: int,
    *,
    isa: str = "auto",
    max_threads: int = 0,
) -> jax.Array:  # [R, N] bfloat16
    """silu(x @ w_gate) * (x @ w_up) in one pass over both packed weights, rounded as
    `cpu_matmul.amx_swiglu` rounds (each product to bf16, the activation in f32 rounded once)."""
    if gate_tiles.shape != up_tiles.shape:
        raise ValueError(f"packed_bf16_swiglu takes two weights of one shape, got "
                         f"{gate_tiles.shape} and {up_tiles.shape}")
    attrs = _checked("packed_bf16_swiglu", x, (gate_tiles, up_tiles), n, isa, max_threads)
    call = jax.ffi.ffi_call(library.target("jengine_packed_bf16_swiglu"),
                            jax.ShapeDtypeStruct((x.shape[0], n), jnp.bfloat16))
    return call(x, gate_tiles, up_tiles, **attrs)
