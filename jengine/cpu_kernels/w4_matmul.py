"""The native W4A16 matmul on CPU: `x [R, K] f32 @ w [K, N]` for a 4-bit weight with a float32
scale and min per group of 32 k and column, `w[k, n] = s[k // 32, n] * q[k, n] + m[k // 32, n]`,
q in 0..15 (csrc/w4_matmul.cc).

Why: a decode step streams every weight once, so its time is the weight bytes. This form holds
GGUF Q4_0 (m = -8 s), Q4_1 (d, m), Q4_K (its sub-block scales times d / dmin) and AWQ / GPTQ
int4 (m = -zero * s) exactly, at 0.75 bytes a weight (4-bit values plus two f32 per 32) against
4 for f32 and 2 for bf16.

The weight is packed once, on the host, into the kernel's tile-major layout (`pack`): tiles of
`COLS` columns, within a tile the groups of 32 k in order, each group 1,024 bytes: for each of
its 4 vectors of 16 columns v, 4 runs p of 64 bytes, byte 4 l + b of run p holding, for column
16 v + l, q[32 g + 4 p + b] in its low nibble and q[32 g + 16 + 4 p + b] in its high one. So a
run's 32-bit lane l is four consecutive k of one column, what VPDPBUSD sums (the VNNI path
reads a run as two vectors of u8 weights, an AND and a shift apart), and the float paths take
one k for 16 columns from a run with a shift and an AND. A thread's tiles are one contiguous
run of memory. `dequantize` undoes it in jnp (the reference path and every non-CPU backend).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jengine import cpu_info
from jengine.cpu_kernels import library

COLS = 64  # columns per tile (kW4Cols)
GROUP = 32  # k per scale / min group
# The paths, preferred first: W4A8 on VNNI (x rounded to int8 per group of 32), then the float
# W4A16 paths (x as given).
ISAS = ("avx512_vnni", "avx_vnni", "avx512", "avx2", "portable")


def available() -> bool:
    """Whether the native library is loaded and has this kernel."""
    return library.available() and library.has_target("jengine_w4_matmul")


def supports(isa: str) -> bool:
    """Whether this CPU runs the kernel's `isa` path."""
    library.require("the w4a16 native matmul", "the jnp reference (matmul_backend 'xla')")
    return bool(library.runs("w4_matmul", isa))


def best_isa() -> str:
    """The path `isa="auto"` runs here: the first of ISAS that `cpu_info.flags()` allows (so
    `cpu_info.hiding("avx512_vnni", "avx_vnni")` runs the float W4A16 path) and the library
    runs."""
    return next(isa for isa in ISAS if cpu_info.allows(isa) and supports(isa))


def pack(q: np.ndarray, s: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q uint8 [K, N] (values 0..15), s and m f32 [K / 32, N] -> the kernel's layout: q uint8
    [ceil(N / 64), K / 32, 16, 64], s and m f32 [ceil(N / 64), K / 32, 64]; zeros pad N.

    Raises:
      ValueError: K not a multiple of 32, q above 15, or shapes that do not pair.
    """
    k, n = q.shape
    if k % GROUP or s.shape != (k // GROUP, n) or m.shape != s.shape:
        raise ValueError(f"w4 pack takes q [K, N] with K a multiple of {GROUP} and s, m "
                         f"[K / {GROUP}, N], got {q.shape}, {s.shape}, {m.shape}")
    if q.size and int(q.max()) > 15:
        raise ValueError("w4 pack: q values must be 0..15")
    nt, g = -(-n // COLS), k // GROUP
    qp = np.zeros((k, nt * COLS), np.uint8)
    qp[:, :n] = q
    # k = 32 g + 16 h + 4 p + b, n = 64 t + 16 v + l  ->  [t, g, v, p, l, b], h the nibble
    qp = qp.reshape(g, 2, 4, 4, nt, 4, 16).transpose(4, 0, 5, 2, 6, 3, 1)
    packed = np.ascontiguousarray(qp[..., 0] | (qp[..., 1] << 4)).reshape(nt, g, 16, COLS)

    def tiles(a):
        ap = np.zeros((g, nt * COLS), np.float32)
        ap[:, :n] = a
        return np.ascontiguousarray(ap.reshape(g, nt, COLS).transpose(1, 0, 2))

    return packed, tiles(s), tiles(m)


def dequantize(q: jax.Array, s: jax.Array, m: jax.Array, n: int, dtype=jnp.float32) -> jax.Array:
    """The packed weight's float values [K, N] (the reference's operand): `pack` undone."""
    nt, g = q.shape[-4], q.shape[-3]
    q = q.reshape(nt, g, 4, 4, 16, 4)  # [t, g, v, p, l, b]
    vals = jnp.stack([(q & 15), (q >> 4)], axis=-1).astype(jnp.float32)  # [t, g, v, p, l, b, h]
    w = (vals * s.reshape(nt, g, 4, 1, 16, 1, 1) + m.reshape(nt, g, 4, 1, 16, 1, 1))
    w = w.transpose(1, 6, 3, 5, 0, 2, 4).reshape(g * GROUP, nt * COLS)  # [g, h, p, b, t, v, l]
    return w[:, :n].astype(dtype)


def w4_matmul(
    x: jax.Array,  # [R, K] float32
    q: jax.Array,  # [ceil(N / 64), K / 32, 16, 64] uint8 (`pack`)
    s: jax.Array,  # [ceil(N / 64), K / 32, 64] float32
    m: jax.Array,  # [ceil(N / 64), K / 32, 64] float32
    n: int,  # N
    *,
    isa: str = "auto",
    max_threads: int = 0,  # 0: all of XLA's intra-op threads
) -> jax.Array:  # [R, N] float32
    """`x @ w` by the native kernel: per group of 32 k the x * q sums, then s * sums + m *
    sum(x over the group); each packed byte is read once for all R rows. On `avx512_vnni` or
    `avx_vnni` (what `auto` picks where the CPU has one) x is rounded to int8 per row and group
    first (scale max |x| / 127) and the sums are exact int32 (W4A8); the other paths sum x * q
    in f32 (W4A16)."""
    library.require("the w4a16 native matmul", "the jnp reference (matmul_backend 'xla')")
    if (x.dtype != jnp.float32 or x.ndim != 2 or q.dtype != jnp.uint8 or q.ndim != 4
            or x.shape[1] != q.shape[1] * GROUP or s.shape != q.shape[:2] + (COLS,)
            or m.shape != s.shape or q.shape[0] != -(-n // COLS)):
        raise ValueError(f"w4_matmul takes x [R, K] float32 and pack()'s q, s, m for a w [K, {n}]"
                         f", got x {x.dtype}{x.shape}, q {q.dtype}{q.shape}, s {s.shape}")
    isa = best_isa() if isa == "auto" else isa
    if isa not in ISAS:
        raise ValueError(f"w4_matmul: unknown isa {isa!r}; expected auto or one of {ISAS}")
    call = jax.ffi.ffi_call(library.target("jengine_w4_matmul"),
                            jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x, q, s, m, n=np.int64(n), isa=np.int32(library.isa_code("w4_matmul", isa)),
                max_threads=np.int32(max_threads))
