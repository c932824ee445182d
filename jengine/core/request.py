"""`RequestState`: what the engine keeps per request between steps, and how it turns the
scheduler's token events into `RequestOutput` deltas."""

from __future__ import annotations

import dataclasses
import time

from jengine.core.pooling import PooledState
from jengine.outputs import CompletionOutput, Logprob, RequestOutput, Usage
from jengine.sampling_params import SamplingParams
from jengine.scheduling.sequence import Sequence
from jengine.text.detokenizer import IncrementalDetokenizer


@dataclasses.dataclass
class SampleState:
    """Per sample: its sequence, detokenizer and the delta not yet handed out."""

    seq: Sequence
    detok: IncrementalDetokenizer
    text: str = ""  # whole text so far
    new_text: str = ""
    new_ids: list[int] = dataclasses.field(default_factory=list)
    new_logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)
    reported_finish: bool = False

    # Whether and why the sample ended is its sequence's: the scheduler decides it (length,
    # stop ids, EOS, grammar, stop strings, aborts all end there), in the step that emits
    # the last token, so no second copy is kept here.
    @property
    def finish_reason(self) -> str | None:
        return self.seq.finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.seq.stop_reason


@dataclasses.dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    # [prompt_len] None first, then {token: Logprob} per prompt token, when asked for.
    prompt_logprobs: list | None = None
    sent_prompt_logprobs: bool = False
    error: str | None = None  # set when handling this request raised; it was aborted
    pooled: PooledState | None = None  # an embedding request's running pool
    embedding: list[float] | None = None  # its vector, once its prompt has run

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the first sample reused from the prefix cache (its siblings share its
        prompt pages)."""
        return self.samples[0].seq.num_cached_tokens

    @property
    def num_generated(self) -> int:
        return sum(len(s.seq.output_ids) for s in self.samples)

    def take_delta(self) -> RequestOutput | None:
        """The outputs that changed since the last call (None if nothing did)."""
        changed = [
            s for s in self.samples
            if s.new_ids or s.new_text or (s.finish_reason and not s.reported_finish)
        ]
        if not changed:
            return None
        outputs = []
        for s in changed:
            outputs.append(
                CompletionOutput(
                    index=s.seq.index,
                    text=s.new_text,
                    token_ids=s.new_ids,
                    logprobs=s.new_logprobs if self.params.logprobs is not None else None,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
            s.new_text, s.new_ids, s.new_logprobs = "", [], []
            s.reported_finish = s.finish_reason is not None
        finished = self.finished
        prompt_logprobs = None
        if self.prompt_logprobs is not None and not self.sent_prompt_logprobs:
            prompt_logprobs, self.sent_prompt_logprobs = self.prompt_logprobs, True
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=finished,
            usage=(Usage.of(len(self.prompt_ids), 0 if self.pooled else self.num_generated,
                            self.num_cached_tokens) if finished else None),
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
            embedding=self.embedding if finished else None,
        )


def merge_deltas(deltas: list[RequestOutput]) -> RequestOutput:
    """Joins a request's stream of deltas into one complete `RequestOutput`."""
    by_index: dict[int, CompletionOutput] = {}
    for d in deltas:
        for o in d.outputs:
            acc = by_index.get(o.index)
            if acc is None:
                by_index[o.index] = CompletionOutput(
                    index=o.index, text=o.text, token_ids=list(o.token_ids),
                    logprobs=list(o.logprobs) if o.logprobs is not None else None,
                    finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                )
                continue
            acc.text += o.text
            acc.token_ids.extend(o.token_ids)
            if o.logprobs is not None and acc.logprobs is not None:
                acc.logprobs.extend(o.logprobs)
            acc.finish_reason, acc.stop_reason = o.finish_reason, o.stop_reason
    last = deltas[-1]
    prompt_logprobs = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs), None)
    return RequestOutput(
        request_id=last.request_id, prompt=last.prompt, prompt_token_ids=last.prompt_token_ids,
        prompt_logprobs=prompt_logprobs,
        outputs=[by_index[i] for i in sorted(by_index)], finished=last.finished, usage=last.usage,
        num_cached_tokens=last.num_cached_tokens, error=last.error, embedding=last.embedding,
    )
