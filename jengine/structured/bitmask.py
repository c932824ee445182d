"""`StepMasks`: the packed allowed-token bitmask of one step, filled on the host.

Only constrained rows that sample this step are filled (by the backend, in one parallel call that
releases the GIL); every other row allows everything. The array is allocated once, at the largest
batch; a step with no constrained row gets None, so it runs the step variant without a mask.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from jengine.structured.backend import GrammarBackend, Matcher

BITS_PER_WORD = 32


class Row(Protocol):
    """A batch row as the mask sees it (the scheduler's `Sequence` is one): its grammar state,
    None when unconstrained."""

    matcher: Matcher | None


class StepMasks:
    def __init__(self, backend: GrammarBackend, max_rows: int, vocab_size: int):
        self.backend = backend
        words = -(-vocab_size // BITS_PER_WORD)
        self._mask = np.full((max_rows, words), -1, np.int32)  # [S, W]

    def build(self, seqs: list[Row], sample: np.ndarray) -> np.ndarray | None:
        """[len(seqs), W] int32 for this step's rows, or None when no sampling row is
        constrained. The result is a view of a reused buffer: valid until the next call."""
        pairs = [(seq.matcher, i) for i, seq in enumerate(seqs)
                 if seq.matcher is not None and sample[i]]
        if not pairs:
            return None
        mask = self._mask[: len(seqs)]
        mask.fill(-1)
        self.backend.fill_masks(pairs, mask)
        return mask
