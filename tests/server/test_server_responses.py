"""`POST /v1/responses` through a real `jengine serve` and the official `openai` SDK
(`responses.create`, `responses.stream`, `responses.parse`): the same greedy text as chat for the
same messages, whole or streamed; instructions, message items, function calls and their outputs;
`text.format` JSON schema; forced function calls; `max_output_tokens` -> incomplete; usage; 400s.
Also `chat.completions.parse` with a Pydantic model. And, without a server, the translation of
`input` and the `error` + `response.failed` events of a stream that fails.

The session's one server (conftest's `server`, which test_server.py also uses).
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from openai_shapes import assert_error  # tests/openai_shapes.py
from pydantic import BaseModel
from serve_process import MODEL  # tests/serve_process.py

from jengine.outputs import CompletionOutput, RequestOutput, Usage
from jengine.server.errors import APIError
from jengine.server.pipeline import sse_stream
from jengine.server.responses import _ResponseView
from jengine.server.responses_request import ResponsesRequest, input_messages
from jengine.text.tools import ToolSetup

ASK = "What is the capital of France?"
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"], "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


class Person(BaseModel):
    name: str
    age: int


def _create(server, **kw):  # noqa: F811
    return server.client().responses.create(model=MODEL, temperature=0, **kw)


def _chat(server, messages, **kw):  # noqa: F811
    return server.client().chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                   **kw)


def _events(server, **kw) -> list:  # noqa: F811
    return list(_create(server, stream=True, **kw))


def _both(server, **kw) -> tuple:  # noqa: F811
    """The whole response and the stream's events of one request, run at once (one batch)."""
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(_create, server, **kw)
        events = pool.submit(_events, server, **kw)
        return whole.result(), events.result()


