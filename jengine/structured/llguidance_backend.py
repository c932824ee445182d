"""`LLGuidanceBackend`: JSON schema, regex, choice and Lark grammars through llguidance.

llguidance fills the packed int32 bitmask in our layout directly (bit j of word w = token
32 * w + j), compiles schemas in milliseconds, and rejects JSON-schema keywords it cannot enforce
instead of ignoring them; its message becomes the ValueError (HTTP 400) of the request.
EOS is part of its mask: the tokenizer wrapper is built with the engine's EOS ids, so the mask
allows EOS exactly when the grammar accepts.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

from jengine.sampling_params import StructuredOutputs

# JSON output as models usually write it (`{"a": 1, "b": [2, 3]}`), with no free whitespace:
# flexible whitespace lets a small sampled model pad with newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON form) of a spec; compile errors surface in the matcher."""
    if spec.json is not None:
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                             defaults=JSON_OPTIONS)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        lark = "start: " + " | ".join(json.dumps(c) for c in spec.choice)
        return llguidance.LLMatcher.grammar_from_lark(lark)
    if spec.grammar is not None:
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted
    raise ValueError("structured_outputs: no constraint set")


class LLGuidanceMatcher:
    """One sequence's llguidance matcher (see `backend.Matcher`)."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._m = matcher

    def fill_mask(self, mask: np.ndarray, row: int) -> None:
        llguidance.numpy.fill_next_token_bitmask(self._m, mask, row)

    def accept(self, token: int) -> bool:
        return self._m.consume_token(token)

    @property
    def is_stopped(self) -> bool:
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()


class LLGuidanceGrammar:
    """A compiled grammar: a pristine matcher that new sequences copy."""

    def __init__(self, template: llguidance.LLMatcher):
        self._template = template

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template.deep_copy())


class LLGuidanceBackend:
    """llguidance over the engine's Hugging Face fast tokenizer."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self._executor = llguidance.LLExecutor()

    def compile(self, spec: StructuredOutputs) -> LLGuidanceGrammar:
        try:
            text = grammar_text(spec)
        except (ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs: {e}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {_one_line(matcher.get_error())}")
        return LLGuidanceGrammar(matcher)

    def fill_masks(self, matchers: list[tuple[LLGuidanceMatcher, int]], mask: np.ndarray) -> None:
        pairs = [(m._m, row) for m, row in matchers]
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, pairs, mask)


def _one_line(message: str) -> str:
    """llguidance errors can span lines (with a source excerpt); one line for an HTTP 400."""
    text = " ".join(line.strip() for line in message.strip().splitlines() if line.strip())
    return text[:500] or "invalid grammar"
