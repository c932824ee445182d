"""`POST /v1/chat/completions`: chat, a view over the generation pipeline (pipeline.py), with
the model's chat template.

A stream goes as OpenAI sends it: for each choice a first chunk with the role, then content
chunks, then exactly one chunk with an empty delta and the finish_reason; with
`stream_options.include_usage` a last chunk with `choices: []` and the usage (per-chunk fields:
`reply_json.StreamExtras`); then `[DONE]`.

With tools (`jengine.text.tools`), `<tool_call>` blocks in the output become
`message.tool_calls` and
the rest stays `content` (null when nothing else is left); a choice that made calls finishes with
"tool_calls". Streamed, a call goes out as `delta.tool_calls` chunks: the id, type and function
name (arguments ""), then argument fragments: as they are generated when `tool_choice` forces the
calls (the grammar, in the `--tool-call-parser`'s format, makes them well-formed; pythonic and
qwen3_coder calls whole at the end), at once when the block closes under `auto`.

With `--reasoning-parser` (`jengine.text.reasoning`), the thinking goes to `message.reasoning`
and, the same text, `message.reasoning_content` (vLLM's new and old names; both null when the
answer has none), streamed as `delta.reasoning` / `delta.reasoning_content`; `content`, the tool
calls and the output constraint are the answer's, after the thinking. `thinking_token_budget`
(or `reasoning_effort`, `EFFORT_BUDGETS`) caps the thought: the constraint grammar then forces
the end marker after that many tokens (after_reasoning.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from jengine.outputs import CompletionOutput, Logprob, RequestOutput
from jengine.sampling_params import SamplingParams
from jengine.server.chat_request import ChatCompletionRequest
from jengine.server.errors import bad_request
from jengine.server.pipeline import OPENAI_FRAMING, EngineStream, Job, accept, reply, start
from jengine.server.reply_json import StreamExtras, finite, prompt_logprobs_json, token_text, usage
from jengine.structured.after_reasoning import params_after_reasoning
from jengine.text.reasoning import (
    ReasoningFormat,
    ReasoningStream,
    keep_markers,
    split_reasoning,
    thinking_off,
)
from jengine.text.tool_parsers import CallStream, parse_calls, tool_stream
from jengine.text.tools import CallStart, ToolSetup


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = accept(request, body)
    messages = body.template_messages()
    template = state.chat_template_for(body.chat_template)
    tool_parser = state.tool_parser(template)
    tools = dataclasses.replace(body.tool_setup(), fmt=tool_parser)  # forced calls: its format
    params = body.sampling_params(tools, default_max_tokens=state.config.default_max_tokens)
    request_id = state.response_id(request, body.request_id)

    reasoning, adapt = reasoning_adapt(state, body, template)
    stream = await start(state, request, Job(
        params, lambda tokenizer: [body.render(tokenizer, messages, tools, template, state.media)],
        1, request_id, body.max_tokens_field, body.constraint_param(),
        lambda engine: (body.check_cache_salt(engine.core.cfg.cache.enable_prefix_caching),
                        body.check_images(engine.core.model.takes_images)),
        adapt))
    view = _ChatView(body, f"chatcmpl-{request_id}", state.reported_model(body.model),
                      tools)
    view.tool_parser = tool_parser
    if state.config.reasoning_parser is not None:
        view.reasoning = Reasoning(reasoning(stream.engine))
    return await reply(stream, view, bool(body.stream))


def reasoning_adapt(state: Any, body: ChatCompletionRequest, template: str | None) -> tuple[
        Callable[[Any], ReasoningFormat | None], Callable[[Any, SamplingParams], SamplingParams]]:
    """The request's reasoning format (per engine) and its params once the engine is known:
    the output constraint after the thinking, the thought capped at the request's budget
    (`thinking_token_budget` / `reasoning_effort`; a budget that cannot apply is a 400)."""
    budget, budget_field = body.thinking_budget(state.config.reasoning_parser)

    def reasoning(engine: Any) -> ReasoningFormat | None:
        return state.reasoning_format(engine.tokenizer, template, body.chat_template_kwargs)

    def adapt(engine: Any, p: SamplingParams) -> SamplingParams:
        fmt = reasoning(engine)
        p = keep_markers(p, fmt)  # harmony's markers are special tokens
        if budget is None:
            return params_after_reasoning(p, fmt, engine.tokenizer)
        if fmt is None and not thinking_off(body.chat_template_kwargs):
            raise bad_request(f"{budget_field}: --reasoning-parser auto found no reasoning "
                              "format in this chat template, so there is no thinking to cap",
                              budget_field)
        try:  # thinking turned off: nothing to cap, the params stay as they are
            return params_after_reasoning(p, fmt, engine.tokenizer, budget)
        except ValueError as e:
            if str(e).startswith("thinking_token_budget"):
                raise bad_request(str(e).replace("thinking_token_budget", budget_field, 1),
                                  budget_field) from None
            raise

    return reasoning, adapt


class Reasoning:
    """A chat answer's reasoning fields (the server has a parser; `fmt` None: this request's
    answer is not parsed, thinking off or no format found, and the fields are null)."""

    def __init__(self, fmt: ReasoningFormat | None):
        self.fmt = fmt

    def split(self, text: str) -> tuple[str | None, str]:
        return (None, text) if self.fmt is None else split_reasoning(self.fmt, text)

    def stream(self) -> ReasoningStream | None:
        return None if self.fmt is None else ReasoningStream(self.fmt)


def _reasoning_fields(text: str | None) -> dict[str, str | None]:
    return {"reasoning": text, "reasoning_content": text}


class _ChatView:
    """Turns engine deltas into OpenAI chat completion objects (whole, or as stream chunks)."""

    framing = OPENAI_FRAMING

    def __init__(self, body: ChatCompletionRequest, response_id: str, model: str,
                 tools: ToolSetup):
        self.body = body
        self.reasoning: Reasoning | None = None  # set when the server has a reasoning parser
        self.tool_parser: str | None = None  # `--tool-call-parser` (None: hermes)
        self.echo = body.echo_text()
        self.as_ids = bool(body.return_tokens_as_token_ids)
        self.prompt_logprobs: list | None = None
        self.parse_tools = tools.active
        self.forced_calls = tools.constraint() is not None  # well-formed: stream arguments
        self.n = body.n or 1
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.top_logprobs = body.top_logprobs or 0
        self.want_logprobs = bool(body.logprobs)
        self.usage: dict[str, int] | None = None
        self.extras = StreamExtras(body.stream_options if body.stream else None, {
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model})

    def _logprobs(self, out: CompletionOutput) -> list[dict[str, Any]] | None:
        if not self.want_logprobs:
            return None
        return [_token_logprob(tid, entry, self.top_logprobs, self.as_ids)
                for tid, entry in zip(out.token_ids, out.logprobs or [])]

    def _note(self, delta: RequestOutput) -> None:
        if delta.usage is not None:
            self.usage = usage(delta.usage.prompt_tokens, delta.usage.completion_tokens,
                               delta.usage.cached_tokens)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs_json(delta.prompt_logprobs)

    async def response(self, stream: EngineStream) -> dict[str, Any]:
        choices = {i: {"index": i, "message": {"role": "assistant", "content": self.echo},
                       "logprobs": {"content": []} if self.want_logprobs else None,
                       "finish_reason": None} for i in range(self.n)}
        async for _, delta in stream:
            self._note(delta)
            for out in delta.outputs:
                choice = choices[out.index]
                choice["message"]["content"] += out.text
                if self.want_logprobs:
                    choice["logprobs"]["content"].extend(self._logprobs(out))
                choice["finish_reason"] = out.finish_reason
        if self.reasoning is not None:
            for choice in choices.values():
                message = choice["message"]
                thought, answer = self.reasoning.split(message["content"][len(self.echo):])
                message["content"] = self.echo + answer
                message.update(_reasoning_fields(thought))
        if self.parse_tools:
            for choice in choices.values():
                _split_calls(choice, self.forced_calls, self.tool_parser)
        if self.reasoning is not None:  # a choice that only thought has no content (vLLM's)
            for choice in choices.values():
                message = choice["message"]
                if message["reasoning"] and not message["content"]:
                    message["content"] = None
        response = {"id": self.id, "object": "chat.completion", "created": self.created,
                    "model": self.model, "choices": [choices[i] for i in range(self.n)],
                    "usage": self.usage}
        if self.body.prompt_logprobs is not None:
            response["prompt_logprobs"] = self.prompt_logprobs
        return response

    async def events(self, stream: EngineStream) -> AsyncIterator[str]:
        for i in range(self.n):
            self.extras.count(i, len(stream.prompt_token_ids[0] or ()))
            yield self.extras.chunk([{"index": i,
                                     "delta": {"role": "assistant", "content": self.echo},
                                     "logprobs": None, "finish_reason": None}])
        parsers = {i: tool_stream(self.tool_parser, self.forced_calls) for i in range(self.n)}
        thinking = {i: self.reasoning.stream() if self.reasoning else None for i in range(self.n)}
        async for _, delta in stream:
            self._note(delta)
            if delta.prompt_logprobs is not None and self.body.prompt_logprobs is not None:
                yield self.extras.chunk([], prompt_logprobs=self.prompt_logprobs)
            for out in delta.outputs:
                self.extras.count(out.index, len(delta.prompt_token_ids), len(out.token_ids))
                logprobs = self._logprobs(out)
                parser = parsers[out.index]
                deltas, text = _reasoning_deltas(thinking[out.index], out)
                if self.parse_tools:
                    deltas += _tool_deltas(parser, text, out.finish_reason is not None)
                elif text:
                    deltas.append({"content": text})
                if logprobs and not deltas:
                    deltas = [{"content": ""}]
                for j, d in enumerate(deltas):
                    lp = {"content": logprobs} if logprobs and j == 0 else None
                    yield self.extras.chunk([{"index": out.index, "delta": d, "logprobs": lp,
                                              "finish_reason": None}])
                if out.finish_reason is not None:
                    reason = out.finish_reason
                    if reason == "stop" and parser.num_calls:
                        reason = "tool_calls"
                    yield self.extras.chunk([{"index": out.index, "delta": {},
                                              "logprobs": None, "finish_reason": reason}])
        if self.body.include_usage:
            yield self.extras.chunk([], self.usage)


def _reasoning_deltas(thinking: ReasoningStream | None,
                      out: CompletionOutput) -> tuple[list[dict[str, Any]], str]:
    """The reasoning deltas of one output delta, and the answer's text in it."""
    if thinking is None:
        return [], out.text
    pieces = thinking.feed(out.text)
    if out.finish_reason is not None:
        pieces += thinking.finish()
    deltas = [_reasoning_fields(text) for kind, text in pieces if kind == "reasoning"]
    return deltas, "".join(text for kind, text in pieces if kind == "content")


