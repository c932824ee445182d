"""The JSON pieces the completion endpoints' replies share: OpenAI's usage object and
logprob values, and vLLM's prompt logprobs."""

from __future__ import annotations

from typing import Any

from jengine.outputs import Logprob


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
