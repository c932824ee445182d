"""The native W4A16 matmul on CPU: `x [R, K] f32 @ w [K, N]` for a 4-bit weight with a float32
scale and min per group of 32 k and column, `w[k, n] = s[k // 32, n] * q[k, n] + m[k // 32, n]`,
q in 0..15 (csrc/w4_matmul.cc).

Why: a decode step streams every weight once, so its time is the weight bytes. This form holds
GGUF Q4_0 (m = -8 s), Q4_1 (d, m), Q4_K (its sub-block scales times d / dmin) and AWQ / GPTQ
int4 (m = -zero * s) exactly, at 0.75 bytes a weight (4-bit values plus two f32 per 32) against
4 for f32 and 2 for bf16.

The weight is packed once, on the host, into the kernel's tile-major layout (`pack`): tiles of
`COLS` columns, within a tile the groups of 32 k in order, each group 16 rows of `COLS` bytes
whose byte j holds q[32 g + 2 j] (low nibble) and q[32 g + 2 j + 1] (high nibble). A thread's
tiles are then one contiguous run of memory. `dequantize` undoes it in jnp (the reference path
and every non-CPU backend).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jengine.cpu_kernels import library

COLS = 64  # columns per tile (kW4Cols)
GROUP = 32  # k per scale / min group


def available() -> bool:
    """Whether the native library is loaded and has this kernel."""
    return library.available() and library.has_target("jengine_w4_matmul")


def supports(isa: str) -> bool:
    """Whether this CPU runs the kernel's `isa` path."""
    library.require("the w4a16 native matmul", "the jnp reference (matmul_backend 'xla')")
    return bool(library.runs("w4_matmul", isa))


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
    # k = 32 g + 2 j + h, n = 64 t + c  ->  [t, g, j, c], h the nibble
    qp = qp.reshape(g, 16, 2, nt, COLS).transpose(3, 0, 1, 4, 2)
    packed = np.ascontiguousarray(qp[..., 0] | (qp[..., 1] << 4))

    def tiles(a):
        ap = np.zeros((g, nt * COLS), np.float32)
        ap[:, :n] = a
        return np.ascontiguousarray(ap.reshape(g, nt, COLS).transpose(1, 0, 2))

    return packed, tiles(s), tiles(m)


def dequantize(q: jax.Array, s: jax.Array, m: jax.Array, n: int, dtype=jnp.float32) -> jax.Array:
    """The packed weight's float values [K, N] (the reference's operand): `pack` undone."""
    nt, g = q.shape[-4], q.shape[-3]
    lo = (q & 15).astype(jnp.float32)
    hi = (q >> 4).astype(jnp.float32)
    vals = jnp.stack([lo, hi], axis=-2)  # [t, g, j, h, c]
    w = vals * s[:, :, None, None, :] + m[:, :, None, None, :]
    w = w.reshape(nt, g * GROUP, COLS).transpose(1, 0, 2).reshape(g * GROUP, nt * COLS)
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
    """`x @ w` by the native kernel, f32 sums: per group the x * q sums, then s * sums + m *
    sum(x over the group); each packed byte is read once for all R rows."""
    library.require("the w4a16 native matmul", "the jnp reference (matmul_backend 'xla')")
    if (x.dtype != jnp.float32 or x.ndim != 2 or q.dtype != jnp.uint8 or q.ndim != 4
            or x.shape[1] != q.shape[1] * GROUP or s.shape != q.shape[:2] + (COLS,)
            or m.shape != s.shape or q.shape[0] != -(-n // COLS)):
        raise ValueError(f"w4_matmul takes x [R, K] float32 and pack()'s q, s, m for a w [K, {n}]"
                         f", got x {x.dtype}{x.shape}, q {q.dtype}{q.shape}, s {s.shape}")
    call = jax.ffi.ffi_call(library.target("jengine_w4_matmul"),
                            jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x, q, s, m, n=np.int64(n), isa=np.int32(library.isa_code("w4_matmul", isa)),
                max_threads=np.int32(max_threads))