def _tool_deltas(parser: CallStream, text: str,
                 last: bool) -> list[dict[str, Any]]:
    """The stream deltas of one output delta's text with tools: content pieces, and tool calls
    as a first delta with the id, type and name (arguments "") and then argument fragments."""
    pieces = parser.feed(text)
    if last:
        pieces += parser.finish()
    deltas: list[dict[str, Any]] = []
    for piece in pieces:
        if isinstance(piece, str):
            deltas.append({"content": piece})
        elif isinstance(piece, CallStart):
            deltas.append({"tool_calls": [{"index": piece.index, "id": piece.id,
                                           "type": "function",
                                           "function": {"name": piece.name, "arguments": ""}}]})
        else:
            deltas.append({"tool_calls": [{"index": piece.index,
                                           "function": {"arguments": piece.text}}]})
    return deltas


def _split_calls(choice: dict[str, Any], forced: bool, parser: str | None) -> None:
    """Moves the tool calls out of a whole choice's content (under a forcing tool_choice a
    call cut off by max_tokens is dropped, not left in the content)."""
    content, calls = parse_calls(parser, choice["message"]["content"] or "", forced=forced)
    if forced:
        choice["message"]["content"] = content
    if not calls:
        return
    choice["message"]["content"] = content
    choice["message"]["tool_calls"] = [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls]
    if choice["finish_reason"] == "stop":
        choice["finish_reason"] = "tool_calls"


def _token_logprob(token_id: int, entry: dict[int, Logprob], k: int,
                   as_ids: bool) -> dict[str, Any]:
    """One generated token in OpenAI's chat logprobs format, with its top-k alternatives
    (`as_ids`: tokens written `token_id:N`, vLLM's `return_tokens_as_token_ids`)."""
    top = sorted(((tid, e) for tid, e in entry.items() if e.rank is not None and e.rank <= k),
                 key=lambda item: item[1].rank)
    return {**_token_entry(token_id, entry[token_id], as_ids),
            "top_logprobs": [_token_entry(tid, e, as_ids) for tid, e in top]}


def _token_entry(token_id: int, lp: Logprob, as_ids: bool) -> dict[str, Any]:
    token = token_text(token_id, lp, as_ids)
    return {"token": token, "logprob": finite(lp.logprob),
            "bytes": list(token.encode("utf-8", "replace"))}
