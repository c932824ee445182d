"""The host-side batch that the scheduler hands to the runner.

`ScheduledBatch` is plain NumPy, built by `Scheduler.schedule()` and read by `Runner.launch()`,
which pads it to a bucket and moves it to the device in one transfer. Nothing here touches JAX.

Token layout: the flat token axis holds, in order, the query tokens of every scheduled sequence
(decodes first, then prefill chunks); sequence `i` owns tokens `cu_q_lens[i]:cu_q_lens[i+1]`.

Row layout: the sampler draws one token per *row*. A sequence has one row (its last query token),
or `1 + spec_lens[i]` when it verifies proposed tokens (jengine/scheduling/speculative.py): its last
`1 + spec_lens[i]` query tokens each get a row, in order; sequence `i` owns rows
`row_starts[i]:row_starts[i+1]`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jengine.scheduling.sequence import Sequence


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
      spec_lens: [S] int32 proposed tokens each sequence verifies this step (the last ones of
        its query tokens), or None when none does.
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
    spec_lens: np.ndarray | None = None
    # [S] int32 each sequence's recurrent-state slot (hybrid models), or None.
    state_slots: np.ndarray | None = None
    # [2, 2, MAX_COPIES] int32 recurrent-state copies around the forward (`StateCopies`;
    # hybrid models with prefix caching), or None.
    state_copies: np.ndarray | None = None
    # [S] the LoRA adapter id of each sequence (0: the base model), or None when none uses one.
    lora_ids: np.ndarray | None = None

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

    @property
    def rows_per_seq(self) -> np.ndarray:
        """[S] int32 sampled rows of each sequence (1 + its proposed tokens)."""
        ones = np.ones((self.num_seqs,), np.int32)
        return ones if self.spec_lens is None else ones + self.spec_lens

    @property
    def num_rows(self) -> int:
        return self.num_seqs if self.spec_lens is None else int(self.rows_per_seq.sum())

    @property
    def row_starts(self) -> np.ndarray:
        """[S + 1] int32 first row of each sequence."""
        return np.concatenate([[0], np.cumsum(self.rows_per_seq)]).astype(np.int32)

    @property
    def logits_indices(self) -> np.ndarray:
        """[R] int32 the query token whose logits each row samples from."""
        ends = self.cu_q_lens[1:]
        if self.spec_lens is None:
            return ends - 1
        rows = self.rows_per_seq
        back = np.arange(self.num_rows) - np.repeat(self.row_starts[1:], rows)  # -rows_i .. -1
        return (np.repeat(ends, rows) + back).astype(np.int32)

    @property
    def row_seq(self) -> np.ndarray:
        """[R] int32 the sequence of each row."""
        return np.repeat(np.arange(self.num_seqs, dtype=np.int32), self.rows_per_seq)


def build_batch(chosen: list[tuple[Sequence, int]], page_size: int,
                state_copies: np.ndarray | None = None) -> ScheduledBatch:
    """The step's batch: `n` query tokens of each chosen (sequence, n), from its first
    uncomputed token, a verifying sequence's proposals last. `state_copies`: a hybrid's
    snapshot copies (`ScheduledBatch.state_copies`)."""
    tokens, positions, slots = [], [], []
    q_lens, kv_lens, sample = [], [], []
    width = max(len(seq.pages) for seq, _ in chosen)
    page_table = np.zeros((len(chosen), width), np.int32)
    spec_lens = np.zeros((len(chosen),), np.int32)
    lora_ids = np.asarray([seq.lora_id for seq, _ in chosen], np.int64)
    for i, (seq, n) in enumerate(chosen):
        start = seq.num_computed
        pos = np.arange(start, start + n, dtype=np.int32)
        pages = np.asarray(seq.pages, np.int32)
        proposal = seq.spec.proposal if seq.spec is not None else []
        spec_lens[i] = len(proposal)
        tokens.extend(seq.tokens(start, start + n - len(proposal)) + proposal)
        positions.append(pos)
        slots.append(pages[pos // page_size] * page_size + pos % page_size)
        q_lens.append(n)
        kv_lens.append(start + n)
        sample.append(start + n - len(proposal) == seq.num_tokens)
        page_table[i, : len(seq.pages)] = pages
    return ScheduledBatch(
        seq_ids=[seq.seq_id for seq, _ in chosen],
        token_ids=np.asarray(tokens, np.int32),
        positions=np.concatenate(positions),
        slot_mapping=np.concatenate(slots).astype(np.int32),
        q_lens=np.asarray(q_lens, np.int32),
        kv_lens=np.asarray(kv_lens, np.int32),
        page_table=page_table,
        sample=np.asarray(sample, bool),
        seqs=[seq for seq, _ in chosen],
        spec_lens=spec_lens if spec_lens.any() else None,
        state_slots=(np.asarray([seq.state_slot or 0 for seq, _ in chosen], np.int32)
                     if any(seq.state_slot is not None for seq, _ in chosen) else None),
        lora_ids=lora_ids if lora_ids.any() else None, state_copies=state_copies,
    )
