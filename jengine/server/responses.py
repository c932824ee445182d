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

An error after the stream began is an `error` event, then `response.failed`. There is no
`[DONE]` line (OpenAI sends none for this route). The whole response is built by the same code
that makes the events, so a streamed and a whole response carry the same output.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from jengine.outputs import RequestOutput
from jengine.server.errors import APIError, bad_request, invalid_value, validation_message
from jengine.server.protocol import ChatCompletionRequest, Float, check_text_fields
from jengine.server.state import ServerState
from jengine.server.streams import ClientGone, EngineStream, sse, start_stream
from jengine.text.chat import render_chat
from jengine.text.tools import CallArguments, CallStart, ToolCallStream, ToolSetup

log = logging.getLogger("jengine.server")

router = APIRouter()


class ResponseTextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


# Fields that need state or features this server does not have: set, they give a 400 saying so.
_UNSUPPORTED = {
    "previous_response_id": "previous_response_id is not supported: this server stores no "
                            "responses (send the whole conversation as input)",
    "conversation": "conversation is not supported: this server stores no conversations (send "
                    "the whole conversation as input)",
    "prompt": "prompt (stored prompt templates) is not supported",
    "background": "background responses are not supported",
    "include": "include is not supported",
    "top_logprobs": "top_logprobs is not supported on /v1/responses",
    "max_tool_calls": "max_tool_calls is not supported (parallel_tool_calls: false allows one)",
    "reasoning": "reasoning is not supported: the model does not reason",
    "context_management": "context_management is not supported",
}


class ResponsesRequest(BaseModel):
    """`POST /v1/responses` (stateless)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None  # None: the served model
    input: StrictStr | list[dict[str, Any]] = Field(...)
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    stream: StrictBool | None = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: nothing is padded
    text: ResponseTextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # accepted and ignored, as they do not change what is generated
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    store: StrictBool | None = None  # nothing is stored either way
    service_tier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    # refused (`_UNSUPPORTED`)
    previous_response_id: StrictStr | None = None
    conversation: Any = None
    prompt: Any = None
    background: StrictBool | None = None
    include: list[StrictStr] | None = None
    top_logprobs: StrictInt | None = None
    max_tool_calls: StrictInt | None = None
    reasoning: dict[str, Any] | None = None
    context_management: Any = None

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this one means; raises a 400 (in this route's field names)."""
        self._check_supported()
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += input_messages(self.input)
        tools = chat_tools(self.tools)
        fields = {
            "model": self.model, "messages": messages, "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p,
            "tools": tools, "tool_choice": chat_tool_choice(self.tool_choice, tools),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self._response_format(),
        }
        try:
            return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            message, param = validation_message(list(e.errors()))
            raise bad_request(message, _renamed(param)) from None

    def _check_supported(self) -> None:
        for name, message in _UNSUPPORTED.items():
            if _is_set(getattr(self, name)):
                raise bad_request(message, name)
        if self.truncation == "auto":
            raise bad_request("truncation 'auto' is not supported (an input over the context "
                              "length is a 400)", "truncation")
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise bad_request("text.verbosity is not supported", "text.verbosity")

    def _response_format(self) -> dict[str, Any] | None:
        """`text.format` as chat's `response_format`."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None:
            return None
        if fmt.get("type") == "json_schema":
            if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema", {}), dict):
                raise bad_request("text.format json_schema needs a 'name' and a 'schema' object",
                                  "text.format")
            spec = {k: v for k, v in fmt.items() if k != "type"}
            return {"type": "json_schema", "json_schema": spec}
        if fmt.get("type") in ("text", "json_object"):
            return fmt
        raise bad_request("text.format must be {'type': 'text'}, {'type': 'json_object'} or "
                          "{'type': 'json_schema', 'name': ..., 'schema': {...}}", "text.format")


def _is_set(value: Any) -> bool:
    """Whether a field asks for something: not null, false, 0, empty, or all-null."""
    if isinstance(value, dict):
        return any(v is not None for v in value.values())
    return bool(value)


# -- request translation --------------------------------------------------------------------------

def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses `input` as chat messages: a string is one user message; message items keep
    their role; consecutive `function_call` items join the assistant turn before them as its
    `tool_calls`; a `function_call_output` is a `role: tool` message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise bad_request("input must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(i, item))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i),
                                 "arguments": _string(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _parts(i, output, "output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                             "content": content})
        else:
            raise bad_request(f"input[{i}]: items of type {kind!r} are not supported (only "
                              "message, function_call and function_call_output)",
                              f"input.{i}.type")
    return messages


_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")


def _message(i: int, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"input[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}",
                          f"input.{i}.role")
    content = item.get("content")
    if not isinstance(content, str):
        content = _parts(i, content, "content")
    return {"role": role, "content": content}


def _parts(i: int, parts: Any, field: str) -> str:
    """The text of a list of `input_text` / `output_text` parts, joined by newlines."""
    if not isinstance(parts, list):
        raise bad_request(f"input[{i}].{field} must be a string or a list of content parts",
                          f"input.{i}.{field}")
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"input[{i}].{field}[{j}]: content part type {kind!r} is not "
                              "supported (only input_text and output_text)",
                              f"input.{i}.{field}.{j}")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"input[{i}] ({item.get('type')}) needs a string '{key}'",
                          f"input.{i}.{key}")
    return value


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat tools (`{"type": "function", "function": {...}}`)."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(f"tools[{i}]: only function tools are supported, got type "
                              f"{tool.get('type')!r}", "tools")
        if not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{i}] needs a string 'name'", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> Any:
    """Responses' `tool_choice` in chat's form (`{"type": "function", "name": N}` -> nested)."""
    if choice is None or (tools is None and choice in ("auto", "none")):
        return None
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'name': ...}", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


# Chat's field names in errors, as this route calls them.
_RENAMED = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens",
            "max_tokens": "max_output_tokens", "messages": "input", "prompt": "input"}


def _renamed(param: str | None) -> str | None:
    if param is None:
        return None
    head, dot, rest = param.partition(".")
    if head == "messages":  # message positions differ (instructions, merged function calls)
        return "input"
    return _RENAMED.get(head, head) + dot + rest


@contextlib.contextmanager
def _in_responses_terms() -> Iterator[None]:
    """Errors raised by the chat path, with this route's field names."""
    try:
        yield
    except APIError as e:
        _rename(e)
        raise
    except ValueError as e:
        error = invalid_value(e)
        _rename(error)
        raise error from None


