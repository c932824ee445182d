"""Ragged paged attention for GPU (Pallas Triton lowering), same signature as the reference.

Grid: (query block n, head group q, kv split s). A block holds up to `block_q` query tokens of one
sequence (see `block_layout.py`) and a head group the query heads sharing one kv head, so a
program multiplies `[B*Gp, D]` queries (Gp: group size rounded up to a power of two, as Triton
block shapes must be) against `pages_per_step` pages of that kv head per loop step (`[C*O, D]`,
gathered in place from the cache through the page table, as upstream's GPU paged attention
does), with online softmax in float32.

Split-K: the block's visible pages are cut into `num_kv_splits` contiguous ranges, one program
each; every program writes its unnormalised accumulator with its running max and sum, and a small
XLA epilogue merges them (log-sum-exp). Decode at long context wants splits (one query row per
block leaves few programs: batch x kv heads); prefill wants 1.

Query rows are padded to at least 16 (zero heads) so that decode tiles use `tl.dot` as well
(decode is bound by reading K/V, not by the wasted rows); only a page tile or head dim below 16
falls back to broadcast-multiply-sum. K/V writing stays `reference.write_kv`.

An int8 or fp8 cache (`kv_quant`: one f32 scale per token and kv head) is read with its scales:
each gathered tile is dequantized (`row * scale`, in float32) before its dots, so the kernel
computes what the reference computes on the same cache; it halves the bytes a decode reads
against bf16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jengine.pallas_kernels import block_layout as qb
from jengine.pallas_kernels.kv_quant import check_cache

MASKED = -1e30


def ragged_paged_attention_gpu(
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
    num_kv_splits: int | None = None,  # default: decode blocks split long contexts up to 8 ways
    pages_per_step: int = 4,  # pages gathered per loop step (one [C*O, D] tile)
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:  # [T, H, D]
    """Causal GQA attention of each query token over its sequence's pages (GPU kernel)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size = k_cache.shape[1:4]
    num_seqs, max_pages = page_table.shape
    block_q = block_q or qb.default_block_q(num_tokens, num_seqs)
    if num_kv_splits is None:
        num_kv_splits = min(8, max(1, max_pages // 16)) if block_q == 1 else 1
    for name, n in (("head_dim", head_dim), ("page_size", page_size), ("block_q", block_q),
                    ("pages_per_step", pages_per_step)):
        if n & (n - 1):
            raise ValueError(f"pallas_gpu needs a power-of-two {name}, got {n}")
    window = qb.window_scalar(sliding_window)
    blocks = qb.make_query_blocks(token_seq, positions, num_seqs, block_q, window)
    head_kv, group = qb.head_groups(num_heads, num_kv_heads, kv_head_map)
    # Rows padded to at least 16 (zero query heads), so decode tiles use `tl.dot` too.
    group_pad = max(1 << (group - 1).bit_length(), 16 // block_q)
    queries = qb.gather_queries(q, blocks, group, group_pad)  # [NB, NG, R, D]
    row_pos = qb.row_positions(blocks, group_pad)  # [NB, R] (padded heads: harmless rows)
    num_blocks, num_groups, rows, _ = queries.shape
    check_cache("pallas_gpu", k_cache, k_scale)
    quantized = k_scale is not None
    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, soft_cap=soft_cap, page_size=page_size,
        max_pages=max_pages, num_splits=num_kv_splits, pages_per_step=pages_per_step,
        quantized=quantized,
    )
    whole = pl.BlockSpec()  # the whole array, indexed in place by the kernel
    # The scales without their trailing axis of 1 ([L, K, P, O]: a free reshape), gathered with
    # the pages they belong to; a float cache passes none.
    scales = [s.reshape(s.shape[:-1]) for s in (k_scale, v_scale)] if quantized else []
    grid = (num_blocks, num_groups, num_kv_splits)
    part = (num_blocks, num_groups, num_kv_splits, rows)
    acc, m, l = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            whole, whole, whole, whole, whole, whole, whole,
            pl.BlockSpec((None, None, rows, head_dim), lambda n, g, s: (n, g, 0, 0)),
            pl.BlockSpec((None, rows), lambda n, g, s: (n, 0)),
            whole, whole, *(whole for _ in scales),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda n, g, s: (n, g, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda n, g, s: (n, g, s, 0)),
            pl.BlockSpec((None, None, None, rows), lambda n, g, s: (n, g, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*part, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(
        jnp.reshape(layer, (1,)).astype(jnp.int32), jnp.reshape(window, (1,)),
        blocks.seq, blocks.kv_lo, blocks.kv_hi, head_kv, page_table.reshape(-1),
        queries, row_pos, k_cache, v_cache, *scales,
    )
    out = merge_splits(acc, m, l).astype(q.dtype)  # [NB, NG, R, D]
    return qb.scatter_outputs(out, blocks, num_tokens, group)


def merge_splits(acc, m, l):
    """[NB, NG, S, R, D] partial accumulators with their maxima and sums [NB, NG, S, R] ->
    normalised [NB, NG, R, D]; splits that saw no key (l == 0) weigh nothing."""
    top = jnp.max(m, axis=2, keepdims=True)
    weight = jnp.where(l > 0.0, jnp.exp(m - top), 0.0)  # [NB, NG, S, R]
    total = jnp.sum(weight * l, axis=2)
    out = jnp.sum(weight[..., None] * acc, axis=2)
    return out / jnp.where(total == 0.0, 1.0, total)[..., None]


def _kernel(
    layer_ref, window_ref, seq_ref, lo_ref, hi_ref, head_kv_ref, pages_ref,
    q_ref, pos_ref, k_ref, v_ref, *refs,  # [R, D], [R], caches [L, K, P, O, D], (scales)
    sm_scale, soft_cap, page_size, max_pages, num_splits, pages_per_step, quantized,
):
    # refs: a quantized cache's scales [L, K, P, O], then the outputs [R, D], [R], [R].
    ks_ref, vs_ref = refs[:2] if quantized else (None, None)
    acc_ref, m_ref, l_ref = refs[2:] if quantized else refs
    n, g, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq, kv_head, layer, window = seq_ref[n], head_kv_ref[g], layer_ref[0], window_ref[0]
    first_page = lo_ref[n] // page_size
    end_page = (hi_ref[n] + page_size - 1) // page_size
    per_split = (end_page - first_page + num_splits - 1) // num_splits
    start = first_page + split * per_split
    stop = jnp.minimum(start + per_split, end_page)
    q = q_ref[...]  # [R, D]
    row_pos = pos_ref[...]  # [R]
    rows, head_dim = q.shape
    use_dot = min(rows, pages_per_step * page_size, head_dim) >= 16
    exact = q.dtype == jnp.float32

    keys = pages_per_step * page_size

    def body(step, carry):
        m, l, acc = carry
        first = start + step * pages_per_step
        index = jnp.minimum(first + jnp.arange(pages_per_step), max_pages - 1)  # [C]
        pages = pages_ref[seq * max_pages + index]  # [C] gathered from the flat page table
        k = k_ref[layer, kv_head, pages].reshape(keys, head_dim)  # [C*O, D] gathered pages
        v = v_ref[layer, kv_head, pages].reshape(keys, head_dim)
        if quantized:  # int8 / fp8 rows times their scales, in the queries' dtype for the dots
            k_rows = ks_ref[layer, kv_head, pages].reshape(keys, 1)
            v_rows = vs_ref[layer, kv_head, pages].reshape(keys, 1)
            k = (k.astype(jnp.float32) * k_rows).astype(q.dtype)
            v = (v.astype(jnp.float32) * v_rows).astype(q.dtype)
        if use_dot:
            s = plgpu.dot(q, k, trans_b=True, allow_tf32=not exact).astype(jnp.float32)
        else:
            s = jnp.sum(q[:, None, :].astype(jnp.float32) * k[None].astype(jnp.float32), axis=2)
        s = s * sm_scale  # [R, O]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = first * page_size + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        mask = (key_pos <= row_pos[:, None]) & (key_pos > row_pos[:, None] - window)
        mask &= key_pos < stop * page_size  # the last step's tail belongs to the next split
        s = jnp.where(mask, s, MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        l = alpha * l + jnp.sum(p, axis=1)
        if use_dot:
            pv = plgpu.dot(p.astype(v.dtype), v, allow_tf32=not exact).astype(jnp.float32)
        else:
            pv = jnp.sum(p[:, :, None] * v[None].astype(jnp.float32), axis=1)
        return m_new, l, alpha[:, None] * acc + pv

    init = (
        jnp.full((rows,), MASKED, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    num_steps = (stop - start + pages_per_step - 1) // pages_per_step
    m, l, acc = jax.lax.fori_loop(0, num_steps, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l
