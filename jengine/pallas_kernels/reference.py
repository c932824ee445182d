"""Pure-JAX ragged paged attention: the CPU path and the oracle for the Pallas kernels.

Einsum letters: t query token (flat, ragged over sequences), k kv head, g query heads per kv
head, d head dim, s key slot within the sequence's gathered pages, p page, o offset in page.

Cache layout `[L, K, P, O, D]` (kv head outside the page): one page of one head is a contiguous
`[O, D]` block, so gathering a sequence's pages yields `[K, T, S, D]` with the kv head already
leading, and both attention matmuls run on that layout without a transpose copy. (With the head
inside the page, `[L, P, O, K, D]`, XLA:CPU materialised a transposed copy of every gathered
page; measured on SmolLM2 shapes, 64 decodes x 256 slots x 30 layers, the head-major layout cut
the attention time by about a quarter.)

Two layouts of the same computation:
- per token (decodes, small steps): each query token gathers its own sequence's pages
  (`page_table[token_seq[t]]`), so a decode batch reads exactly its sequences' KV;
- per query block (prefill-heavy steps): the host groups each sequence's query tokens into
  blocks of `B` (`block_tokens`, `block_seq`), and each block gathers its sequence's pages once,
  so a 512-token prefill chunk reads its prompt's KV 512 / B times instead of 512 times.
Key slot `s` of a sequence holds absolute position `s` (pages are in order), so causal and
sliding-window masks are plain comparisons against the query's position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_kv(
    cache: jax.Array,  # [L, K, P, O, D]
    layer: jax.Array,  # [] int32
    slot_mapping: jax.Array,  # [T] int32 flat slot = page * O + offset
    new: jax.Array,  # [T, K, D]
) -> jax.Array:
    """Scatters this step's keys (or values) of one layer into their pages, in place.

    A 16-bit float cache is scattered as its uint16 bits: XLA:CPU's scatter into a bf16 array
    converts the whole cache to f32 and back on every write (measured 17x slower), while the
    integer view is written in place."""
    rows = new.astype(cache.dtype)
    if cache.dtype.itemsize == 2:
        bits = jax.lax.bitcast_convert_type(cache, jnp.uint16)
        bits = _scatter(bits, layer, slot_mapping, jax.lax.bitcast_convert_type(rows, jnp.uint16))
        return jax.lax.bitcast_convert_type(bits, cache.dtype)
    return _scatter(cache, layer, slot_mapping, rows)


def _scatter(cache, layer, slot_mapping, rows):
    page_size = cache.shape[3]
    # The slice between the integer indices puts the indexed axes first: the target is [T, K, D].
    return cache.at[layer, :, slot_mapping // page_size, slot_mapping % page_size].set(rows)


def ragged_paged_attention(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [L, K, P, O, D]
    v_cache: jax.Array,  # [L, K, P, O, D]
    layer: jax.Array,  # [] int32
    token_seq: jax.Array,  # [T] int32 sequence (batch row) of each query token
    positions: jax.Array,  # [T] int32 absolute position of each query token
    page_table: jax.Array,  # [S, Pmax] int32
    *,
    sm_scale: float,
    sliding_window: jax.Array | int | None = None,  # [] int32; keys within this many positions
    soft_cap: float | None = None,
    kv_head_map: tuple[int, ...] | None = None,  # [H] kv head of each q head (else h // G)
) -> jax.Array:  # [T, H, D]
    """Causal attention of each query token over its sequence's cached keys (GQA aware)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size = k_cache.shape[1:4]
    pages = page_table[token_seq]  # [T, Pmax]
    k = k_cache[layer][:, pages].reshape(num_kv_heads, num_tokens, -1, head_dim)  # [K, T, S, D]
    v = v_cache[layer][:, pages].reshape(num_kv_heads, num_tokens, -1, head_dim)
    k, v, num_kv_heads = _per_query_head(k, v, num_kv_heads, kv_head_map)
    qg = q.reshape(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = jnp.einsum("ktsd,tkgd->ktsg", k, qg, preferred_element_type=jnp.float32)
    scores = scores * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    key_pos = jnp.arange(pages.shape[1] * page_size, dtype=jnp.int32)  # [S]
    mask = key_pos[None, :] <= positions[:, None]  # [T, S] causal (implies key < kv_len)
    if sliding_window is not None:
        mask &= key_pos[None, :] > positions[:, None] - sliding_window
    scores = jnp.where(mask[None, :, :, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=2).astype(v.dtype)  # [K, T, S, G]
    out = jnp.einsum("ktsg,ktsd->tkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def blocked_paged_attention(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [L, K, P, O, D]
    v_cache: jax.Array,  # [L, K, P, O, D]
    layer: jax.Array,  # [] int32
    positions: jax.Array,  # [T] int32
    page_table: jax.Array,  # [S, Pmax] int32
    block_tokens: jax.Array,  # [NB, B] int32 flat token of each block row; T marks padding
    block_seq: jax.Array,  # [NB] int32 sequence of each block
    *,
    sm_scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
    kv_head_map: tuple[int, ...] | None = None,
) -> jax.Array:  # [T, H, D]
    """Same result as `ragged_paged_attention`, computed per block of one sequence's queries."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size = k_cache.shape[1:4]
    num_blocks, block = block_tokens.shape
    pages = page_table[block_seq]  # [NB, Pmax]
    k = k_cache[layer][:, pages].reshape(num_kv_heads, num_blocks, -1, head_dim)  # [K, NB, S, D]
    v = v_cache[layer][:, pages].reshape(num_kv_heads, num_blocks, -1, head_dim)
    k, v, num_kv_heads = _per_query_head(k, v, num_kv_heads, kv_head_map)
    pad = jnp.zeros((1, num_heads, head_dim), q.dtype)
    qb = jnp.concatenate([q, pad])[block_tokens]  # [NB, B, H, D]
    qb = qb.reshape(num_blocks, block, num_kv_heads, num_heads // num_kv_heads, head_dim)
    pos = jnp.concatenate([positions, jnp.full((1,), -1, positions.dtype)])[block_tokens]
    scores = jnp.einsum("bqkgd,kbsd->bkgqs", qb, k, preferred_element_type=jnp.float32)
    scores = scores * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    key_pos = jnp.arange(pages.shape[1] * page_size, dtype=jnp.int32)
    mask = key_pos[None, None, :] <= pos[:, :, None]  # [NB, B, S]; padding rows see nothing
    if sliding_window is not None:
        mask &= key_pos[None, None, :] > pos[:, :, None] - sliding_window
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask[:, None, None], probs, 0.0).astype(v.dtype)  # padding rows: 0, not NaN
    out = jnp.einsum("bkgqs,kbsd->bqkgd", probs, v, preferred_element_type=jnp.float32)
    out = out.reshape(num_blocks * block, num_heads, head_dim).astype(q.dtype)
    flat = jnp.zeros((num_tokens + 1, num_heads, head_dim), q.dtype)
    return flat.at[block_tokens.reshape(-1)].set(out)[:num_tokens]


def _per_query_head(k, v, num_kv_heads, kv_head_map):
    """With an explicit q -> kv head map (tensor parallel, kv heads replicated, q heads padded),
    gives every q head its own kv row ([K, ...] -> [H, ...]) so the groups are of size 1."""
    if kv_head_map is None:
        return k, v, num_kv_heads
    index = jnp.asarray(kv_head_map, jnp.int32)
    return k[index], v[index], len(kv_head_map)


def query_blocks(
    q_lens, num_tokens: int, num_blocks: int, block: int
):
    """Host-side layout for `blocked_paged_attention` (NumPy in, NumPy out).

    Args:
      q_lens: [S] query tokens per sequence (sequence i owns the next q_lens[i] flat tokens).
      num_tokens: T, the padded token count (the padding marker).
      num_blocks: NB, a static bound: T // block + S blocks always suffice.
      block: B, query rows per block.

    Returns:
      block_tokens [NB, B] int32 and block_seq [NB] int32.
    """
    import numpy as np

    tokens = np.full((num_blocks, block), num_tokens, np.int32)
    seqs = np.zeros((num_blocks,), np.int32)
    b, start = 0, 0
    for i, n in enumerate(np.asarray(q_lens).tolist()):
        for off in range(0, n, block):
            m = min(block, n - off)
            tokens[b, :m] = np.arange(start + off, start + off + m)
            seqs[b] = i
            b += 1
        start += n
    return tokens, seqs
