"""The int8 KV cache's rows: one f32 scale per (token, kv head), symmetric over the head dim.

A row is quantized once, in XLA, when its token is written (`quantize_rows`), and every backend
reads it back as `int8 * scale` (`gather_rows`). The scale is per row and not per page because a
page fills one token at a time under decode: a page-wide scale would have to requantize the
page's earlier rows whenever a later token's absmax outgrew it. The price is 4 bytes a row, so a
pool holds 2 D / (D + 4) times bf16's tokens (1.88x at D = 64). Every backend's write quantizes
with this function, so all of them (reference, cpu, pallas_gpu, pallas_tpu) read the same cache.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

KV_INT8 = jnp.dtype(jnp.int8)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, K, D] -> (int8 [T, K, D], f32 scale [T, K, 1]) with x ~ q * scale.

    scale = absmax * f32(1 / 127) over the head dim (a zero row keeps scale 0 and q 0); q rounds to
    nearest even and lies in [-127, 127]."""
    x = x.astype(jnp.float32)
    # Times the f32 reciprocal, not / 127: XLA folds a division by a constant into that anyway.
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) * jnp.float32(1 / 127)
    q = jnp.clip(jnp.round(x / jnp.where(scale > 0, scale, 1.0)), -127, 127).astype(jnp.int8)
    return q, scale


def check_cache(backend: str, k_cache: jax.Array, k_scale: jax.Array | None) -> None:
    """A kernel's check of the cache it is given: an int8 cache comes with its scales and a
    float one without.

    Raises:
      ValueError: a mismatch."""
    int8 = k_cache.dtype == KV_INT8
    if int8 != (k_scale is not None):
        raise ValueError(f"{backend}: an int8 KV cache needs its scales (k_scale, v_scale), a "
                         "float one none")


def gather_rows(cache: jax.Array, scale: jax.Array | None,
                take: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """`take(cache)` (a gather of rows [..., D]), dequantized to f32 with `take(scale)` [..., 1]
    for an int8 cache; a float cache (`scale` None) is gathered as it is."""
    rows = take(cache)
    if scale is None:
        return rows
    return rows.astype(jnp.float32) * take(scale)
