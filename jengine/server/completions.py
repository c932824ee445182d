"""`POST /v1/completions`: OpenAI's legacy completions, a view over the generation pipeline.

Each prompt of the request is one engine request; choice `i * n + k` is completion k of prompt i,
as in OpenAI and vLLM. With `echo`, the prompt text leads the choice's text, and with `logprobs`
too, the prompt's tokens lead `tokens` with their logprobs (the engine's prompt logprobs; the
first token has `null`, as nothing precedes it).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from jengine.outputs import CompletionOutput, Logprob, RequestOutput
from jengine.server.errors import bad_request
from jengine.server.pipeline import OPENAI_FRAMING, EngineStream, Job, accept, reply, start
from jengine.server.protocol import CompletionRequest
from jengine.server.reply_json import StreamExtras, finite, prompt_logprobs_json, token_text, usage


async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = accept(request, body)
    prompts = body.prompts()
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens may be 0 only with echo (to score the prompt)",
                          "max_tokens")
    params = body.sampling_params()
    request_id = state.response_id(request, body.request_id)

    def prompt_ids(tokenizer: Any) -> list[list[int]]:  # text tokenized off the engine thread
        return [p if isinstance(p, list) else
                list(tokenizer(p, add_special_tokens=body.add_special_tokens).input_ids)
                for p in prompts]

    stream = await start(state, request, Job(
        params, prompt_ids, len(prompts), request_id, constraint_param=body.constraint_param(),
        check=lambda engine: body.check_cache_salt(engine.core.cfg.cache.enable_prefix_caching)))
    view = _CompletionView(body, stream.engine.tokenizer, prompts, f"cmpl-{request_id}",
                           state.reported_model(body.model))
    return await reply(stream, view, bool(body.stream))


class _CompletionView:
    """Turns engine deltas into OpenAI completion objects (whole, or as stream chunks)."""

    framing = OPENAI_FRAMING

    def __init__(self, body: CompletionRequest, tokenizer: Any, prompts: list[str | list[int]],
                 response_id: str, model: str):
        self.body = body
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.n = body.n or 1
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.want_logprobs = body.logprobs is not None
        self.scores_only = body.scores_only  # the one generated token is left out
        self.as_ids = bool(body.return_tokens_as_token_ids)
        self._offsets: dict[int, int] = {}  # choice -> text offset of its next token
        # prompt index -> (prompt tokens, completion tokens), from the final delta
        self._usage_by_prompt: dict[int, tuple[int, int, int]] = {}
        self._prompt_logprobs: dict[int, list] = {}  # prompt index -> engine prompt logprobs
        self.extras = StreamExtras(body.stream_options if body.stream else None, {
            "id": self.id, "object": "text_completion", "created": self.created,
            "model": self.model})

    # -- one choice's piece of a delta -----------------------------------------------------------

    def _piece(self, prompt_index: int, prompt_ids: list[int],
               out: CompletionOutput) -> tuple[int, str, dict[str, Any] | None]:
        """(choice index, text, logprobs) of one output delta; echo goes in front of the first."""
        choice = index_of(prompt_index, self.n, out.index)
        if self.scores_only:
            out = CompletionOutput(out.index, "", [], [], out.finish_reason and "length")
        text = out.text
        lp: dict[str, Any] | None = None
        if self.want_logprobs:
            lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if choice not in self._offsets:
            self._offsets[choice] = 0
            if self.body.echo:
                prompt_text = self._prompt_text(prompt_index)
                text = prompt_text + text
                if lp is not None:
                    self._add_prompt_tokens(lp, prompt_ids, self._prompt_logprobs.get(
                        prompt_index))
                self._offsets[choice] = len(prompt_text)
        if lp is not None:
            self._offsets[choice] = _add_tokens(lp, out.token_ids, out.logprobs or [],
                                                self._offsets[choice], self.as_ids)
        return choice, text, lp

    def _prompt_text(self, prompt_index: int) -> str:
        prompt = self.prompts[prompt_index]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def _add_prompt_tokens(self, lp: dict[str, Any], prompt_ids: list[int],
                           entries: list | None) -> None:
        offset = 0
        for pos, tid in enumerate(prompt_ids):
            entry = entries[pos] if entries else None
            if entry is not None:
                offset = _add_tokens(lp, [tid], [entry], offset, self.as_ids)
                continue
            token = f"token_id:{tid}" if self.as_ids else self.tokenizer.decode([tid])
            lp["tokens"].append(token)
            lp["token_logprobs"].append(None)
            lp["top_logprobs"].append(None)
            lp["text_offset"].append(offset)
            offset += len(token)

    def _note_usage(self, prompt_index: int, delta: RequestOutput) -> None:
        """Keeps what a delta says once for its whole prompt: prompt logprobs, usage."""
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs[prompt_index] = delta.prompt_logprobs
        if delta.usage is not None:
            u = delta.usage
            generated = 0 if self.scores_only else u.completion_tokens
            self._usage_by_prompt[prompt_index] = (u.prompt_tokens, generated, u.cached_tokens)

    def _prompt_logprobs_field(self, prompt_index: int) -> dict[str, Any]:
        """vLLM's per-choice `prompt_logprobs`, when the request asked for them."""
        if self.body.prompt_logprobs is None:
            return {}
        entries = self._prompt_logprobs.get(prompt_index)
        return {"prompt_logprobs": prompt_logprobs_json(entries) if entries else None}

    def _total_usage(self) -> dict[str, Any]:
        rows = list(self._usage_by_prompt.values()) or [(0, 0, 0)]
        return usage(*map(sum, zip(*rows)))  # prompt, completion and cached tokens

    # -- whole response --------------------------------------------------------------------------

    async def response(self, stream: EngineStream) -> dict[str, Any]:
        choices: dict[int, dict[str, Any]] = {}
        async for i, delta in stream:
            self._note_usage(i, delta)
            for out in delta.outputs:
                index, text, lp = self._piece(i, delta.prompt_token_ids, out)
                choice = choices.setdefault(index, {"index": index, "text": "", "logprobs": lp,
                                                    "finish_reason": None,
                                                    **self._prompt_logprobs_field(i)})
                choice["text"] += text
                if lp is not None and choice["logprobs"] is not lp:
                    for key, values in lp.items():
                        choice["logprobs"][key].extend(values)
                choice["finish_reason"] = out.finish_reason
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": [choices[i] for i in sorted(choices)],
                "usage": self._total_usage()}

    # -- stream ----------------------------------------------------------------------------------

    async def events(self, stream: EngineStream) -> AsyncIterator[str]:
        async for i, delta in stream:
            self._note_usage(i, delta)
            for out in delta.outputs:
                first = index_of(i, self.n, out.index) not in self._offsets
                self.extras.count(index_of(i, self.n, out.index), len(delta.prompt_token_ids),
                                  0 if self.scores_only else len(out.token_ids))
                index, text, lp = self._piece(i, delta.prompt_token_ids, out)
                if text or out.finish_reason or (lp is not None and lp["tokens"]):
                    extra = self._prompt_logprobs_field(i) if first else {}
                    yield self.extras.chunk([{"index": index, "text": text, "logprobs": lp,
                                              "finish_reason": out.finish_reason, **extra}])
        if self.body.include_usage:
            yield self.extras.chunk([], self._total_usage())


def index_of(prompt_index: int, n: int, sample: int) -> int:
    """The choice index of sample k of prompt i: i * n + k, as in OpenAI."""
    return prompt_index * n + sample


def _add_tokens(lp: dict[str, Any], token_ids: list[int], entries: list[dict[int, Logprob]],
                offset: int, as_ids: bool = False) -> int:
    """Appends generated tokens in OpenAI's completions logprobs format; returns the offset."""
    for tid, entry in zip(token_ids, entries):
        sampled = entry[tid]
        token = token_text(tid, sampled, as_ids)
        top: dict[str, float] = {}
        for cand, e in sorted(entry.items(), key=lambda item: -item[1].logprob):
            top.setdefault(token_text(cand, e, as_ids), finite(e.logprob))
        lp["tokens"].append(token)
        lp["token_logprobs"].append(finite(sampled.logprob))
        lp["top_logprobs"].append(top)
        lp["text_offset"].append(offset)
        offset += len(token)
    return offset
