"""A synthetic `ScheduledBatch` for the step benchmarks in experiments/ (no scheduler involved)."""

from __future__ import annotations

import numpy as np

from jengine.scheduling.batch import ScheduledBatch


def synthetic_batch(num_seqs: int, q_len: int, cached: int, page_size: int) -> ScheduledBatch:
    """`num_seqs` sequences of `cached` tokens already in the cache, each running `q_len` new
    query tokens (1: a decode), on disjoint pages 1, 2, ... (page 0 is the scratch page)."""
    kv_len = cached + q_len
    pages = -(-kv_len // page_size)
    table = 1 + np.arange(num_seqs * pages, dtype=np.int32).reshape(num_seqs, pages)
    positions = np.concatenate([np.arange(cached, kv_len, dtype=np.int32)] * num_seqs)
    seq_of = np.repeat(np.arange(num_seqs), q_len)
    slots = table[seq_of, positions // page_size] * page_size + positions % page_size
    rng = np.random.default_rng(0)
    return ScheduledBatch(
        seq_ids=list(range(num_seqs)),
        token_ids=rng.integers(0, 40000, size=num_seqs * q_len).astype(np.int32),
        positions=positions, slot_mapping=slots.astype(np.int32),
        q_lens=np.full((num_seqs,), q_len, np.int32),
        kv_lens=np.full((num_seqs,), kv_len, np.int32),
        page_table=table, sample=np.ones((num_seqs,), bool),
    )
