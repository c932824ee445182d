"""The host-side batch that the scheduler hands to the runner.

`ScheduledBatch` is plain NumPy, built by `Scheduler.schedule()` and read by `Runner.launch()`,
which pads it to a bucket and moves it to the device in one transfer. Nothing here touches JAX.

Token layout: the flat token axis holds, in order, the query tokens of every scheduled sequence
(decodes first, then prefill chunks); sequence `i` owns tokens `cu_q_lens[i]:cu_q_lens[i+1]`.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class ScheduledBatch:
    """One engine step's work, unpadded.

    Attributes:
      seq_ids: [S] ids of the scheduled sequences, in batch order.
      token_ids: [T] int32 input token of every query token.
      positions: [T] int32 absolute position of every query token.
      slot_mapping: [T] int32 flat KV slot (page * page_size + offset) receiving each token's K/V.
      q_lens: [S] int32 query tokens per sequence this step (1 for a decode).
      kv_lens: [S] int32 tokens of context each sequence has after this step (cached + new).
      page_table: [S, max_pages] int32 the sequence's pages in order, padded with 0 (page 0 is the
        reserved scratch page and never holds real data).
      sample: [S] bool True when the sequence's last query token yields a sampled token
        (False for a prefill chunk that does not reach the end of the prompt).
      seqs: [S] the scheduler's `Sequence` objects (host bookkeeping; never sent to the device).
    """

    seq_ids: list[int]
    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    q_lens: np.ndarray
    kv_lens: np.ndarray
    page_table: np.ndarray
    sample: np.ndarray
    seqs: list = dataclasses.field(default_factory=list, repr=False)  # the Sequence objects

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def cu_q_lens(self) -> np.ndarray:
        """[S + 1] int32 start of each sequence's tokens on the flat axis."""
        return np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int32)
