"""The JSON pieces the completion endpoints' replies share: OpenAI's usage object and
logprob values, vLLM's prompt logprobs, and `StreamExtras`, what `stream_options` adds to each
chunk of a chat or completions stream:

- `include_usage` (OpenAI's): every chunk has `"usage": null`, and a last chunk with
  `choices: []` carries the request's usage.
- `continuous_usage_stats` (vLLM's, with `include_usage`): every chunk carries the usage so far
  instead of null, as vLLM sends it: a chunk of one choice has that choice's prompt tokens and
  the tokens it generated up to and including this chunk, so that a benchmark client (guidellm)
  can time each token without counting them itself.
- `include_obfuscation` (OpenAI's): an `obfuscation` field of random characters pads each chunk
  to a multiple of `OBFUSCATION_BLOCK` bytes, so that the size of an encrypted chunk does not
  give away the length of its text. Off unless asked for (OpenAI's default is on): jengine serves
  plain HTTP unless given a certificate, where the padding hides nothing, and vLLM, whose
  clients this server mostly has, sends no such field.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from jengine.outputs import Logprob
from jengine.server.pipeline import sse


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens` are prompt tokens served by the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def finite(logprob: float) -> float:
    """JSON has no -Infinity: an impossible token gets OpenAI's floor of -9999."""
    return max(logprob, -9999.0)


def token_text(token_id: int, lp: Logprob, as_ids: bool) -> str:
    """A token as logprobs show it: its text, or `token_id:N` (vLLM's
    `return_tokens_as_token_ids`, for tokens that are not whole characters)."""
    return f"token_id:{token_id}" if as_ids else (lp.decoded_token or "")


def prompt_logprobs_json(entries: list) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} holding the prompt's token and the top candidates."""
    out: list[dict | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        out.append({str(tid): {"logprob": finite(e.logprob), "rank": e.rank,
                               "decoded_token": e.decoded_token} for tid, e in entry.items()})
    return out


OBFUSCATION_BLOCK = 128  # bytes: more than the text of a few tokens


class StreamExtras:
    """The chunks of one stream: `head` (id, object, created, model) and the choices, with the
    fields the stream options add, and the token counts continuous usage needs."""

    def __init__(self, stream_options: Any | None, head: dict[str, Any]):
        options = stream_options
        self.head = head
        self.include_usage = bool(options and options.include_usage)
        self.continuous = self.include_usage and bool(options.continuous_usage_stats)
        self.obfuscate = bool(options and options.include_obfuscation)
        self._prompt_tokens: dict[int, int] = {}  # choice -> its prompt's tokens
        self._generated: dict[int, int] = {}  # choice -> tokens generated so far

    def count(self, choice: int, prompt_tokens: int, new_tokens: int = 0) -> None:
        """Notes a choice's prompt length and the tokens of its latest delta."""
        self._prompt_tokens[choice] = prompt_tokens
        self._generated[choice] = self._generated.get(choice, 0) + new_tokens

    def _usage_so_far(self, choice: int | None) -> dict[str, int]:
        if choice is None:  # a chunk of no one choice: the request's running total
            prompt = sum(self._prompt_tokens.values())
            generated = sum(self._generated.values())
        else:
            prompt = self._prompt_tokens.get(choice, 0)
            generated = self._generated.get(choice, 0)
        return {"prompt_tokens": prompt, "completion_tokens": generated,
                "total_tokens": prompt + generated}

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None,
              **extra: Any) -> str:
        """A chunk of `choices` as an SSE event (`usage`: the request's final usage, on the last
        chunk, which wins over a running one; `extra`: more top-level fields)."""
        payload = {**self.head, "choices": choices, **extra}
        choice = choices[0]["index"] if len(choices) == 1 else None  # the one it is about
        if self.include_usage:
            if usage is None and self.continuous:
                usage = self._usage_so_far(choice)
            payload["usage"] = usage
        if self.obfuscate:
            payload["obfuscation"] = ""
            size = len(json.dumps(payload, ensure_ascii=False).encode())
            pad = -size % OBFUSCATION_BLOCK
            payload["obfuscation"] = secrets.token_urlsafe(pad)[:pad]
        return sse(payload)