def _rename(error: APIError) -> None:
    """The error's param, and its message when it starts with the param (as `SamplingParams`'
    and the engine's do), in this route's names."""
    if error.param is None:
        return
    name = _renamed(error.param)
    if error.message.startswith(error.param):
        error.message = name + error.message.removeprefix(error.param)
    error.param = name


# -- the route ------------------------------------------------------------------------------------

@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    state: ServerState = request.app.state.server
    state.check_model(body.model)
    check_text_fields(body)
    chat = body.chat_request()
    with _in_responses_terms():
        messages = chat.template_messages()
        tools = chat.tool_setup()
        params = chat.sampling_params(tools, default_max_tokens=state.config.default_max_tokens)
    engine = state.admit()
    with _in_responses_terms():
        state.check_limits(params, 1, engine.core.max_model_len)
        # Rendering and tokenizing a long input takes a while: not in the event loop's thread.
        prompt = await asyncio.to_thread(
            render_chat, engine.tokenizer, messages, tools=chat.tools if tools.active else None,
            chat_template=state.chat_template)
    request_id = request.state.request_id
    with _in_responses_terms():
        stream = await start_stream(state, engine, request, [prompt], params, request_id,
                                    chat.constraint_param())
    view = _ResponseView(body, f"resp_{request_id}", state.model_name, tools)
    if body.stream:
        return StreamingResponse(view.sse(stream), media_type="text/event-stream")
    async with stream:
        return JSONResponse(await view.response(stream))


class _ResponseView:
    """Builds the response's output items from engine deltas, as stream events on the way."""

    def __init__(self, body: ResponsesRequest, response_id: str, model: str, tools: ToolSetup):
        self.body = body
        self.id = response_id
        self.model = model
        self.created_at = int(time.time())
        forced = tools.constraint() is not None  # well-formed calls: stream their arguments
        self.parser = ToolCallStream(incremental=forced) if tools.active else None
        self.output: list[dict[str, Any]] = []  # the output items, as they stand
        self.usage: dict[str, Any] | None = None
        self.status = "in_progress"
        self._message: int | None = None  # output index of the message item
        self._call: int | None = None  # output index of the call still being generated
        self._calls: dict[int, int] = {}  # call index -> output index
        self._seq = 0

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
        async for _ in self._events(stream):
            pass
        return self.snapshot(self.status)

    async def sse(self, stream: EngineStream) -> AsyncIterator[str]:
        """The events as server-sent events; an error becomes `error` + `response.failed`.

        The response owns `stream` from here on: however it ends, the engine request is aborted
        and its pages freed.
        """
        try:
            async for event in self._events(stream):
                yield event
        except ClientGone:
            return
        except APIError as e:
            log.warning("request %s failed mid-stream: %s", stream.request_id, e.message)
            for event in self._failed(e.code or e.type, e.message, e.param):
                yield event
        except Exception as e:
            log.exception("request %s failed mid-stream", stream.request_id)
            for event in self._failed("server_error", f"internal server error: {e}"):
                yield event
        finally:
            stream.close()

    def _failed(self, code: str, message: str, param: str | None = None) -> Iterator[str]:
        yield self._event("error", code=code, message=message, param=param)
        yield self._event("response.failed", response=self.snapshot(
            "failed", {"code": "server_error", "message": message}))

    # -- events ------------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\n" + sse(payload)

    async def _events(self, stream: EngineStream) -> AsyncIterator[str]:
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
        if not self.output:  # nothing generated: still one (empty) message
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
        """The done events of the items still open: the message, then the last call."""
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
