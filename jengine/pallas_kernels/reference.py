"""Pure-JAX ragged paged attention: the CPU path and the oracle for the Pallas kernels.

Einsum letters: t query token (flat, ragged over sequences), k kv head, g query heads per kv
head, d head dim, s key slot within the sequence's gathered pages, p page, o offset in page.

Each query token gathers the pages of its own sequence (`page_table[token_seq[t]]`), so a decode
batch reads exactly its sequences' KV and a prefill chunk reads its prompt's KV once per token.
Key slot `s` of a sequence holds absolute position `s` (pages are in order), so causal and
sliding-window masks are plain comparisons against the query's position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_kv(
    cache: jax.Array,  # [L, P, O, K, D]
    layer: jax.Array,  # [] int32
    slot_mapping: jax.Array,  # [T] int32 flat slot = page * O + offset
    new: jax.Array,  # [T, K, D]
) -> jax.Array:
    """Scatters this step's keys (or values) of one layer into their pages, in place."""
    page_size = cache.shape[2]
    return cache.at[layer, slot_mapping // page_size, slot_mapping % page_size].set(
        new.astype(cache.dtype)
    )


def ragged_paged_attention(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [L, P, O, K, D]
    v_cache: jax.Array,  # [L, P, O, K, D]
    layer: jax.Array,  # [] int32
    token_seq: jax.Array,  # [T] int32 sequence (batch row) of each query token
    positions: jax.Array,  # [T] int32 absolute position of each query token
    page_table: jax.Array,  # [S, Pmax] int32
    *,
    sm_scale: float,
    sliding_window: jax.Array | int | None = None,  # [] int32; keys within this many positions
    soft_cap: float | None = None,
) -> jax.Array:  # [T, H, D]
    """Causal attention of each query token over its sequence's cached keys (GQA aware)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[3]
    page_size = k_cache.shape[2]
    pages = page_table[token_seq]  # [T, Pmax]
    k = k_cache[layer, pages].reshape(num_tokens, -1, num_kv_heads, head_dim)  # [T, S, K, D]
    v = v_cache[layer, pages].reshape(num_tokens, -1, num_kv_heads, head_dim)
    qg = q.reshape(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = jnp.einsum("tkgd,tskd->tkgs", qg, k, preferred_element_type=jnp.float32)
    scores = scores * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    key_pos = jnp.arange(pages.shape[1] * page_size, dtype=jnp.int32)  # [S]
    mask = key_pos[None, :] <= positions[:, None]  # [T, S] causal (implies key < kv_len)
    if sliding_window is not None:
        mask &= key_pos[None, :] > positions[:, None] - sliding_window
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("tkgs,tskd->tkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
