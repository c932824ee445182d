"""`POST /v1/messages` and `/v1/messages/count_tokens` through a real `jengine serve` and the
official `anthropic` SDK (`messages.create`, `messages.stream`, `messages.count_tokens`): the same
greedy text as chat for the same conversation, system prompts, stop sequences and max_tokens
as stop reasons, streaming equal to the whole message, tool_use blocks (forced, streamed, and a
tool_result round trip), token counts equal to the rendered prompt, errors in Anthropic's shape
with the SDK's typed exceptions, and the key as `x-api-key`. And, without a server, the `error`
event of a stream that fails.

The session's one server (conftest's `server`, which test_server.py also uses).
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import jsonschema
import pytest
from serve_process import KEY, MODEL  # tests/serve_process.py

from jengine.outputs import CompletionOutput, RequestOutput, Usage
from jengine.server.errors import APIError
from jengine.server.messages import _MessageView
from jengine.server.pipeline import sse_stream
from jengine.text.tools import ToolSetup

ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string", "maxLength": 30}},
                            "required": ["city"], "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {
    "name": WEATHER["name"], "description": WEATHER["description"],
    "parameters": WEATHER["input_schema"]}}
WEATHER_ASK = [{"role": "user", "content": "What's the weather like in Paris?"}]


def _client(server, **kw) -> anthropic.Anthropic:
    kw.setdefault("api_key", KEY)
    return anthropic.Anthropic(base_url=server.url, max_retries=0, timeout=120, **kw)


GREEDY = {"temperature": 0}  # the SDK has no temperature argument any more: extra_body


def _create(server, **kw):
    return _client(server).messages.create(model=MODEL, extra_body=GREEDY,
                                           messages=kw.pop("messages", ASK), **kw)


def _chat(server, messages, **kw):
    return server.client().chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                   **kw).choices[0]


def _tokens(server, messages) -> int:
    r = server.post("/tokenize", json={"model": MODEL, "messages": messages})
    return r.json()["count"]


def _count(server, **kw) -> int:
    return _client(server).messages.count_tokens(model=MODEL, **kw).input_tokens


# -- text ------------------------------------------------------------------------------------------

def test_text_reply_is_chats_greedy_text(server):
    m = _create(server, max_tokens=16)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    choice = _chat(server, ASK, max_tokens=16)
    assert m.content[0].text == choice.message.content
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[choice.finish_reason]
    assert m.stop_sequence is None
    assert m.usage.input_tokens == _tokens(server, ASK) == _count(server, messages=ASK)
    assert 0 < m.usage.output_tokens <= 16


def test_system_prompt_string_or_blocks(server):
    system = "You are a pirate. Answer like one."
    m = _create(server, max_tokens=12, system=system)
    blocks = _create(server, max_tokens=12, system=[{"type": "text", "text": system,
                                                     "cache_control": {"type": "ephemeral"}}])
    as_chat = [{"role": "system", "content": system}, *ASK]
    assert m.content[0].text == blocks.content[0].text == \
        _chat(server, as_chat, max_tokens=12).message.content
    assert m.usage.input_tokens == _tokens(server, as_chat) == \
        _count(server, messages=ASK, system=system)


def test_stop_sequence_and_max_tokens_stop_reasons(server):
    ask = [{"role": "user", "content": "Write a long story about a dragon."}]
    full = _create(server, messages=ask, max_tokens=40).content[0].text
    word = full.split()[3]
    stopped = _create(server, messages=ask, max_tokens=40, stop_sequences=["zzz-never", word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == full[:full.index(word)]
    short = _create(server, messages=ask, max_tokens=3)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    assert full.startswith(short.content[0].text)


def test_a_last_assistant_message_is_continued(server):
    prefill = [*ASK, {"role": "assistant", "content": "The capital of France is"}]
    m = _create(server, messages=prefill, max_tokens=8)
    chat = server.client().chat.completions.create(
        model=MODEL, messages=prefill, temperature=0, max_tokens=8,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert m.content[0].text == chat.choices[0].message.content


def test_output_config_format_constrains_the_text(server):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0}},
              "required": ["name", "age"], "additionalProperties": False}
    m = _create(server, messages=[{"role": "user", "content": "Invent a person."}],
                max_tokens=60, output_config={"format": {"type": "json_schema",
                                                         "schema": person}})
    jsonschema.validate(json.loads(m.content[0].text), person)
    assert m.stop_reason == "end_turn"


# -- streaming -------------------------------------------------------------------------------------

def test_stream_equals_the_whole_message(server):
    kw = dict(model=MODEL, messages=ASK, max_tokens=20, extra_body=GREEDY)
    whole = _client(server).messages.create(**kw)
    with _client(server).messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert final.content[0].text == text and final.stop_reason == whole.stop_reason
    assert (final.usage.input_tokens, final.usage.output_tokens) == \
        (whole.usage.input_tokens, whole.usage.output_tokens)


def test_stream_events_are_anthropics(server):
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=120, json={
        "model": MODEL, "messages": ASK, "max_tokens": 5, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = []
    for frame in r.text.split("\n\n")[:-1]:
        head, data = frame.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        events.append(payload)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[0]["message"]["content"] == [] and events[0]["message"]["usage"]["input_tokens"]
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    assert events[-2]["usage"]["output_tokens"] == 5


# -- tools -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_forced_tool_use_block_has_parsed_input(server, choice):
    m = _create(server, messages=WEATHER_ASK, tools=[WEATHER], tool_choice=choice,
                max_tokens=40)
    assert m.stop_reason == "tool_use"
    [block] = m.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.id.startswith("toolu_")
    jsonschema.validate(block.input, WEATHER["input_schema"])
    chat = _chat(server, WEATHER_ASK, tools=[CHAT_WEATHER], max_tokens=40,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}}
                 if choice["type"] == "tool" else "required")
    assert block.input == json.loads(chat.message.tool_calls[0].function.arguments)


def test_streamed_tool_use_reassembles_to_the_same_input(server):
    kw = dict(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER], max_tokens=40,
              extra_body=GREEDY, tool_choice={"type": "tool", "name": "get_weather"})
    whole = _client(server).messages.create(**kw)
    deltas = []
    with _client(server).messages.stream(**kw) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                deltas.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert len(deltas) > 2  # forced calls stream their input as it is generated
    assert json.loads("".join(deltas)) == whole.content[0].input == final.content[0].input
    assert final.stop_reason == "tool_use" and final.content[0].name == "get_weather"


def test_tool_result_round_trip(server):
    first = _create(server, messages=WEATHER_ASK, tools=[WEATHER], max_tokens=40,
                    tool_choice={"type": "tool", "name": "get_weather"}).content[0]
    result = '{"temperature": 21, "sky": "clear"}'
    messages = [*WEATHER_ASK,
                {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                                  first.model_dump()]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first.id,
                                              "content": [{"type": "text", "text": result}]}]}]
    as_chat = [*WEATHER_ASK,
               {"role": "assistant", "content": "Let me check.", "tool_calls": [
                   {"id": first.id, "type": "function",
                    "function": {"name": first.name, "arguments": json.dumps(first.input)}}]},
               {"role": "tool", "tool_call_id": first.id, "content": result}]
    final = _create(server, messages=messages, tools=[WEATHER], max_tokens=16)
    chat = _chat(server, as_chat, tools=[CHAT_WEATHER], max_tokens=16)
    # tool_choice auto: whatever SmolLM2 does, it is what chat does with the same turns
    if final.stop_reason == "tool_use":
        assert chat.finish_reason == "tool_calls"
        assert [b.name for b in final.content if b.type == "tool_use"] == \
            [c.function.name for c in chat.message.tool_calls]
    else:
        assert final.content[0].text == chat.message.content
    assert final.usage.input_tokens == _count(server, messages=messages, tools=[WEATHER])


# -- errors and auth -------------------------------------------------------------------------------

BAD = [
    {"messages": ASK},  # no max_tokens
    {"messages": ASK, "max_tokens": 0},
    {"messages": ASK, "max_tokens": 4, "temperature": 1.5},
    {"messages": [{"role": "system", "content": "x"}], "max_tokens": 4},
    {"messages": [], "max_tokens": 4},
    {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
     "max_tokens": 4},
    {"messages": ASK, "max_tokens": 4, "unknown_field": 1},
    {"messages": ASK, "max_tokens": 4, "tools": [WEATHER],
     "tool_choice": {"type": "tool", "name": "nope"}},
    {"messages": ASK, "max_tokens": 4, "tool_choice": {"type": "any"}},
    {"messages": ASK, "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 1024}},
    {"messages": ASK, "max_tokens": 4, "stop_sequences": "x"},
    {"messages": ASK, "max_tokens": 4, "output_config": {"effort": "high"}},
    {"messages": ASK, "max_tokens": 4, "output_config": {"format": {"type": "regex"}}},
]


def _anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}
    assert body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}
    assert body["error"]["message"]
    return body["error"]["message"]


@pytest.mark.parametrize("body", BAD)
def test_bad_requests_are_400_in_anthropics_shape(server, body):
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                   json={"model": MODEL, **body})
    _anthropic_error(r, 400, "invalid_request_error")


def _png_base64() -> str:
    import base64
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


@pytest.mark.parametrize("source, words", [
    ({"type": "base64", "media_type": "image/png"}, "messages.0.content.1: this model does not "
                                                    "take images"),
    ({"type": "base64", "media_type": "image/bmp"}, "messages.0.content.1.source.media_type"),
    ({"type": "file", "file_id": "file_1"}, "sources of type 'file' are not supported"),
])
def test_image_blocks_name_the_block_and_a_text_model_refuses_them(server, source, words):
    """(Images on a vision model: tests/server/test_server_vision.py.)"""
    if source["type"] == "base64":
        source = {**source, "data": _png_base64()}
    content = [{"type": "text", "text": "What is this?"}, {"type": "image", "source": source}]
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                   json={"model": MODEL, "max_tokens": 4,
                         "messages": [{"role": "user", "content": content}]})
    assert words in _anthropic_error(r, 400, "invalid_request_error")


def test_sdk_raises_its_typed_errors(server):
    client = _client(server)
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=4,
                               messages=[{"role": "robot", "content": "x"}])
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "role" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-no-such-model", max_tokens=4, messages=ASK)
    assert missing.value.body == {"type": "error", "error": {
        "type": "not_found_error", "message": "The model 'claude-no-such-model' does not exist."}}
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-no-such-model", messages=ASK)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        _client(server, api_key="wrong").messages.create(model=MODEL, max_tokens=4,
                                                         messages=ASK)
    assert denied.value.body["error"]["type"] == "authentication_error"


def test_the_key_as_x_api_key_or_bearer_on_every_v1_route(server):
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": f"Basic {KEY}"}):
        r = httpx.post(server.url + "/v1/messages/count_tokens", headers=headers,
                       json={"model": MODEL, "messages": ASK})
        _anthropic_error(r, 401, "authentication_error")
    bearer = _client(server, api_key=None, auth_token=KEY)  # Authorization: Bearer
    assert bearer.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0
    # the OpenAI routes take x-api-key too, and keep OpenAI's error shape
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    r = httpx.get(server.url + "/v1/models", headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_the_document_lists_the_routes_with_anthropics_errors(server):
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        responses = paths[path]["post"]["responses"]
        schema = responses["400"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/AnthropicErrorResponse"}
    assert "text/event-stream" in paths["/v1/messages"]["post"]["responses"]["200"]["content"]


# -- a stream that fails (no server) ---------------------------------------------------------------

class _FakeStream:
    """Deltas of `texts` (the last with `finish`), then `error` raised if any: what
    `EngineStream` gives the view."""

    prompt_token_ids = [[1, 2, 3]]

    def __init__(self, texts: list[str], finish: str | None = "stop",
                 error: Exception | None = None):
        self.texts, self.finish, self.error, self.closed = texts, finish, error, False
        self.request_id = "msg-test"

    async def __aiter__(self):
        for i, text in enumerate(self.texts):
            last = i == len(self.texts) - 1
            out = CompletionOutput(0, text, [2], finish_reason=self.finish if last else None)
            yield 0, RequestOutput("test", None, [1, 2, 3], None, [out], last and not self.error,
                                   Usage.of(3, i + 1))
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.closed = True


def _frames(view: _MessageView, stream: _FakeStream) -> list[str]:
    async def collect() -> list[str]:  # as the route frames them
        return [e async for e in sse_stream(stream, view.events(stream), view.framing)]

    return asyncio.run(collect())


def test_a_failing_stream_ends_with_an_error_event():
    view = _MessageView("msg_x", MODEL, ToolSetup([], "none"))
    stream = _FakeStream(["Hel", "lo"], None, APIError(500, "the engine failed: boom",
                                                      type="server_error", code="engine_error"))
    frames = _frames(view, stream)
    kinds = [f.split("\n", 1)[0].removeprefix("event: ") for f in frames]
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_delta",
                     "content_block_delta", "error"]
    error = json.loads(frames[-1].split("data: ", 1)[1])
    assert error == {"type": "error", "error": {"type": "api_error",
                                                "message": "the engine failed: boom"}}
    assert stream.closed and "[DONE]" not in "".join(frames)


def test_auto_tool_call_after_text_whole_and_streamed():
    texts = ["Sure.", "\n<tool_", 'call>{"name": "f", "arguments": {"a": 1}}</tool_call>']
    tools = ToolSetup([{"name": "f"}], "auto")
    whole = asyncio.run(_MessageView("msg_x", MODEL, tools).response(_FakeStream(texts)))
    text, call = whole["content"]
    assert text == {"type": "text", "text": "Sure."}
    assert (call["type"], call["name"], call["input"]) == ("tool_use", "f", {"a": 1})
    assert whole["stop_reason"] == "tool_use"
    assert whole["usage"] == {"input_tokens": 3, "output_tokens": 3}
    events = [json.loads(f.split("data: ", 1)[1])
              for f in _frames(_MessageView("msg_x", MODEL, tools), _FakeStream(texts))]
    assert [(e["type"], e.get("index")) for e in events[2:]] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("message_delta", None), ("message_stop", None)]
    start = events[5]["content_block"]
    assert start["id"].startswith("toolu_") and start["input"] == {}
    assert (start["type"], start["name"]) == ("tool_use", "f")
    assert json.loads(events[6]["delta"]["partial_json"]) == {"a": 1}
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
