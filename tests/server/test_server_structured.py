"""Structured outputs and tool calling through a real `jengine serve` and the official `openai`
SDK: response_format, vLLM's structured_outputs / guided_* extras, 400s for bad or doubled
constraints, streaming equal to non-streaming, forced and streamed tool calls, a tool round trip.

The session's one server (conftest's `server`, which test_server.py also uses).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from openai_shapes import assert_error, sse_payloads  # tests/openai_shapes.py
from serve_process import MODEL  # tests/serve_process.py
from structured_cases import WEATHER

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What's the weather like in Paris?"}]


def _chat(server, stream=False, **kw):  # noqa: F811
    return server.client().chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK),
                                                   stream=stream, **kw)


def _both(whole, streamed):
    """Runs two requests at once (one batch in the engine), returns both results."""
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(whole), pool.submit(lambda: list(streamed()))
        return a.result(), b.result()


def _streamed_text(chunks) -> tuple[str, str | None]:
    text, reason = "", None
    for chunk in chunks:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


def test_json_schema_response_format_streams_the_same_text(server):  # noqa: F811
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    kw = dict(response_format=fmt, temperature=0, max_tokens=60)
    whole, chunks = _both(lambda: _chat(server, **kw), lambda: _chat(server, True, **kw))
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert whole.choices[0].finish_reason == "stop"
    assert _streamed_text(chunks) == (text, "stop")


def test_json_object_response_format(server):  # noqa: F811
    r = _chat(server, response_format={"type": "json_object"}, temperature=0, max_tokens=24,
              messages=[{"role": "user", "content": "A JSON object, please."}])
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"


@pytest.mark.parametrize("extra", [{"guided_regex": DATE}, {"structured_outputs": {"regex": DATE}}])
def test_completions_regex_extras_stream_the_same_text(server, extra):  # noqa: F811
    client = server.client()
    kw = dict(model=MODEL, prompt="The date today is", max_tokens=20, temperature=0,
              extra_body=extra)
    whole, chunks = _both(lambda: client.completions.create(**kw),
                          lambda: client.completions.create(stream=True, **kw))
    text = whole.choices[0].text
    assert whole.choices[0].finish_reason == "stop" and len(text) == 10
    assert "".join(c.choices[0].text for c in chunks) == text


def test_guided_choice_on_chat(server):  # noqa: F811
    choices = ["sunny", "rainy", "snowy"]
    r = _chat(server, n=4, temperature=0.7, max_tokens=10, extra_body={"guided_choice": choices})
    assert all(c.message.content in choices for c in r.choices)


def _body(**kw) -> dict:
    return {"model": MODEL, "messages": ASK, "max_tokens": 5, **kw}


@pytest.mark.parametrize(("body", "param", "words"), [
    (_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "format": "bogus"}}}),
     "response_format", "bogus"),
    (_body(guided_regex="[a-"), "guided_regex", "unclosed character class"),
    (_body(structured_outputs={"json": {"$ref": "#/$defs/nope"}}, stream=True),
     "structured_outputs", "/$defs/nope"),
    (_body(guided_regex="a", guided_choice=["a"]), "guided_choice", "only one"),
    (_body(response_format={"type": "json_object"}, guided_json={"type": "object"}),
     "guided_json", "only one"),
    (_body(response_format={"type": "yaml"}), "response_format", "response_format"),
    (_body(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs",
     "at most one"),
    (_body(tools=[WEATHER], tool_choice="required", guided_regex="a"), "tool_choice",
     "cannot be combined"),
    (_body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice", "nope"),
    (_body(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}}}],
        tool_choice="required"), "tools", "/x"),
])
def test_bad_constraints_are_400_naming_the_field(server, body, param, words):  # noqa: F811
    err = assert_error(server.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == param
    assert words in err["message"]


def test_bad_constraint_on_completions_is_400(server):  # noqa: F811
    r = server.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                             "guided_json": {"type": "nonsense"}})
    assert assert_error(r, 400)["param"] == "guided_json"


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def _valid(name: str, args: dict) -> None:
    fn = {t["function"]["name"]: t["function"] for t in TOOLS}[name]
    jsonschema.validate(args, fn["parameters"])


@pytest.mark.parametrize("choice", ["required",
                                    {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_are_valid(server, choice):  # noqa: F811
    r = _chat(server, tools=TOOLS, tool_choice=choice, n=2, temperature=0.7, seed=3,
              max_tokens=40, parallel_tool_calls=False)
    done = [c for c in r.choices if c.finish_reason == "tool_calls"]
    assert done, r.choices
    for c in done:
        assert c.message.content is None and len(c.message.tool_calls) == 1
        for call in c.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            _valid(call.function.name, json.loads(call.function.arguments))
            assert choice == "required" or call.function.name == "get_time"


@pytest.mark.parametrize("ask", [ASK[0]["content"],
                                 "What time is it in Tokyo and what's the weather in Oslo?"])
def test_required_parallel_calls_end_by_themselves(server, ask):  # noqa: F811
    """`required` with the default `parallel_tool_calls`: the calls end well before max_tokens
    (a forced separator between calls once made SmolLM2 repeat one call until the limit, and
    the SDK's stream helper raised LengthFinishReasonError), whole and through that helper."""
    kw = dict(messages=[{"role": "user", "content": ask}], tools=TOOLS, tool_choice="required",
              temperature=0, max_tokens=250)
    whole = _chat(server, **kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert whole.usage.completion_tokens < 120
    assert choice.message.content is None and choice.message.tool_calls
    for name, args in _calls(choice.message):
        _valid(name, args)
    with server.client().chat.completions.stream(model=MODEL, **kw) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion()
    assert streamed.choices[0].finish_reason == "tool_calls"
    assert _calls(streamed.choices[0].message) == _calls(choice.message)


def test_named_call_is_one_call_with_parallel_calls_allowed(server):  # noqa: F811
    named = {"type": "function", "function": {"name": "get_time"}}
    r = _chat(server, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=250)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and r.usage.completion_tokens < 120
    [(name, args)] = _calls(choice.message)
    assert name == "get_time"
    _valid(name, args)


def test_streamed_tool_calls_reassemble_to_the_same_calls(server):  # noqa: F811
    kw = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
              temperature=0, max_tokens=40)
    whole, chunks = _both(lambda: _chat(server, **kw), lambda: _chat(server, True, **kw))
    assert whole.choices[0].finish_reason == "tool_calls"
    calls: dict[int, dict] = {}
    reason, fragments = None, 0
    for chunk in chunks:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            assert not choice.delta.content
            for d in choice.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
                fragments += bool(d.function.arguments)
    assert reason == "tool_calls"
    assert all(c["id"] for c in calls.values())
    assert fragments > 2  # forced calls stream their arguments as they are generated
    streamed = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    # the same text to the character, not only the same JSON value
    assert streamed == [(c.function.name, c.function.arguments)
                        for c in whole.choices[0].message.tool_calls]


def test_tool_result_round_trip(server):  # noqa: F811
    first = _chat(server, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=40,
                  parallel_tool_calls=False)
    message = first.choices[0].message
    call = message.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": call.function.name,
                                      "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    # tool_choice auto: SmolLM2 answers in text here; whatever it does must be well-formed
    final = _chat(server, messages=messages, tools=TOOLS, temperature=0, max_tokens=16)
    choice = final.choices[0]
    if choice.finish_reason == "tool_calls":
        assert all(name in ("get_weather", "get_time") for name, _ in _calls(choice.message))
    else:
        assert choice.message.content and not choice.message.tool_calls
    tokens = server.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert tokens["count"] > 0


def test_constrained_stream_is_plain_sse(server):  # noqa: F811
    r = server.post("/v1/chat/completions", json=_body(stream=True, max_tokens=10,
                                                        guided_choice=["yes", "no"]))
    assert r.status_code == 200
    payloads = sse_payloads(r.text)
    text = "".join(p["choices"][0]["delta"].get("content") or ""
                   for p in payloads[:-1] if p["choices"])
    assert text in ("yes", "no")
