"""On-device layout shared by the Pallas kernels: flat ragged query tokens -> per-sequence blocks.

Both kernels take the reference's signature (flat `token_seq`, `positions`, `page_table`) and,
inside the same jit, regroup the tokens into blocks of `B` query rows of one sequence each.
A kernel grid point is then (block, head group): it reads one sequence's pages once for up to
`B` query tokens x `G` query heads, and it only visits the pages between the block's first
visible key (`kv_lo`, from the sliding window) and its last (`kv_hi`, from causality).

Nothing assumes the host's token order: tokens are grouped by a stable sort on `token_seq`, and
every row carries its own position, so bucket padding (sequence 0, position 0) is one more query
row of sequence 0 and costs nothing but its row. Einsum letters as in `reference.py`; n block,
r row in a block (token x query head of the group), q query head group.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

NO_WINDOW = jnp.iinfo(jnp.int32).max


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QueryBlocks:
    """Where each block's rows come from and which key positions the block can see."""

    rows: jax.Array  # [NB, B] int32 flat token of each row; T marks an empty row
    seq: jax.Array  # [NB] int32 sequence of each block (0 for empty blocks)
    row_pos: jax.Array  # [NB, B] int32 position of each row; -1 for empty rows (sees no key)
    kv_lo: jax.Array  # [NB] int32 first key position any row may see
    kv_hi: jax.Array  # [NB] int32 one past the last key position any row may see (0: empty)


def num_query_blocks(num_tokens: int, num_seqs: int, block: int) -> int:
    """Static bound on the block count: sum over sequences of ceil(n_s / B) with sum n_s = T."""
    busy = min(num_seqs, num_tokens)
    return max(1, (num_tokens + busy * (block - 1)) // block)


def default_block_q(num_tokens: int, num_seqs: int, cap: int = 16) -> int:
    """Query rows per block for a bucket: 1 for decode buckets (T <= S: a bigger block would be
    mostly empty rows), up to `cap` (a power of two) as the tokens per sequence grow."""
    per_seq = max(1, min(cap, num_tokens // max(num_seqs, 1)))
    return 1 << (per_seq.bit_length() - 1)


def make_query_blocks(
    token_seq: jax.Array,  # [T] int32
    positions: jax.Array,  # [T] int32
    num_seqs: int,
    block: int,
    window: jax.Array,  # [] int32 (NO_WINDOW when there is none)
) -> QueryBlocks:
    """Groups each sequence's query tokens into blocks of `block` rows (traceable, no host)."""
    num_tokens = token_seq.shape[0]
    num_blocks = num_query_blocks(num_tokens, num_seqs, block)
    order = jnp.argsort(token_seq, stable=True)  # [T] tokens grouped by sequence
    counts = jnp.bincount(token_seq, length=num_seqs)  # [S]
    starts = jnp.cumsum(counts) - counts  # [S] first sorted index of each sequence
    blocks_per_seq = (counts + block - 1) // block
    ends = jnp.cumsum(blocks_per_seq)  # [S]
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    # Every block against every end ([NB, S] compares): the default method is a `while` loop,
    # which on a GPU waits on the host each iteration.
    seq = jnp.searchsorted(ends, b, side="right", method="compare_all").astype(jnp.int32)
    live = seq < num_seqs
    seq = jnp.where(live, seq, 0)
    within = (b - (ends[seq] - blocks_per_seq[seq]))[:, None] * block + jnp.arange(block)
    valid = live[:, None] & (within < counts[seq][:, None])  # [NB, B]
    flat = order[jnp.clip(starts[seq][:, None] + within, 0, num_tokens - 1)]
    rows = jnp.where(valid, flat, num_tokens).astype(jnp.int32)
    row_pos = jnp.where(valid, positions[flat], -1).astype(jnp.int32)
    kv_hi = jnp.max(row_pos, axis=1) + 1
    first = jnp.min(jnp.where(valid, row_pos, NO_WINDOW), axis=1)
    kv_lo = jnp.maximum(first - window + 1, 0)  # no overflow: 0 <= first, 1 <= window <= max
    kv_lo = jnp.minimum(kv_lo, kv_hi)
    return QueryBlocks(rows=rows, seq=seq, row_pos=row_pos, kv_lo=kv_lo, kv_hi=kv_hi)


def head_groups(
    num_heads: int, num_kv_heads: int, kv_head_map
) -> tuple[jax.Array, int]:
    """kv head of each query-head group ([NG] int32) and the group size G.

    Without a map, group k is q heads k*G..(k+1)*G-1 (HF `repeat_kv`). With an explicit map
    (tensor parallel, kv heads replicated, q heads padded) every q head is its own group; the map
    may be a traced array (its shard's slice under `shard_map`).
    """
    if kv_head_map is None:
        return jnp.arange(num_kv_heads, dtype=jnp.int32), num_heads // num_kv_heads
    return jnp.asarray(kv_head_map, jnp.int32), 1


def gather_queries(
    q: jax.Array,  # [T, H, D]
    blocks: QueryBlocks,
    group: int,
    group_pad: int | None = None,
) -> jax.Array:  # [NB, NG, B * Gp, D]
    """Query rows of each (block, head group), token-major: row = token * Gp + head in group."""
    num_tokens, num_heads, head_dim = q.shape
    qb = jnp.concatenate([q, jnp.zeros((1, num_heads, head_dim), q.dtype)])[blocks.rows]
    num_blocks, block = blocks.rows.shape
    qb = qb.reshape(num_blocks, block, num_heads // group, group, head_dim)
    gp = group_pad or group
    if gp > group:
        qb = jnp.pad(qb, ((0, 0), (0, 0), (0, 0), (0, gp - group), (0, 0)))
    return qb.transpose(0, 2, 1, 3, 4).reshape(num_blocks, num_heads // group, block * gp, head_dim)


def row_positions(blocks: QueryBlocks, group: int) -> jax.Array:  # [NB, B * G]
    """Each query row's position (its token's), repeated over the heads of the group."""
    return jnp.repeat(blocks.row_pos, group, axis=1)


def scatter_outputs(
    out: jax.Array,  # [NB, NG, B * Gp, D]
    blocks: QueryBlocks,
    num_tokens: int,
    group: int,
) -> jax.Array:  # [T, H, D]
    """Inverse of `gather_queries`: back to flat tokens, dropping padded heads and empty rows."""
    num_blocks, num_groups, _, head_dim = out.shape
    block = blocks.rows.shape[1]
    out = out.reshape(num_blocks, num_groups, block, -1, head_dim)[:, :, :, :group]
    out = out.transpose(0, 2, 1, 3, 4).reshape(num_blocks * block, num_groups * group, head_dim)
    flat = jnp.zeros((num_tokens + 1, num_groups * group, head_dim), out.dtype)
    return flat.at[blocks.rows.reshape(-1)].set(out)[:num_tokens]


def window_scalar(sliding_window) -> jax.Array:  # [] int32
    return jnp.asarray(NO_WINDOW if sliding_window is None else sliding_window, jnp.int32)
