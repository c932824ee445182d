"""Logprob dicts (vLLM's shape: token id -> `Logprob`) built from a step's sampler outputs, for
sampled tokens and for prompt tokens (`prompt_logprobs`). Host-side; reads NumPy only."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from jengine.outputs import Logprob

Piece = Callable[[int], str]  # token id -> its text


def ranked(token: int, logprob: float, top_ids: np.ndarray | None,
           top_logprobs: np.ndarray | None, k: int, piece: Piece) -> dict[int, Logprob]:
    """The chosen token's Logprob (ranked when it is among `top_ids`) and the top `k` candidates.

    Args:
      token: the sampled (or prompt) token.
      logprob: its log-probability.
      top_ids, top_logprobs: [num_top] the most likely tokens, best first; None if not computed.
      k: how many candidates the request asked for.
      piece: decodes a token id for `Logprob.decoded_token`.
    """
    out = {token: Logprob(float(logprob), None, piece(token))}
    if top_ids is None:
        return out
    for rank, (tid, lp) in enumerate(zip(top_ids, top_logprobs)):
        tid = int(tid)
        if tid == token:
            out[token].rank = rank + 1
        if rank < k:
            out.setdefault(tid, Logprob(float(lp), rank + 1, piece(tid)))
    return out


def prompt_targets(batch, requests: Mapping) -> np.ndarray | None:
    """[T] for each query token of `batch`, the prompt token after it when its request asked for
    prompt logprobs (-1 elsewhere); None when nobody in the batch needs them."""
    targets = None
    for i, seq in enumerate(batch.seqs):
        state = requests.get(seq.request_id)
        if state is None or state.prompt_logprobs is None or seq.index != 0:
            continue
        start = int(batch.cu_q_lens[i])
        for j, pos in enumerate(batch.positions[start:start + int(batch.q_lens[i])]):
            if pos + 1 < len(seq.prompt_ids):
                if targets is None:
                    targets = np.full((batch.num_tokens,), -1, np.int32)
                targets[start + j] = seq.prompt_ids[pos + 1]
    return targets


def record_prompt_logprobs(batch, result, requests: Mapping, piece: Piece) -> None:
    """Fills `RequestState.prompt_logprobs` for the prompt positions this step computed (the
    first sample of each request that asked; positions already filled are kept)."""
    for i, seq in enumerate(batch.seqs):
        state = requests.get(seq.request_id)
        if state is None or state.prompt_logprobs is None or seq.index != 0:
            continue
        start = int(batch.cu_q_lens[i])
        for t in range(start, start + int(batch.q_lens[i])):
            nxt = int(batch.positions[t]) + 1
            if nxt >= len(seq.prompt_ids) or state.prompt_logprobs[nxt] is not None:
                continue
            state.prompt_logprobs[nxt] = ranked(
                seq.prompt_ids[nxt], result.prompt_logprobs[t], result.prompt_top_ids[t],
                result.prompt_top_logprobs[t], state.params.prompt_logprobs, piece,
            )
