"""The sampler's per-row parameters of a step (`SamplingRows`), built on the host from the
scheduled sequences: temperatures, penalties, seeds and step offsets, and the logit bias that
carries `logit_bias`, `allowed_token_ids`, `bad_words` and the stop tokens that `min_tokens`
holds back."""

from __future__ import annotations

import numpy as np

from jengine.runtime.step_io import MAX_TOP_LOGPROBS, SamplingRows
from jengine.scheduling.batch import ScheduledBatch
from jengine.scheduling.sequence import Sequence


def sampling_rows(batch: ScheduledBatch, vocab_size: int,
                  eos_token_ids: tuple[int, ...]) -> SamplingRows:
    """One row per sampled row of `batch`: a verifying sequence's row j draws its output
    token len(output_ids) + j, with that step's key (jengine/scheduling/speculative.py)."""
    seqs = batch.seqs
    offsets = np.zeros((batch.num_rows,), np.int32)
    if batch.spec_lens is not None:
        row_seq = batch.row_seq
        seqs = [seqs[i] for i in row_seq]
        offsets = np.arange(batch.num_rows, dtype=np.int32) - batch.row_starts[row_seq]
    n = len(seqs)
    ps = [s.params for s in seqs]
    rows = SamplingRows(
        temperature=np.asarray([p.temperature for p in ps], np.float32),
        top_k=np.asarray([p.top_k for p in ps], np.int32),
        top_p=np.asarray([p.top_p for p in ps], np.float32),
        min_p=np.asarray([p.min_p for p in ps], np.float32),
        presence_penalty=np.asarray([p.presence_penalty for p in ps], np.float32),
        frequency_penalty=np.asarray([p.frequency_penalty for p in ps], np.float32),
        repetition_penalty=np.asarray([p.repetition_penalty for p in ps], np.float32),
        seeds=np.asarray([s.seed for s in seqs], np.uint32),
        steps=np.asarray([len(s.output_ids) for s in seqs], np.int32) + offsets,
    )
    if any(p.logprobs is not None for p in ps):
        rows.num_top_logprobs = MAX_TOP_LOGPROBS
    if any(p.uses_token_history for p in ps):
        rows.history = [(s.prompt_ids + s.output_ids, len(s.prompt_ids)) for s in seqs]
    banned = [_banned_now(s, eos_token_ids) | _bad_word_tokens(s) for s in seqs]
    allowed = [p.allowed_token_ids for p in ps]
    if any(p.logit_bias for p in ps) or any(banned) or any(allowed):
        bias = np.zeros((n, vocab_size), np.float32)
        for i, (p, ban, allow) in enumerate(zip(ps, banned, allowed)):
            if allow is not None:
                bias[i] = -np.inf
                bias[i, list(allow)] = 0.0
            for tid, b in (p.logit_bias or {}).items():  # ids checked at admission
                bias[i, tid] += b
            bias[i, list(ban)] = -np.inf
        rows.logit_bias = bias
    return rows


def _banned_now(seq: Sequence, eos_token_ids: tuple[int, ...]) -> set[int]:
    """Stop tokens masked while a sequence is still short of min_tokens."""
    p = seq.params
    if len(seq.output_ids) >= p.min_tokens or seq.matcher is not None:
        return set()  # a grammar decides itself when EOS may come
    stops = set(p.stop_token_ids or ())
    if not p.ignore_eos:
        stops |= set(eos_token_ids)
    return stops


def _bad_word_tokens(seq: Sequence) -> set[int]:
    """The tokens that would complete one of the sequence's bad words now: a word's last
    token when the tokens generated just before are the rest of the word."""
    if not seq.bad_words:
        return set()
    out = seq.output_ids
    banned = set()
    for word in seq.bad_words:
        head = list(word[:-1])
        if len(head) <= len(out) and (not head or out[len(out) - len(head):] == head):
            banned.add(word[-1])
    return banned
