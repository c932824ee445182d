"""A core's structured-output machinery, built on first use (llguidance takes ~0.5 s to load a
tokenizer): the grammar compiler that any thread may submit to, and the per-step mask buffer
the engine thread fills for the constrained sequences of a batch."""

from __future__ import annotations

import threading

from jengine.structured import GrammarCompiler
from jengine.structured.bitmask import StepMasks


class LazyGrammars:
    """The compiler and the mask buffer of one core, made together the first time either is
    asked for; `masks` stays None until a constrained request has come."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 max_num_seqs: int):
        self._args = (tokenizer, vocab_size, eos_token_ids, max_num_seqs)
        self._lock = threading.Lock()
        self._compiler: GrammarCompiler | None = None
        self.masks: StepMasks | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                from jengine.structured.llguidance_backend import LLGuidanceBackend

                tokenizer, vocab_size, eos_token_ids, max_num_seqs = self._args
                backend = LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids)
                self.masks = StepMasks(backend, max_num_seqs, vocab_size)
                self._compiler = GrammarCompiler(backend)
            return self._compiler
