"""`POST /v1/responses`: OpenAI's Responses API, stateless, on top of the chat path.

A request is translated into the chat request it means (`ResponsesRequest.chat_request`):
`instructions` become a first system message, `input` items become chat messages (`function_call`
items an assistant turn's `tool_calls`, `function_call_output` items `role: tool` results),
`text.format` becomes `response_format`, the flat function tools become chat tools. From there
the chat endpoint's validation, template, tool grammar and sampling apply, so the same messages
give the same greedy text on both routes.

Nothing is stored: `store: true` is accepted and answered as `store: false`; a request that needs
stored state (`previous_response_id`, `conversation`, `prompt`) is a 400 naming the field.

The answer is a `response` object. Its `output` holds one `message` item (the text as one
`output_text` part), unless only tool calls were generated, and a `function_call` item per call,
in the order generated. A length finish is `status: "incomplete"` with
`incomplete_details.reason: "max_output_tokens"`. Streamed, the events are OpenAI's, each sent as
`event: <type>` + `data: {"type": <type>, "sequence_number": k, ...}`:

    response.created, response.in_progress                       (status in_progress, no output)
    response.output_item.added (message), response.content_part.added,
        response.output_text.delta ...                           (text as it is generated)
    response.output_item.added (function_call), response.function_call_arguments.delta ...,
        response.function_call_arguments.done, response.output_item.done   (each call)
    response.output_text.done, response.content_part.done, response.output_item.done
    response.completed | response.incomplete                     (the whole response)

With `--reasoning-parser`, the model's thinking is a `reasoning` item before the others (its
text as one `reasoning_text` content part, `summary` empty: nothing summarises it), streamed as
`response.output_item.added` (reasoning), `response.reasoning_text.delta` ...,
`response.reasoning_text.done`, `response.output_item.done`; the message and the calls are the
answer after it.

An error after the stream began is an `error` event, then `response.failed`. There is no
`[DONE]` line (OpenAI sends none for this route). The whole response is built by the same code
that makes the events, so a streamed and a whole response carry the same output.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from jengine.outputs import RequestOutput
from jengine.server.errors import APIError, renamed_params
from jengine.server.pipeline import (
    EngineStream,
    Framing,
    Job,
    accept,
    reply,
    sse,
    start,
)
from jengine.server.responses_request import ResponsesRequest, renamed_param
from jengine.structured.after_reasoning import params_after_reasoning
from jengine.text.reasoning import ReasoningFormat, ReasoningStream, keep_markers
from jengine.text.tool_parsers import tool_stream
from jengine.text.tools import CallArguments, CallStart, ToolSetup

# -- the route ------------------------------------------------------------------------------------

async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state = accept(request, body)
    chat = body.chat_request()
    request_id = request.state.request_id
    with renamed_params(renamed_param):
        messages = chat.template_messages()
        tools = dataclasses.replace(chat.tool_setup(),
                                    fmt=state.tool_parser(state.chat_template))
        params = chat.sampling_params(tools, default_max_tokens=state.config.default_max_tokens)

        def reasoning(engine: Any) -> ReasoningFormat | None:
            return state.reasoning_format(engine.tokenizer, state.chat_template, None)

        stream = await start(state, request, Job(
            params, lambda tokenizer: [chat.render(tokenizer, messages, tools,
                                                   state.chat_template, state.media)],
            1, request_id, chat.max_tokens_field, chat.constraint_param(),
            lambda engine: body.check_images(engine.core.model.takes_images),
            adapt=lambda engine, p: params_after_reasoning(
                keep_markers(p, reasoning(engine)), reasoning(engine), engine.tokenizer)))
    view = _ResponseView(body, f"resp_{request_id}", state.reported_model(body.model), tools,
                         reasoning(stream.engine), state.tool_parser(state.chat_template))
    return await reply(stream, view, bool(body.stream))


class _ResponseView:
    """Builds the response's output items from engine deltas, as stream events on the way."""

    def __init__(self, body: ResponsesRequest, response_id: str, model: str, tools: ToolSetup,
                 reasoning: ReasoningFormat | None = None, tool_parser: str | None = None):
        self.body = body
        self.id = response_id
        self.model = model
        self.created_at = int(time.time())
        forced = tools.constraint() is not None  # well-formed calls: stream their arguments
        self.parser = tool_stream(tool_parser, forced) if tools.active else None
        self.thinking = ReasoningStream(reasoning) if reasoning is not None else None
        self._reasoning: int | None = None  # output index of the reasoning item while open
        self.output: list[dict[str, Any]] = []  # the output items, as they stand
        self.usage: dict[str, Any] | None = None
        self.status = "in_progress"
        self._message: int | None = None  # output index of the message item
        self._call: int | None = None  # output index of the call still being generated
        self._calls: dict[int, int] = {}  # call index -> output index
        self._seq = 0
        self.framing = Framing(self._failed, None)  # OpenAI sends no [DONE] on this route

    # -- the response object -----------------------------------------------------------------------

    def snapshot(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        done = status in ("completed", "incomplete")
        text = {"format": (b.text.format if b.text else None) or {"type": "text"}}
        if b.text is not None and b.text.verbosity is not None:
            text["verbosity"] = b.text.verbosity
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "completed_at": int(time.time()) if done else None,
            "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if status == "incomplete" else None),
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "model": self.model, "output": self.output if done or error else [],
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "text": text, "tool_choice": "auto" if b.tool_choice is None else b.tool_choice,
            "tools": b.tools or [], "truncation": "disabled", "background": False,
            "metadata": b.metadata or {}, "user": b.user, "usage": self.usage if done else None,
        }

    async def response(self, stream: EngineStream) -> dict[str, Any]:
        async for _ in self.events(stream):
            pass
        return self.snapshot(self.status)

    def _failed(self, error: APIError) -> Iterator[str]:
        message = error.message
        yield self._event("error", code=error.code or error.type, message=message,
                          param=error.param)
        yield self._event("response.failed", response=self.snapshot(
            "failed", {"code": "server_error", "message": message}))

    # -- events ------------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\n" + sse(payload)

    async def events(self, stream: EngineStream) -> AsyncIterator[str]:
        """All events of the response, building `output`; the last carries the whole response."""
        yield self._event("response.created", response=self.snapshot("in_progress"))
        yield self._event("response.in_progress", response=self.snapshot("in_progress"))
        reason = None
        async for _, delta in stream:
            self._take_usage(delta)
            for out in delta.outputs:
                reason = out.finish_reason or reason
                for event in self._pieces(out.text, out.finish_reason is not None):
                    yield event
        self.status = "incomplete" if reason == "length" else "completed"
        for event in self._close_reasoning(self.status):
            yield event
        if self._message is None and not self._calls:  # no answer: still one (empty) message
            for event in self._text(""):
                yield event
        for event in self._close(self.status):
            yield event
        yield self._event(f"response.{self.status}", response=self.snapshot(self.status))

    def _take_usage(self, delta: RequestOutput) -> None:
        if delta.usage is not None:
            u = delta.usage
            self.usage = {"input_tokens": u.prompt_tokens,
                          "input_tokens_details": {"cached_tokens": u.cached_tokens},
                          "output_tokens": u.completion_tokens,
                          "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": u.prompt_tokens + u.completion_tokens}

    def _pieces(self, text: str, last: bool) -> Iterator[str]:
        if self.thinking is not None:
            parts = self.thinking.feed(text) + (self.thinking.finish() if last else [])
            text = ""
            for kind, part in parts:
                if kind == "reasoning":
                    yield from self._thought(part)
                else:
                    text += part
            if text:
                yield from self._close_reasoning()
        if self.parser is None:
            pieces: list = [text] if text else []
        else:
            pieces = self.parser.feed(text) + (self.parser.finish() if last else [])
        for piece in pieces:
            if isinstance(piece, str):
                yield from self._text(piece)
            elif isinstance(piece, CallStart):
                yield from self._close_call("completed")
                yield from self._start_call(piece)
            elif isinstance(piece, CallArguments):
                index = self._calls[piece.index]
                item = self.output[index]
                # forced calls stream from right after `"arguments":`, space included
                delta = piece.text if item["arguments"] else piece.text.lstrip()
                if delta:
                    item["arguments"] += delta
                    yield self._event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=index, delta=delta)

    def _text(self, piece: str) -> Iterator[str]:
        if self._message is None:
            self._message = len(self.output)
            item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                    "role": "assistant", "content": []}
            self.output.append(item)
            yield self._event("response.output_item.added", output_index=self._message,
                              item=item)
            part = {"type": "output_text", "text": "", "annotations": []}
            item["content"].append(part)
            yield self._event("response.content_part.added", item_id=item["id"],
                              output_index=self._message, content_index=0, part=part)
        if piece:
            item = self.output[self._message]
            item["content"][0]["text"] += piece
            yield self._event("response.output_text.delta", item_id=item["id"],
                              output_index=self._message, content_index=0, delta=piece,
                              logprobs=[])

    def _thought(self, piece: str) -> Iterator[str]:
        if self._reasoning is None:
            self._reasoning = len(self.output)
            item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}],
                    "status": "in_progress"}
            self.output.append(item)
            yield self._event("response.output_item.added", output_index=self._reasoning,
                              item=item)
        item = self.output[self._reasoning]
        item["content"][0]["text"] += piece
        yield self._event("response.reasoning_text.delta", item_id=item["id"],
                          output_index=self._reasoning, content_index=0, delta=piece)

    def _close_reasoning(self, status: str = "completed") -> Iterator[str]:
        if self._reasoning is None:
            return
        index, self._reasoning = self._reasoning, None
        item = self.output[index]
        item["status"] = status
        yield self._event("response.reasoning_text.done", item_id=item["id"],
                          output_index=index, content_index=0, text=item["content"][0]["text"])
        yield self._event("response.output_item.done", output_index=index, item=item)

    def _start_call(self, start: CallStart) -> Iterator[str]:
        self._call = self._calls[start.index] = len(self.output)
        item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": start.id,
                "name": start.name, "arguments": "", "status": "in_progress"}
        self.output.append(item)
        yield self._event("response.output_item.added", output_index=self._call, item=item)

    def _close_call(self, status: str) -> Iterator[str]:
        if self._call is None:
            return
        index, self._call = self._call, None
        item = self.output[index]
        item["status"] = status
        yield self._event("response.function_call_arguments.done", item_id=item["id"],
                          output_index=index, arguments=item["arguments"])
        yield self._event("response.output_item.done", output_index=index, item=item)

    def _close(self, status: str) -> Iterator[str]:
        """The done events of the items still open: the reasoning, the message, then the last
        call."""
        yield from self._close_reasoning(status)
        if self._message is not None:
            index, item = self._message, self.output[self._message]
            part = item["content"][0]
            item["status"] = status
            yield self._event("response.output_text.done", item_id=item["id"],
                              output_index=index, content_index=0, text=part["text"],
                              logprobs=[])
            yield self._event("response.content_part.done", item_id=item["id"],
                              output_index=index, content_index=0, part=part)
            yield self._event("response.output_item.done", output_index=index, item=item)
        yield from self._close_call(status)