def _streamed_text(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def _check_sequence(events) -> None:
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []


# -- text ------------------------------------------------------------------------------------------

def test_text_input_matches_chat_whole_and_streamed(server):  # noqa: F811
    whole = _create(server, input=ASK, max_output_tokens=24)
    chat = _chat(server, [{"role": "user", "content": ASK}], max_tokens=24)
    assert whole.output_text == chat.choices[0].message.content and whole.output_text
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.model == MODEL
    assert whole.status == "completed" and whole.incomplete_details is None
    [item] = whole.output
    assert (item.type, item.role, item.status) == ("message", "assistant", "completed")
    assert item.id.startswith("msg_")
    [part] = item.content
    assert (part.type, part.annotations) == ("output_text", [])
    # the echo fields
    assert (whole.temperature, whole.top_p, whole.max_output_tokens) == (0, 1.0, 24)
    assert (whole.tools, whole.tool_choice, whole.parallel_tool_calls) == ([], "auto", True)
    assert whole.text.format.type == "text" and whole.error is None

    events = _events(server, input=ASK, max_output_tokens=24)
    _check_sequence(events)
    assert [e.type for e in events[2:4]] == ["response.output_item.added",
                                             "response.content_part.added"]
    assert [e.type for e in events[-4:]] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and {(e.item_id, e.output_index, e.content_index) for e in deltas} \
        == {(events[2].item.id, 0, 0)}
    assert _streamed_text(events) == events[-4].text == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens

    kw = dict(model=MODEL, input=ASK, max_output_tokens=24, temperature=0)
    with server.client().responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert final.output_text == whole.output_text


def test_usage_counts_the_prompt_and_the_output(server):  # noqa: F811
    messages = [{"role": "user", "content": ASK}]
    r = _create(server, input=ASK, max_output_tokens=24)
    tokens = server.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    chat = _chat(server, messages, max_tokens=24)
    u = r.usage
    assert u.input_tokens == tokens["count"] == chat.usage.prompt_tokens
    assert u.output_tokens == chat.usage.completion_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert 0 <= u.input_tokens_details.cached_tokens <= u.input_tokens
    assert u.output_tokens_details.reasoning_tokens == 0


def test_instructions_are_a_system_message(server):  # noqa: F811
    system = "Answer in French."
    r = _create(server, instructions=system, input=ASK, max_output_tokens=20)
    chat = _chat(server, [{"role": "system", "content": system}, {"role": "user", "content": ASK}],
                 max_tokens=20)
    assert r.output_text == chat.choices[0].message.content
    assert r.instructions == system
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_message_items_match_chat_messages(server):  # noqa: F811
    items = [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a color."},
                                     {"type": "input_text", "text": "Just one."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Blue.", "annotations": []}]},
        {"role": "user", "content": "Another one?"},
    ]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a color.\nJust one."},
                {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Another one?"}]
    r = _create(server, input=items, max_output_tokens=16)
    assert r.output_text == _chat(server, messages, max_tokens=16).choices[0].message.content


def test_max_output_tokens_makes_an_incomplete_response(server):  # noqa: F811
    r, events = _both(server, input="Write a long story about a dragon.", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3
    _check_sequence(events)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == _streamed_text(events) == r.output_text


# -- structured output and tools -------------------------------------------------------------------

def test_json_schema_text_format(server):  # noqa: F811
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    kw = dict(input="Invent a person.", max_output_tokens=60, text={"format": fmt})
    r, events = _both(server, **kw)
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    assert _streamed_text(events) == r.output_text
    parsed = server.client().responses.parse(model=MODEL, input="Invent a person.", temperature=0,
                                             max_output_tokens=60, text_format=Person)
    assert isinstance(parsed.output_parsed, Person)


def test_chat_completions_parse_with_a_pydantic_model(server):  # noqa: F811
    r = server.client().chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], temperature=0,
        max_tokens=60, response_format=Person)
    assert isinstance(r.choices[0].message.parsed, Person)
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_forced_function_call(server, choice):  # noqa: F811
    kw = dict(input="What's the weather like in Paris?", tools=[WEATHER], tool_choice=choice,
              parallel_tool_calls=False, max_output_tokens=40)
    r, events = _both(server, **kw)
    assert r.status == "completed"
    [call] = r.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"}
    assert r.tools[0].name == "get_weather"

    _check_sequence(events)
    types = [e.type for e in events]
    assert types[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1  # forced calls stream their arguments as they are generated
    assert "".join(deltas) == events[-3].arguments == call.arguments
    assert events[-1].response.output[0].arguments == call.arguments


def test_function_call_output_round_trip_matches_chat(server):  # noqa: F811
    args, result = '{"city": "Paris"}', '{"temperature": 21, "sky": "clear"}'
    items = [{"role": "user", "content": "What's the weather like in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": args},
             {"type": "function_call_output", "call_id": "call_1", "output": result}]
    messages = [{"role": "user", "content": "What's the weather like in Paris?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": args}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": result}]
    r = _create(server, input=items, tools=[WEATHER], max_output_tokens=16)
    chat = _chat(server, messages, tools=[CHAT_WEATHER], max_tokens=16).choices[0].message
    assert r.output_text == (chat.content or "")
    calls = [item.name for item in r.output if item.type == "function_call"]
    assert calls == [c.function.name for c in chat.tool_calls or ()]


# -- errors ----------------------------------------------------------------------------------------

def test_previous_response_id_is_a_400(server):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as e:
        _create(server, input=ASK, previous_response_id="resp_123", max_output_tokens=4)
    assert e.value.param == "previous_response_id"
    assert "stores no responses" in e.value.message


def test_unknown_model_is_a_404(server):  # noqa: F811
    with pytest.raises(openai.NotFoundError):
        server.client().responses.create(model="no-such-model", input=ASK, max_output_tokens=4)


@pytest.mark.parametrize("body, param", [
    ({"bogus": 1}, "bogus"),
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "schema": PERSON}}}, "text.format"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": "hi " * 600}, "input"),
])
def test_bad_requests_are_400s_naming_the_field(server, body, param):  # noqa: F811
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 4, **body}
    err = assert_error(server.post("/v1/responses", json=body), 400)
    assert err["param"] == param, err
    # in this route's words, not chat's
    assert param.split(".")[0] in err["message"], err
    assert not any(name in err["message"] for name in ("response_format", "max_tokens",
                                                       "messages", "prompt has")), err


