"""Admitting a request: its prompt encoded and checked, its parameters checked against the
model, and its sequences (one per sample) built with their seeds, grammar matchers and
detokenizers. Every check raises ValueError before anything is queued."""

from __future__ import annotations

import dataclasses
import random
import time

import numpy as np

from jengine.core.request import RequestState, SampleState
from jengine.sampling_params import SamplingParams, check_text
from jengine.scheduling.sequence import ImageRows, Sequence
from jengine.structured import Grammar
from jengine.text.detokenizer import IncrementalDetokenizer


@dataclasses.dataclass(frozen=True)
class EncodedImagePrompt:
    """An image prompt after its preparation and the tower (`EngineCore.encode_images`): the
    token ids with the placeholders expanded and the encoded rows they take. The core admits
    it without touching the tower, so the encoding can run off the engine thread."""

    token_ids: list[int]
    images: ImageRows | None  # None: a prompt that turned out to hold no image


class Admission:
    """Turns (request id, prompt, SamplingParams) into a `RequestState` for one model."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, seed: int | None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._rng = random.Random(seed)  # None: seeded from the OS
        self._seq_counter = 0

    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(the prompt text or None, its token ids), checked against the vocabulary."""
        text = None
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            text, prompt = check_text("prompt", prompt), self.tokenizer(prompt).input_ids
        elif not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt
        ):
            raise ValueError("prompt must be a string or a list of token ids")
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        # Also guards text: a GGUF tokenizer may add special tokens the embedding table lacks.
        vocab = self.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return text, ids

    def request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                grammar: Grammar | None, *, prefill_only: bool = False,
                images: ImageRows | None = None) -> RequestState:
        """The request's state, its sequences not queued yet. `grammar`: the compiled
        `params.structured_outputs`, when there is one. `prefill_only` (an embedding): the
        prompt may fill the whole context, as the one token it "samples" is never run.
        `images`: the encoded images of a prompt of token ids (vision models)."""
        text, ids = self.encode_prompt(prompt)
        if params.truncate_prompt_tokens is not None:
            if images is not None and params.truncate_prompt_tokens < len(ids):
                raise ValueError("truncate_prompt_tokens cannot cut a prompt with images")
            ids = ids[-params.truncate_prompt_tokens:]
        self._check_token_ids(params)
        bad_words = self._bad_word_ids(params.bad_words)
        room = self.max_model_len - len(ids)
        if room < (0 if prefill_only else 1):
            raise ValueError(
                f"prompt has {len(ids)} tokens; the context length is {self.max_model_len}"
            )
        max_tokens = params.max_tokens_for(max(room, 1) if prefill_only else room)
        if max_tokens > room and not prefill_only:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                f"length {self.max_model_len}"
            )
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        samples = []
        for index in range(params.n):
            seq = Sequence(
                seq_id=self._next_seq_id(), request_id=request_id, index=index,
                prompt_ids=ids, params=params, seed=(base_seed + index) % (1 << 32),
                max_tokens=max_tokens, arrival=time.perf_counter(),
                matcher=grammar.matcher() if params.structured_outputs is not None else None,
                bad_words=bad_words, images=images,
            )
            detok = IncrementalDetokenizer(
                self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                keep_special_tokens=params.keep_special_tokens or (),
                stop=params.stop or (),
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
            )
            samples.append(SampleState(seq=seq, detok=detok))
        state = RequestState(request_id, text, ids, params, samples)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(ids)
        return state

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Token ids in the parameters must exist in the model's vocabulary."""
        vocab = self.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("stop_token_ids", params.stop_token_ids or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = sorted(t for t in ids if not 0 <= t < vocab)
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab}): "
                                 f"{bad[:5]}")

    def _bad_word_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each bad word as token ids, as written alone and after a space (vLLM does both)."""
        found = set()
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = tuple(self.tokenizer(text, add_special_tokens=False).input_ids)
                if ids:
                    found.add(ids)
        return tuple(sorted(found))

    def _next_seq_id(self) -> int:
        self._seq_counter += 1
        return self._seq_counter
