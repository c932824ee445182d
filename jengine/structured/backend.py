"""The grammar-backend contract: what constrained decoding needs from a grammar library.

A backend compiles a `StructuredOutputs` spec once (`compile`, off the engine thread) into a
`Grammar`; each constrained sequence gets its own `Matcher` from it. Per step the engine asks every
constrained matcher to write its allowed-token row into the packed bitmask (bit j of word w set:
token 32 * w + j allowed, the sampler's layout), and after sampling feeds it the chosen token.
llguidance is the one implementation (`llguidance_backend.py`); xgrammar would fit the same shape.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from jengine.sampling_params import StructuredOutputs


class Matcher(Protocol):
    """The grammar state of one sequence: which tokens may come next, given those so far."""

    def fill_mask(self, mask: np.ndarray, row: int) -> None:
        """Writes the allowed next tokens into `mask[row]` ([W] int32 packed words)."""

    def accept(self, token: int) -> bool:
        """Advances past a sampled token; False when the grammar rejects it (an error state)."""

    @property
    def is_stopped(self) -> bool:
        """Whether the grammar is complete and allows nothing but EOS from here."""

    @property
    def error(self) -> str:
        """Why the matcher failed ('' while it has not)."""


class Grammar(Protocol):
    """A compiled constraint; cheap to start new matchers from, safe to share between threads."""

    def matcher(self) -> Matcher: ...


class GrammarBackend(Protocol):
    """Compiles specs for one tokenizer and vocabulary, and fills masks in bulk."""

    def compile(self, spec: StructuredOutputs) -> Grammar:
        """Compiles `spec`. Raises ValueError naming the problem when it is invalid or uses
        something the backend cannot enforce."""

    def fill_masks(self, matchers: list[tuple[Matcher, int]], mask: np.ndarray) -> None:
        """Fills `mask[row]` for every (matcher, row) pair, as one batch."""
