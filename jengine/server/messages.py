"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API, a view
over the generation pipeline (pipeline.py) on top of the chat path.

A request is translated into the chat request it means (`messages_request.py`) and runs as
one: the same template, tools, tool grammar and sampling, so the same conversation gives the
same greedy text on both routes. Its errors are in Anthropic's shape (the route table's
`anthropic` error shape: `{"type": "error", "error": {"type", "message"}}`).

The answer is a `message` object: `id` `msg_<request id>`, `content` blocks in the order
generated (`text`, and a `tool_use` block per tool call with its `input` parsed; at least one
block: an empty text block when nothing was generated), `stop_reason` (`end_turn`,
`max_tokens`, `stop_sequence` with the matched `stop_sequence`, `tool_use` when calls were
made) and `usage` (`input_tokens`: the whole rendered prompt, `output_tokens`). With
`thinking: {"type": "enabled", "budget_tokens": N}` on a server with `--reasoning-parser`, the
thought comes first as a `thinking` block (streamed as `thinking_delta`s; `signature` empty),
capped at N tokens (chat's `thinking_token_budget`). Streamed, the
events are Anthropic's, each sent as `event: <type>` + `data: {"type": <type>, ...}`:

    message_start (the message, no content), ping
    content_block_start, content_block_delta ..., content_block_stop       (each block)
        text_delta for text; input_json_delta (`partial_json`) for tool_use: forced calls
        (tool_choice any / tool) as generated, auto calls whole when their block closes
    message_delta (stop_reason, stop_sequence, usage), message_stop

An error after the stream began is an `error` event; there is no `[DONE]`. The whole message
is built by the same code that makes the events, so a streamed and a whole answer agree; a
tool call cut off by max_tokens (its input not JSON) is left out of the whole message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from jengine.server.chat import reasoning_adapt
from jengine.server.errors import APIError, bad_request, renamed_params
from jengine.server.messages_request import MessagesInput, MessagesRequest, messages_param
from jengine.server.pipeline import EngineStream, Framing, Job, accept, reply, sse, start
from jengine.text.reasoning import ReasoningStream
from jengine.text.tool_parsers import tool_stream
from jengine.text.tools import CallArguments, CallStart, ToolSetup
from jengine.vision.chat import has_images


async def create_message(body: MessagesRequest, request: Request) -> Response:
    state = accept(request, body)
    request_id = request.state.request_id
    chat = body.chat()  # its errors name this route's blocks (messages.i.content.j)
    body.check_images(state.ready_engine().core.model.takes_images)
    with renamed_params(messages_param):  # the chat path's errors: this route's field names
        messages = chat.template_messages()
        tools = dataclasses.replace(chat.tool_setup(),
                                    fmt=state.tool_parser(state.chat_template))
        params = chat.sampling_params(tools)
        # Thinking blocks only when asked for (`thinking` enabled): otherwise as before.
        reasoning, adapt = reasoning_adapt(state, chat, state.chat_template)
        stream = await start(state, request, Job(
            params, lambda tokenizer: [chat.render(tokenizer, messages, tools,
                                                   state.chat_template, state.media)],
            1, request_id, "max_tokens", chat.constraint_param(),
            adapt=adapt if body.thinking_enabled else None))
    view = _MessageView(f"msg_{request_id}", state.reported_model(body.model), tools,
                        state.tool_parser(state.chat_template))
    fmt = reasoning(stream.engine) if body.thinking_enabled else None
    view.thinking = ReasoningStream(fmt) if fmt is not None else None
    return await reply(stream, view, bool(body.stream))


async def count_message_tokens(body: MessagesInput, request: Request) -> dict[str, int]:
    """`{"input_tokens": N}`: the prompt `/v1/messages` would render for the same body."""
    state = accept(request, body)
    engine = state.ready_engine()
    with renamed_params(messages_param):
        chat = body.chat_request()
        messages = chat.template_messages()
        tools = chat.tool_setup()
        if has_images(messages):  # as /tokenize: the count would leave out the placeholders
            raise bad_request("count_tokens does not count image blocks", "messages")
        tokens = await asyncio.to_thread(chat.render, engine.tokenizer, messages, tools,
                                         state.chat_template)
    return {"input_tokens": len(tokens)}


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\n" + sse({"type": kind, **fields})


class _MessageView:
    """Builds the message's content blocks from engine deltas, as stream events on the way."""

    def __init__(self, message_id: str, model: str, tools: ToolSetup,
                 tool_parser: str | None = None):
        self.id = message_id
        self.model = model
        forced = tools.constraint() is not None  # well-formed calls: stream their input
        self.parser = tool_stream(tool_parser, forced) if tools.active else None
        self.content: list[dict[str, Any]] = []  # the blocks as they stand
        self.arguments: dict[int, str] = {}  # tool_use block index -> its input's JSON text
        self.open: int | None = None  # the index of the block being generated
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage = {"input_tokens": 0, "output_tokens": 0}
        self.framing = Framing(self._failed, None)  # Anthropic sends no [DONE]
        self.thinking: ReasoningStream | None = None  # `thinking` enabled: the split

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [b for i, b in enumerate(self.content) if self._whole(i, b)],
                "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence,
                "usage": dict(self.usage)}

    def _whole(self, index: int, block: dict[str, Any]) -> bool:
        return block["type"] != "tool_use" or index not in self.arguments

    async def response(self, stream: EngineStream) -> dict[str, Any]:
        async for _ in self.events(stream):
            pass
        return self.message()

    @staticmethod
    def _failed(error: APIError) -> list[str]:
        return [_event("error", error=error.body("anthropic")["error"])]

    # -- events ------------------------------------------------------------------------------------

    async def events(self, stream: EngineStream) -> AsyncIterator[str]:
        """All events of the message, building `content`."""
        self.usage["input_tokens"] = len(stream.prompt_token_ids[0] or ())
        yield _event("message_start", message=self.message())
        yield _event("ping")
        finish, stop = None, None
        async for _, delta in stream:
            if delta.usage is not None:
                self.usage = {"input_tokens": delta.usage.prompt_tokens,
                              "output_tokens": delta.usage.completion_tokens}
            for out in delta.outputs:
                if out.finish_reason is not None:
                    finish, stop = out.finish_reason, out.stop_reason
                for event in self._pieces(out.text, out.finish_reason is not None):
                    yield event
        if not self.content:  # nothing generated: still one (empty) text block
            for event in self._text(""):
                yield event
        for event in self._close():
            yield event
        self._stop(finish, stop)
        yield _event("message_delta", delta={"stop_reason": self.stop_reason,
                                             "stop_sequence": self.stop_sequence},
                     usage=dict(self.usage))
        yield _event("message_stop")

    def _stop(self, finish: str | None, stop: int | str | None) -> None:
        """Chat's finish reason in Anthropic's words."""
        calls = self.parser is not None and self.parser.num_calls > 0
        if finish == "length":
            self.stop_reason = "max_tokens"
        elif calls or finish == "tool_calls":
            self.stop_reason = "tool_use"
        elif isinstance(stop, str):
            self.stop_reason, self.stop_sequence = "stop_sequence", stop
        else:  # EOS, or a stop token id
            self.stop_reason = "end_turn"

    def _pieces(self, text: str, last: bool) -> Iterator[str]:
        if self.thinking is None:
            yield from self._answer(text, last)
            return
        for kind, piece in self.thinking.feed(text) + (self.thinking.finish() if last else []):
            if kind == "reasoning":
                yield from self._thought(piece)
            else:
                yield from self._answer(piece, False)
        if last:
            yield from self._answer("", True)

    def _thought(self, piece: str) -> Iterator[str]:
        """Thinking as Anthropic's `thinking` block (its `signature` empty: nothing signs it
        here, and a client sends the block back only to be dropped, as templates do)."""
        if self.open is None or self.content[self.open]["type"] != "thinking":
            yield from self._open({"type": "thinking", "thinking": "", "signature": ""})
        self.content[self.open]["thinking"] += piece
        yield _event("content_block_delta", index=self.open,
                     delta={"type": "thinking_delta", "thinking": piece})

    def _answer(self, text: str, last: bool) -> Iterator[str]:
        if self.parser is None:
            pieces: list = [text] if text else []
        else:
            pieces = self.parser.feed(text) + (self.parser.finish() if last else [])
        for piece in pieces:
            if isinstance(piece, str):
                yield from self._text(piece)
            elif isinstance(piece, CallStart):
                yield from self._start(piece)
            elif isinstance(piece, CallArguments) and self.open in self.arguments:
                # forced calls stream from right after `"arguments":`, space included
                done = self.arguments[self.open]
                fragment = piece.text if done else piece.text.lstrip()
                if fragment:
                    self.arguments[self.open] = done + fragment
                    yield _event("content_block_delta", index=self.open,
                                 delta={"type": "input_json_delta", "partial_json": fragment})

    def _text(self, piece: str) -> Iterator[str]:
        if self.open is None or self.content[self.open]["type"] != "text":
            yield from self._open({"type": "text", "text": ""})
        if piece:
            self.content[self.open]["text"] += piece
            yield _event("content_block_delta", index=self.open,
                         delta={"type": "text_delta", "text": piece})

    def _start(self, call: CallStart) -> Iterator[str]:
        block_id = "toolu_" + call.id.removeprefix("call_")
        yield from self._open({"type": "tool_use", "id": block_id, "name": call.name,
                               "input": {}})
        self.arguments[self.open] = ""

    def _open(self, block: dict[str, Any]) -> Iterator[str]:
        yield from self._close()
        self.open = len(self.content)
        self.content.append(block)
        yield _event("content_block_start", index=self.open, content_block=dict(block))

    def _close(self) -> Iterator[str]:
        """Ends the open block; a tool_use block's input is parsed now (kept out of the whole
        message, still in `arguments`, if it is not a JSON object)."""
        if self.open is None:
            return
        index, self.open = self.open, None
        if index in self.arguments:
            try:
                value = json.loads(self.arguments[index] or "{}")
            except json.JSONDecodeError:
                value = None
            if isinstance(value, dict):
                self.content[index]["input"] = value
                del self.arguments[index]
        yield _event("content_block_stop", index=index)
