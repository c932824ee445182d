"""Speculative decoding, host side: who may speculate, what is proposed, and what is accepted.

A speculating decode runs its last token plus `k` proposed tokens as `k + 1` query rows of the
ordinary ragged step, and the sampler draws one token from each row's logits exactly as it would
without speculation (same processing, same key `fold_in(key(seed), step)` with the row's own
output index as `step`). Row `j` predicts the token after proposal `j`, so the host keeps row
`j + 1`'s token only while row `j`'s token equals proposal `j + 1`; the first mismatch ends the
run, and that row's draw is the step's extra ("bonus") token. Every kept token was therefore drawn
from the target model's distribution given exactly the tokens before it:

- greedy rows: the longest prefix of proposals equal to the argmax chain, plus one token;
- sampled rows: this is the standard rejection rule for a proposer that puts all its mass on one
  token `d` (the n-gram proposer does): accepting with probability min(1, p(d) / q(d)) = p(d) and
  otherwise drawing from the residual max(0, p - q) normalised (= p without `d`) emits `y` with
  probability p(y) for every `y`, which is what "draw y ~ p, keep the run going iff y == d"
  does. With the same keys as a plain decode, a seeded request even draws the same tokens.

Proposals never enter the prefix cache or a sequence's tokens before they are accepted; the
K/V the step wrote for rejected ones sits in slots past the sequence's end and is overwritten
when those positions are computed for real. Nothing here touches JAX.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

# A sequence that saw this many verifications in a row accept nothing pauses speculation for
# `BACKOFF_STEPS` steps (a plain decode each), so text the proposer cannot predict costs little.
MISSES_BEFORE_BACKOFF = 4
BACKOFF_STEPS = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's
    last `n` tokens (n from `ngram_max` down to `ngram_min`), in its own prompt and output."""

    num_tokens: int
    ngram_min: int = 1
    ngram_max: int = 4

    def __post_init__(self):
        if self.num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, "
                             f"{self.ngram_max}")

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `min(num_tokens, limit)` proposed next tokens of `tokens` ([] for none)."""
        k = min(self.num_tokens, limit)
        if k <= 0 or len(tokens) <= self.ngram_min:
            return []
        ids = np.asarray(tokens, np.int64)
        for n in range(min(self.ngram_max, len(ids) - 1), self.ngram_min - 1, -1):
            # Windows that start before the suffix itself and have a token after them.
            windows = sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest occurrence predicts best when copying
                return ids[start:start + k].tolist()
        return []


@dataclasses.dataclass
class SpecState:
    """One sequence's speculation state (on `Sequence.spec`).

    Attributes:
      proposal: the tokens proposed for the step now scheduled ([] when it does not speculate).
      misses: verifications in a row that accepted nothing.
      paused: steps left before the sequence proposes again (after `MISSES_BEFORE_BACKOFF`).
    """

    proposal: list[int] = dataclasses.field(default_factory=list)
    misses: int = 0
    paused: int = 0

    def may_propose(self) -> bool:
        if self.paused > 0:
            self.paused -= 1
            return False
        return True

    def verified(self, accepted: int) -> None:
        """Records how many of `proposal` the step accepted, and clears it."""
        self.proposal = []
        self.misses = 0 if accepted else self.misses + 1
        if self.misses >= MISSES_BEFORE_BACKOFF:
            self.misses, self.paused = 0, BACKOFF_STEPS


def num_accepted(proposal: list[int], drawn: np.ndarray) -> int:
    """How many proposals the drawn tokens confirm: `drawn[j]` (row j's token) must equal
    `proposal[j]` for every j before the count. `drawn` has len(proposal) + 1 entries."""
    n = 0
    while n < len(proposal) and int(drawn[n]) == proposal[n]:
        n += 1
    return n


@dataclasses.dataclass
class SpecCounters:
    """Speculation since start-up: verifications, tokens proposed, tokens accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