def test_the_key_is_needed_and_the_request_id_names_the_response(server):  # noqa: F811
    assert_error(httpx.post(server.url + "/v1/responses", json={"input": "x"}), 401,
                 "invalid_api_key")
    r = server.post("/v1/responses", headers={"X-Request-Id": "trace-resp-1"},
                    json={"model": MODEL, "input": "Hi", "max_output_tokens": 2})
    assert r.status_code == 200 and r.json()["id"] == "resp_trace-resp-1"


def test_accepted_and_ignored_fields(server):  # noqa: F811
    r = _create(server, input=ASK, max_output_tokens=2, store=True, metadata={"k": "v"}, user="u",
                reasoning={"effort": None}, truncation="disabled")
    assert r.status == "incomplete" and r.metadata == {"k": "v"} and r.user == "u"
    assert r.model_extra.get("store") is False  # nothing is stored


# -- without a server ------------------------------------------------------------------------------

def test_input_items_become_chat_messages():
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    messages = input_messages([
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "let me see"}]},
        call, {**call, "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": "r1"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "r2"}]},
        call,
    ])
    calls = [{"id": c, "type": "function", "function": {"name": "f", "arguments": "{}"}}
             for c in ("c1", "c2")]
    assert messages == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "let me see", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
        {"role": "tool", "tool_call_id": "c2", "content": "r2"},
        {"role": "assistant", "content": None, "tool_calls": calls[:1]},
    ]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]


class _FakeStream:
    """Deltas of `texts` (the last finishing with `finish`), then `error` if given."""

    request_id = "test"
    closed = False

    def __init__(self, texts: list[str], finish: str | None = "stop",
                 error: Exception | None = None):
        self.texts, self.finish, self.error = texts, finish, error

    async def __aiter__(self):
        for i, text in enumerate(self.texts):
            last = i == len(self.texts) - 1
            out = CompletionOutput(0, text, [2], finish_reason=self.finish if last else None)
            yield 0, RequestOutput("test", None, [1], None, [out], last, Usage.of(1, i + 1))
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.closed = True


def _run_events(view: _ResponseView, stream: _FakeStream) -> list[dict]:
    async def collect() -> list[dict]:
        events = sse_stream(stream, view.events(stream), view.framing)  # as the route frames them
        return [json.loads(e.split("data: ", 1)[1]) async for e in events]

    return asyncio.run(collect())


def test_a_failing_stream_ends_with_error_and_response_failed():
    view = _ResponseView(ResponsesRequest(input="x"), "resp_x", MODEL, ToolSetup([], "none"))
    error = APIError(500, "the engine failed: boom", type="server_error", code="engine_error")
    stream = _FakeStream(["Hel", "lo"], finish=None, error=error)
    events = _run_events(view, stream)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "error", "response.failed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-2]["code"] == "engine_error" and "boom" in events[-2]["message"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["output"][0]["content"][0]["text"] == "Hello"
    assert stream.closed


def test_auto_tool_call_after_text_whole_and_streamed():
    texts = ["Sure.", "\n<tool_", 'call>{"name": "f", "arguments": {"a": 1}}</tool_call>']
    tools = ToolSetup([{"name": "f"}], "auto")

    def view() -> _ResponseView:
        return _ResponseView(ResponsesRequest(input="x"), "resp_x", MODEL, tools)

    whole = asyncio.run(view().response(_FakeStream(texts)))
    assert whole["status"] == "completed"
    message, call = whole["output"]
    assert message["content"][0]["text"] == "Sure." and message["status"] == "completed"
    assert (call["type"], call["name"], call["arguments"]) == ("function_call", "f", '{"a": 1}')
    assert whole["usage"]["output_tokens"] == 3
    events = _run_events(view(), _FakeStream(texts))
    assert [e["type"] for e in events[2:]] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    final = events[-1]["response"]
    for a, b in zip(final["output"], whole["output"]):
        assert {k: v for k, v in a.items() if k not in ("id", "call_id")} == \
            {k: v for k, v in b.items() if k not in ("id", "call_id")}
