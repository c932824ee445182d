"""What the engine hands back for a request: `RequestOutput`, holding one `CompletionOutput` each.

The shapes follow vLLM's, so that callers written against vLLM read them unchanged. A stream yields
deltas: each `RequestOutput` carries only the text and token ids generated since the previous one,
and the last has `finished=True` and a `finish_reason` on every completion. `Engine.generate`
returns one whole `RequestOutput` per prompt instead.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Literal

FinishReason = Literal["stop", "length", "tool_calls", "abort"]


@dataclasses.dataclass
class Logprob:
    """The log-probability of one candidate token at one position.

    Attributes:
      logprob: natural log of the token's probability under the model's raw distribution
        (the logits before temperature, penalties or filtering, as vLLM reports by default).
      rank: 1 for the most likely token, 2 for the next, ...; None when not computed.
      decoded_token: the token's text, when the caller asked for it to be decoded.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: token id -> Logprob, holding the sampled token and the top-k candidates.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token; the first entry is None because nothing precedes the first token.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One function call the model made (OpenAI's `tool_calls[i]`).

    Attributes:
      id: a unique id the tool result message refers back to (`tool_call_id`).
      name: the function's name.
      arguments: the arguments as a JSON object text.
    """

    id: str
    name: str
    arguments: str


def new_call_id() -> str:
    """A fresh `ToolCall.id` in OpenAI's form (`call_` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request (a request with `n > 1` has n of them).

    Attributes:
      index: which of the request's n completions this is.
      text: the generated text (in a stream: the text new since the previous output).
      token_ids: the generated token ids (in a stream: the new ones).
      logprobs: per token in `token_ids`, when the request asked for logprobs; else None.
      finish_reason: why generation ended; None while it goes on.
      stop_reason: the stop string or stop token id that ended it; None for EOS or length.
      tool_calls: the function calls parsed from the text (`Engine.chat` with tools), which then
        holds only the rest of the text; None otherwise.
      reasoning: the model's thinking, split from the text (`Engine.chat` with a
        `reasoning_parser`), which then holds only the answer; None otherwise or when the
        answer has none.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None

    def finished(self) -> bool:
        """Whether this completion has ended (a method, as in vLLM)."""
        return self.finish_reason is not None


@dataclasses.dataclass
class Usage:
    """Token counts of a request, as reported in OpenAI's `usage` object.

    Attributes:
      prompt_tokens: tokens in the prompt.
      completion_tokens: tokens generated, summed over the request's completions.
      total_tokens: prompt_tokens + completion_tokens.
      cached_tokens: prompt tokens whose K/V came from the prefix cache (OpenAI's
        `prompt_tokens_details.cached_tokens`).
    """

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        """Usage with `total_tokens` filled in."""
        return cls(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens,
                   cached_tokens)


@dataclasses.dataclass
class RequestOutput:
    """The engine's answer for one request (in a stream: one delta of it).

    Attributes:
      request_id: the id the request was submitted under.
      prompt: the prompt text; None when the prompt was given as token ids.
      prompt_token_ids: the prompt as token ids.
      prompt_logprobs: per prompt token, when the request asked for them; else None.
      outputs: one per completion, ordered by `CompletionOutput.index`.
      finished: whether every completion has ended.
      usage: token counts; set on the final output.
      num_cached_tokens: prompt tokens reused from the prefix cache (as in vLLM).
      error: set when the engine failed this request alone (it ended with "abort"); every
        other request went on.
      embedding: an embedding request's vector (task embed or score), on its final output;
        None for generation.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    usage: Usage | None = None
    num_cached_tokens: int | None = None
    error: str | None = None
    embedding: list[float] | None = None
