"""A step's new tokens into a request's output: logprobs, detokenized text, stop strings."""

from __future__ import annotations

import time
from collections.abc import Callable

from jengine.core.logprobs import ranked
from jengine.core.request import RequestState, SampleState
from jengine.runtime.step_io import StepResult
from jengine.scheduling.sequence import Sequence


def emit_tokens(state: RequestState, sample: SampleState, result: StepResult, row: int,
                count: int, finish: Callable[[Sequence, str, str], None],
                piece: Callable[[int], str]) -> None:
    """Hands the sequence's `count` new tokens (rows `row`, `row + 1`, ...) to its output,
    one at a time: a stop string ends it at the token that completes it, and any accepted
    tokens after that one are dropped, as plain decoding would never have made them."""
    seq = sample.seq
    if state.first_token_time is None:
        state.first_token_time = time.perf_counter()
    first = len(seq.output_ids) - count
    for j in range(count):
        token = seq.output_ids[first + j]
        r = row + j
        sample.new_ids.append(token)
        if state.params.logprobs is not None:
            top = result.top_ids is not None
            sample.new_logprobs.append(ranked(
                token, result.logprobs[r], result.top_ids[r] if top else None,
                result.top_logprobs[r] if top else None, state.params.logprobs,
                piece,
            ))
        delta = sample.detok.add_tokens([token])
        text = delta.text
        last = j == count - 1
        if delta.stop_string is not None:
            del seq.output_ids[first + j + 1:]
            finish(seq, "stop", delta.stop_string)
            last = True
        elif last and seq.is_finished:
            text += sample.detok.flush().text
        sample.new_text += text
        sample.text += text
        if last:
            break
