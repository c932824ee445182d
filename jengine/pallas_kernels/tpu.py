"""Ragged paged attention for TPU (Pallas Mosaic), same signature as the reference.

Grid: (query block n, head group q). A block holds up to `block_q` query tokens of one sequence
(see `block_layout.py`), a head group the `G` query heads that share one kv head, so one grid
point multiplies `[B*G, D]` queries against that kv head's pages. The pages stay in HBM
(`memory_space=pl.ANY`); the kernel walks the block's visible pages in chunks of
`pages_per_chunk`, each page of one head a contiguous `[O, D]` DMA into a double buffer in VMEM:
chunk c+1 is in flight while chunk c is multiplied. Softmax is online (running max, sum and
accumulator in float32), so no score matrix wider than one chunk exists.

Head dim and kv head count are never tiled: a block's trailing dims are the full `[B*G, D]`, so
head_dim 64 and a single or odd number of kv heads work (the limits of the upstream kernel came
from packing kv heads into 128 lanes, which this layout does not do).

An int8 or fp8 cache (`kv_quant`: one f32 scale per token and kv head) is read with its scales:
each page's `[O, 1]` scales travel in their own DMA next to its K/V pages, and a chunk's tile is
dequantized (`row * scale`, in float32, then the queries' dtype) before its dots, so the kernel
computes what the reference computes on the same cache while reading half the bytes of bf16.

Scalar prefetch (SMEM): layer, window, per-block sequence / first / last visible key, the kv head
of each group, and the flattened page table. K/V writing stays `reference.write_kv` (an XLA
scatter in place on the donated cache), run before the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jengine.pallas_kernels import block_layout as qb
from jengine.pallas_kernels.kv_quant import check_cache

MASKED = -1e30  # finite, so a fully masked row gives exp(MASKED - MASKED) = 1 -> masked to 0


def ragged_paged_attention_tpu(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [L, K, P, O, D]
    v_cache: jax.Array,  # [L, K, P, O, D]
    layer: jax.Array,  # [] int32
    token_seq: jax.Array,  # [T] int32
    positions: jax.Array,  # [T] int32
    page_table: jax.Array,  # [S, Pmax] int32
    *,
    sm_scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
    kv_head_map=None,  # [H] tuple or int32 array, or None
    k_scale: jax.Array | None = None,  # an int8 / fp8 cache's scales [L, K, P, O, 1] (`kv_quant`)
    v_scale: jax.Array | None = None,
    block_q: int | None = None,  # default: `block_layout.default_block_q`
    pages_per_chunk: int = 8,
    interpret=False,  # False, or pltpu.InterpretParams() for TPU emulation on CPU
) -> jax.Array:  # [T, H, D]
    """Causal GQA attention of each query token over its sequence's pages (TPU kernel)."""
    check_cache("pallas_tpu", k_cache, k_scale)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size = k_cache.shape[1:4]
    num_seqs, max_pages = page_table.shape
    block_q = block_q or qb.default_block_q(num_tokens, num_seqs)
    window = qb.window_scalar(sliding_window)
    blocks = qb.make_query_blocks(token_seq, positions, num_seqs, block_q, window)
    head_kv, group = qb.head_groups(num_heads, num_kv_heads, kv_head_map)
    queries = qb.gather_queries(q, blocks, group)  # [NB, NG, R, D]
    row_pos = qb.row_positions(blocks, group)[:, :, None]  # [NB, R, 1]
    num_blocks, num_groups, rows, _ = queries.shape
    # The arrays each chunk copies from HBM, page by page: K, V, then a quantized cache's scales,
    # each into its own double buffer with its own pair of semaphores.
    sources = [k_cache, v_cache] + ([k_scale, v_scale] if k_scale is not None else [])
    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, soft_cap=soft_cap, page_size=page_size,
        pages_per_chunk=pages_per_chunk, max_pages=max_pages, num_sources=len(sources),
    )
    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda n, g, *_: (n, g, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=7,
        grid=(num_blocks, num_groups),
        in_specs=[
            q_spec,
            pl.BlockSpec((None, rows, 1), lambda n, g, *_: (n, 0, 0)),
            *(pl.BlockSpec(memory_space=pl.ANY) for _ in sources),
        ],
        out_specs=q_spec,
        scratch_shapes=[
            *(pltpu.VMEM((2, pages_per_chunk, *a.shape[3:]), a.dtype) for a in sources),
            pltpu.SemaphoreType.DMA((len(sources), 2)),
        ],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(queries.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(
        jnp.reshape(layer, (1,)).astype(jnp.int32), jnp.reshape(window, (1,)),
        blocks.seq, blocks.kv_lo, blocks.kv_hi, head_kv, page_table.reshape(-1),
        queries, row_pos, *sources,
    )
    return qb.scatter_outputs(out, blocks, num_tokens, group)


def _kernel(
    layer_ref, window_ref, seq_ref, lo_ref, hi_ref, head_kv_ref, pages_ref,  # SMEM
    q_ref, pos_ref,  # [R, D], [R, 1] in VMEM
    *refs,  # sources in HBM (K, V [, K scales, V scales]), o_ref [R, D], their buffers, sems
    sm_scale, soft_cap, page_size, pages_per_chunk, max_pages, num_sources,
):
    # Buffers: [2 (slot), C, O, D] for K/V, [2, C, O, 1] for scales; sems DMA [source, slot].
    hbm, o_ref = refs[:num_sources], refs[num_sources]
    bufs, sems = refs[num_sources + 1:-1], refs[-1]
    n, g = pl.program_id(0), pl.program_id(1)
    seq, kv_head, layer = seq_ref[n], head_kv_ref[g], layer_ref[0]
    # lax.div/rem, not // and %: all operands are >= 0, and floor division lowers through
    # `sign`, whose Mosaic rule asks for the local TPU generation (so no export from a CPU host).
    first_page = jax.lax.div(lo_ref[n], page_size)
    end_page = jax.lax.div(hi_ref[n] + page_size - 1, page_size)
    num_chunks = jax.lax.div(end_page - first_page + pages_per_chunk - 1, pages_per_chunk)

    def copies(chunk, slot):
        """The page DMAs of one chunk, C per source; pages past the table's width read its last
        column (page 0 or a real page) and are masked by position."""
        out = []
        for i in range(pages_per_chunk):
            index = jnp.minimum(first_page + chunk * pages_per_chunk + i, max_pages - 1)
            page = pages_ref[seq * max_pages + index]
            out.extend(pltpu.make_async_copy(src.at[layer, kv_head, page], buf.at[slot, i],
                                             sems.at[j, slot])
                       for j, (src, buf) in enumerate(zip(hbm, bufs, strict=True)))
        return out

    @pl.when(num_chunks > 0)
    def _():
        for c in copies(0, 0):
            c.start()

    q = q_ref[...]  # [R, D]
    row_pos = pos_ref[...]  # [R, 1]
    window = window_ref[0]
    rows, head_dim = q.shape
    keys = pages_per_chunk * page_size

    def tile(slot, j):
        """Source j's (K: 0, V: 1) chunk in `slot` as [C*O, D]; quantized rows times their scales
        (source j + 2) in float32, then cast to the queries' dtype for the dots."""
        x = bufs[j][slot]  # [C, O, D]
        if num_sources > 2:
            x = (x.astype(jnp.float32) * bufs[j + 2][slot]).astype(q.dtype)
        return x.reshape(keys, head_dim)

    def body(chunk, carry):
        m, l, acc = carry
        slot = jax.lax.rem(chunk, 2)

        @pl.when(chunk + 1 < num_chunks)
        def _():
            for c in copies(chunk + 1, 1 - slot):
                c.start()

        for c in copies(chunk, slot):
            c.wait()
        k, v = tile(slot, 0), tile(slot, 1)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * sm_scale  # [R, C*O]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        start = (first_page + chunk * pages_per_chunk) * page_size
        key_pos = start + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        mask = (key_pos <= row_pos) & (key_pos > row_pos - window)
        s = jnp.where(mask, s, MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, l, alpha * acc + pv

    init = (
        jnp.full((rows, 1), MASKED, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)
