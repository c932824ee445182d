"""The quantized KV cache's rows: int8 or fp8 (e4m3), one f32 scale per (token, kv head),
symmetric over the head dim.

A row is quantized once, in XLA, when its token is written (`quantize_rows`), and every backend
reads it back as `row.astype(f32) * scale` (`gather_rows`). The scale is per row and not per page
because a page fills one token at a time under decode: a page-wide scale would have to
requantize the page's earlier rows whenever a later token's absmax outgrew it. The price is 4
bytes a row, so a pool holds 2 D / (D + 4) times bf16's tokens (1.88x at D = 64) in either
dtype. Every backend's write quantizes with this function, so all that read a dtype read the
same cache: int8 everywhere, fp8 in all but the native `cpu` kernel.

int8 rounds each element to one of 255 evenly spaced levels of the row's absmax; e4m3 keeps 3
mantissa bits at every magnitude (relative error ~6%, finer than int8 near zero, coarser near
the absmax), a format accelerators convert to and from in hardware.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jengine.cpu_kernels.attention import CACHE_DTYPES as CPU_CACHE_DTYPES

KV_INT8 = jnp.dtype(jnp.int8)
KV_FP8 = jnp.dtype(jnp.float8_e4m3fn)
# Each quantized dtype's largest magnitude: a row's absmax maps onto it.
_QMAX = {KV_INT8: 127.0, KV_FP8: 448.0}
# The attention backends that read each quantized dtype (the native cpu kernel widens the pages
# of its CACHE_DTYPES only: int8, not fp8), and the dtype's `kv_cache_dtype` name.
READERS = {dtype: tuple(b for b in ("reference", "cpu", "pallas_gpu", "pallas_tpu")
                        if b != "cpu" or dtype in CPU_CACHE_DTYPES) for dtype in (KV_INT8, KV_FP8)}
_NAMES = {KV_INT8: "int8", KV_FP8: "fp8"}


def is_quantized(dtype) -> bool:
    """Whether a cache of `dtype` holds quantized rows with scales (int8 or fp8)."""
    return jnp.dtype(dtype) in _QMAX


def quantize_rows(x: jax.Array, dtype=KV_INT8) -> tuple[jax.Array, jax.Array]:
    """x [T, K, D] -> (`dtype` [T, K, D], f32 scale [T, K, 1]) with x ~ q * scale.

    scale = absmax * f32(1 / qmax) over the head dim, qmax 127 for int8 and 448 for fp8 e4m3 (a
    zero row keeps scale 0 and q 0); q rounds to nearest even (to the integer, or to e4m3's
    nearest value) and lies in [-qmax, qmax]."""
    dtype = jnp.dtype(dtype)
    qmax = _QMAX[dtype]
    x = x.astype(jnp.float32)
    # Times the f32 reciprocal, not / qmax: XLA folds a division by a constant into that anyway.
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) * jnp.float32(1 / qmax)
    q = x / jnp.where(scale > 0, scale, 1.0)
    if dtype == KV_INT8:
        q = jnp.round(q)
    # The clip keeps a quotient that rounding pushed past qmax in range (e4m3fn has no inf).
    return jnp.clip(q, -qmax, qmax).astype(dtype), scale


def check_reader(dtype, backend: str) -> None:
    """Raises `ValueError` naming the backends that read a `dtype` cache when `backend` is not
    one of them (an engine's start-up check, and each kernel's)."""
    readers = READERS.get(jnp.dtype(dtype))
    if readers is not None and backend not in readers:
        raise ValueError(f"kv_cache_dtype {_NAMES[jnp.dtype(dtype)]} needs attention_backend "
                         f"{', '.join(readers[:-1])} or {readers[-1]}, not {backend!r}")


def check_cache(backend: str, k_cache: jax.Array, k_scale: jax.Array | None) -> None:
    """A kernel's check of the cache it is given: `backend` reads its dtype, and a quantized
    cache comes with its scales and a float one without.

    Raises:
      ValueError: either failing."""
    check_reader(k_cache.dtype, backend)
    quantized = is_quantized(k_cache.dtype)
    if quantized != (k_scale is not None):
        raise ValueError(f"{backend}: an int8 or fp8 KV cache needs its scales (k_scale, "
                         "v_scale), a float one none")


def gather_rows(cache: jax.Array, scale: jax.Array | None,
                take: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """`take(cache)` (a gather of rows [..., D]), dequantized to f32 with `take(scale)` [..., 1]
    for a quantized cache; a float cache (`scale` None) is gathered as it is."""
    rows = take(cache)
    if scale is None:
        return rows
    return rows.astype(jnp.float32) * take(scale)
