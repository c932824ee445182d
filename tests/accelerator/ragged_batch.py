"""A ragged attention batch over shuffled cache pages, for kernel-against-reference checks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# (kv length, query length) per sequence: decodes, prefill chunks, kv length 1, page boundaries
MIXED = [(37, 1), (5, 5), (64, 16), (1, 1), (20, 1), (33, 9)]


def make_batch(rng, seqs, *, num_heads, num_kv, head_dim, page_size, dtype, spare_pages=4):
    """`seqs` is (kv_len, q_len) per sequence; the query tokens are the last q_len positions.
    Unwritten cache slots hold random values too, so a read past a sequence's end shows.

    Returns the kernels' positional arguments: q [T, H, D], k and v caches [1, K, P, O, D],
    layer 0, token_seq [T], positions [T], page_table [S, Pmax]."""
    pages_per_seq = [-(-kv // page_size) for kv, _ in seqs]
    num_pages = 1 + sum(pages_per_seq) + spare_pages
    width = max(pages_per_seq)
    pool = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((len(seqs), width), np.int32)
    start = 0
    for i, n in enumerate(pages_per_seq):
        table[i, :n] = pool[start:start + n]
        start += n
    cache_shape = (1, num_kv, num_pages, page_size, head_dim)
    k = jnp.asarray(rng.normal(size=cache_shape), dtype)
    v = jnp.asarray(rng.normal(size=cache_shape), dtype)
    token_seq = np.concatenate([np.full(q, i) for i, (_, q) in enumerate(seqs)]).astype(np.int32)
    positions = np.concatenate([np.arange(kv - q, kv) for kv, q in seqs]).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(len(token_seq), num_heads, head_dim)), dtype)
    return (q, k, v, jnp.int32(0), jnp.asarray(token_seq), jnp.asarray(positions),
            jnp.asarray(table))
