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
  blocks of `B` (`block_tokens`, `block_seq`), and each block reads its sequence's visible pages
  once, a chunk of pages at a time, so a 512-token prefill chunk reads its prompt's KV 512 / B
  times instead of 512 times, and no block reads past its last query (or before its window).
Key slot `s` of a sequence holds absolute position `s` (pages are in order), so causal and
sliding-window masks are plain comparisons against the query's position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jengine.pallas_kernels.kv_quant import gather_rows

# Loop sizes of `blocked_paged_attention`: blocks per group and pages per key chunk. Smaller
# groups waste fewer empty blocks; a group's scores [Gb, K, G, B, C*O] should stay in cache
# (0.6 MB at SmolLM2's shapes). On a 512-token chunk over 1000 keys, 2-8 x 4-16 timed
# within noise of each other; 16 x 16 and 16 x 32 were 2-3x slower.
BLOCKS_PER_GROUP = 4
PAGES_PER_CHUNK = 8


def write_kv(
    cache: jax.Array,  # [L, K, P, O, D]
    layer: jax.Array,  # [] int32
    slot_mapping: jax.Array,  # [T] int32 flat slot = page * O + offset
    new: jax.Array,  # [T, K, D]
) -> jax.Array:
    """Scatters this step's keys (or values) of one layer into their pages, in place.

    An int8 or fp8 cache takes rows its caller quantized (`kv_quant.quantize_rows`), and their
    scales are written the same way into the [L, K, P, O, 1] scale array. A float cache narrower
    than f32 (bf16, fp8) is scattered as its unsigned-integer bits: XLA:CPU's scatter into a
    bf16 array converts the whole cache to f32 and back on every write (measured 17x slower),
    while the integer view is written in place."""
    rows = new.astype(cache.dtype)
    if cache.dtype.itemsize < 4 and jnp.issubdtype(cache.dtype, jnp.floating):
        bits_dtype = jnp.dtype(f"uint{8 * cache.dtype.itemsize}")
        bits = jax.lax.bitcast_convert_type(cache, bits_dtype)
        bits = _scatter(bits, layer, slot_mapping, jax.lax.bitcast_convert_type(rows, bits_dtype))
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
    attention_chunk: jax.Array | int | None = None,  # [] int32; keys in the query's chunk
    k_scale: jax.Array | None = None,  # [L, K, P, O, 1] f32: an int8 cache's row scales
    v_scale: jax.Array | None = None,  # [L, K, P, O, 1]
    sinks: jax.Array | None = None,  # [H] f32: gpt-oss's per-head sink logits
) -> jax.Array:  # [T, H, D]
    """Causal attention of each query token over its sequence's cached keys (GQA aware).

    An int8 cache (with `k_scale`, `v_scale`) is dequantized to f32 after the gather. `sinks`
    (gpt-oss's attention sinks): one more logit per head in the softmax's denominator that
    weighs no value, so a head may attend to almost nothing."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size = k_cache.shape[1:4]
    pages = page_table[token_seq]  # [T, Pmax]

    def take(x):
        return x[layer][:, pages]

    k, v = (gather_rows(cache, scale, take).reshape(num_kv_heads, num_tokens, -1, head_dim)
            for cache, scale in ((k_cache, k_scale), (v_cache, v_scale)))  # [K, T, S, D]
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
    if attention_chunk is not None:  # Llama 4: keys of the query's own chunk
        mask &= key_pos[None, :] >= positions[:, None] // attention_chunk * attention_chunk
    scores = jnp.where(mask[None, :, :, None], scores, -jnp.inf)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=2)
    else:
        sink = sinks.astype(jnp.float32).reshape(num_kv_heads, 1, 1, -1)  # [K, 1, 1, G]
        top = jnp.maximum(jnp.max(scores, axis=2, keepdims=True), sink)
        e = jnp.exp(scores - top)
        probs = e / (jnp.sum(e, axis=2, keepdims=True) + jnp.exp(sink - top))
    probs = probs.astype(v.dtype)  # [K, T, S, G]
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
    attention_chunk: jax.Array | int | None = None,
    blocks_per_group: int = BLOCKS_PER_GROUP,
    pages_per_chunk: int = PAGES_PER_CHUNK,
    k_scale: jax.Array | None = None,  # [L, K, P, O, 1] f32: an int8 cache's row scales
    v_scale: jax.Array | None = None,
    sinks: jax.Array | None = None,  # [H] f32
) -> jax.Array:  # [T, H, D]
    """Same result as `ragged_paged_attention`, computed per block of one sequence's queries.

    NB is a static bound (the bucket's worst case); the work is not. Blocks run `Gb` at a time
    in a loop that stops after the last group holding a live block, and each group walks its
    visible pages `C` at a time (online softmax in f32) from the first page any of its blocks
    can see (sliding window) to the last (causality). A page outside a block's span is read as
    the scratch page 0 and masked, so no block gathers a page it cannot see; an empty block
    costs nothing past the last live group, and its share of the dots within one.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size = k_cache.shape[1:4]
    group, chunk = blocks_per_group, pages_per_chunk
    num_groups = -(-block_tokens.shape[0] // group)
    block_tokens, block_seq = _pad_blocks(block_tokens, block_seq, num_groups * group, num_tokens)
    block = block_tokens.shape[1]
    heads = _kv_rows(num_kv_heads, kv_head_map)  # [NK] cache head of each kv row
    num_rows, per_kv = heads.shape[0], num_heads // heads.shape[0]
    pos = jnp.concatenate([positions, jnp.full((1,), -1, positions.dtype)])[block_tokens]
    first_page, end_page = _visible_pages(  # [NB] each
        pos, sliding_window, page_size, attention_chunk)
    group_chunks = jnp.max(-(-(end_page - first_page) // chunk).reshape(num_groups, group), 1)
    live_groups = jnp.max(jnp.where(group_chunks > 0, jnp.arange(num_groups) + 1, 0))
    tokens, pos, first_page, end_page, seqs = (
        x.reshape(num_groups, group, *x.shape[1:])
        for x in (block_tokens, pos, first_page, end_page, block_seq)
    )
    q_pad = jnp.concatenate([q, jnp.zeros((1, num_heads, head_dim), q.dtype)])  # row T: empty
    k_flat = k_cache.reshape(-1, page_size, head_dim)  # [L*K*P, O, D]: one gather per chunk
    v_flat = v_cache.reshape(-1, page_size, head_dim)
    k_scale_flat, v_scale_flat = (None if x is None else x.reshape(-1, page_size, 1)
                                  for x in (k_scale, v_scale))
    head_rows = (layer * num_kv_heads + heads) * num_pages  # [NK]
    state_shape = (group, num_rows, per_kv, block)  # [Gb, NK, G, B]

    def group_body(g, flat):
        qg = q_pad[tokens[g]].reshape(group, block, num_rows, per_kv, head_dim)
        qg = qg.transpose(0, 2, 3, 1, 4)  # [Gb, NK, G, B, D]
        row_pos = pos[g]  # [Gb, B]

        def chunk_body(c, state):
            m, l, acc = state  # [Gb, NK, G, B], same, [Gb, NK, G, B, D]
            page_idx = first_page[g][:, None] + c * chunk + jnp.arange(chunk)  # [Gb, C]
            in_span = page_idx < end_page[g][:, None]
            table_col = jnp.minimum(page_idx, page_table.shape[1] - 1)
            pages = jnp.where(in_span, page_table[seqs[g][:, None], table_col], 0)
            rows = head_rows[None, :, None] + pages[:, None, :]  # [Gb, NK, C]
            k, v = (gather_rows(flat, scale, lambda x: x[rows])
                    .reshape(group, num_rows, chunk * page_size, head_dim)
                    for flat, scale in ((k_flat, k_scale_flat), (v_flat, v_scale_flat)))
            key_pos = (page_idx[:, :, None] * page_size + jnp.arange(page_size)).reshape(group, -1)
            mask = key_pos[:, None, :] <= row_pos[:, :, None]  # [Gb, B, C*O]; empty rows: none
            if sliding_window is not None:
                mask &= key_pos[:, None, :] > row_pos[:, :, None] - sliding_window
            if attention_chunk is not None:
                span = row_pos[:, :, None] // attention_chunk * attention_chunk
                mask &= key_pos[:, None, :] >= span
            mask = mask[:, None, None]  # [Gb, 1, 1, B, C*O]
            s = jnp.einsum("bkgqd,bksd->bkgqs", qg, k, preferred_element_type=jnp.float32)
            s = s * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(mask, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that saw no key yet
            p = jnp.exp(s - shift[..., None])
            alpha = jnp.exp(m - shift)
            pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v.dtype), v,
                            preferred_element_type=jnp.float32)
            return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv

        init = (jnp.full(state_shape, -jnp.inf, jnp.float32), jnp.zeros(state_shape, jnp.float32),
                jnp.zeros((*state_shape, head_dim), jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, group_chunks[g], chunk_body, init)
        if sinks is not None:  # the sink's term joins the denominator at the end
            sink = sinks.astype(jnp.float32).reshape(1, num_rows, per_kv, 1)
            top = jnp.maximum(m, sink)
            keep = jnp.exp(m - top)  # 0 for a row that saw no key (m = -inf)
            l, acc = l * keep + jnp.exp(sink - top), acc * keep[..., None]
        out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]  # empty rows: 0
        out = out.transpose(0, 3, 1, 2, 4).reshape(group * block, num_heads, head_dim)
        return flat.at[tokens[g].reshape(-1)].set(out.astype(q.dtype))  # row T takes the empties

    flat = jnp.zeros((num_tokens + 1, num_heads, head_dim), q.dtype)
    return jax.lax.fori_loop(0, live_groups, group_body, flat)[:num_tokens]


def _pad_blocks(block_tokens, block_seq, num_blocks: int, num_tokens: int):
    """Empty blocks (rows T, sequence 0) up to `num_blocks`, a whole number of groups."""
    extra = num_blocks - block_tokens.shape[0]
    return (jnp.pad(block_tokens, ((0, extra), (0, 0)), constant_values=num_tokens),
            jnp.pad(block_seq, (0, extra)))


def _visible_pages(pos, sliding_window, page_size: int, attention_chunk=None):
    """[NB, B] row positions (-1: empty row) -> each block's first visible page and one past
    its last ([NB] each; equal for an empty block): keys from the window's start (or the
    chunk's) below the first row to the last row."""
    kv_hi = jnp.max(pos, axis=1) + 1  # 0 for an empty block
    kv_lo = jnp.zeros_like(kv_hi)
    first = jnp.min(jnp.where(pos >= 0, pos, jnp.iinfo(jnp.int32).max), axis=1)
    if sliding_window is not None:
        kv_lo = jnp.maximum(first - sliding_window + 1, 0)
    if attention_chunk is not None:
        kv_lo = jnp.maximum(kv_lo, first // attention_chunk * attention_chunk)
    kv_lo = jnp.minimum(kv_lo, kv_hi)
    return kv_lo // page_size, (kv_hi + page_size - 1) // page_size


def _kv_rows(num_kv_heads: int, kv_head_map) -> jax.Array:
    """The cache head each kv row reads: every kv head (GQA groups of H / K q heads), or with an
    explicit q -> kv map one row per q head (groups of 1)."""
    if kv_head_map is None:
        return jnp.arange(num_kv_heads, dtype=jnp.int32)
    return jnp.asarray(kv_head_map, jnp.int32)


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
      num_blocks: NB, a static bound (`block_layout.num_query_blocks(T, S, B)` suffices);
        the blocks past the real ones are empty.
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
