"""The per-family tool-call formats (jengine/text/tool_parsers.py): Llama 3's JSON calls read
whole and streamed (every cut of the text gives the same calls), Hermes unchanged behind the same
entry points."""

from __future__ import annotations

import json

import pytest

from jengine.outputs import CompletionOutput
from jengine.text.tool_parsers import parse_calls, split_calls, tool_stream
from jengine.text.tools import CallArguments, CallStart

# (output, expected calls as (name, arguments), expected content when no calls)
LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
     [("get_weather", {"city": "Paris"})], None),
    ('<|python_tag|>{"name": "f", "arguments": {"x": [1, 2]}}', [("f", {"x": [1, 2]})], None),
    ('\n{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": "};{"}}\n',
     [("a", {}), ("b", {"y": "};{"})], None),
    ('{"name": "a", "parameters": "{\\"k\\": 1}"}', [("a", {"k": 1})], None),
    ("The weather is fine.", [], "The weather is fine."),
    ('{"answer": 42}', [], '{"answer": 42}'),  # JSON, but not a call
    ('{"name": "a", "parameters": {}} and more', [], '{"name": "a", "parameters": {}} and more'),
    ('{"name": "a", "parameters": {', [], '{"name": "a", "parameters": {'),  # cut off
    ('{"name": "a", "parameters": {}};', [], '{"name": "a", "parameters": {}};'),
]


@pytest.mark.parametrize(("text", "calls", "content"), LLAMA3)
def test_llama3_json_whole(text, calls, content):
    got_content, got = parse_calls("llama3_json", text)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert got_content == (None if calls else content)


@pytest.mark.parametrize(("text", "calls", "content"), LLAMA3)
def test_llama3_json_streamed_at_every_cut(text, calls, content):
    for cut in range(len(text) + 1):
        stream = tool_stream("llama3_json")
        pieces = stream.feed(text[:cut]) + stream.feed(text[cut:]) + stream.finish()
        starts = [p for p in pieces if isinstance(p, CallStart)]
        args = [p for p in pieces if isinstance(p, CallArguments)]
        assert [(s.name, json.loads(a.text)) for s, a in zip(starts, args)] == calls
        assert [s.index for s in starts] == list(range(len(calls))) == [a.index for a in args]
        assert "".join(p for p in pieces if isinstance(p, str)) == ("" if calls else content)
        assert stream.num_calls == len(calls)


def test_llama3_json_content_is_not_held():
    stream = tool_stream("llama3_json")
    assert stream.feed("  ") == []  # may still open a call
    assert stream.feed("Hello") == ["  Hello"]
    assert stream.feed(" there") == [" there"]


def test_forced_calls_and_hermes_keep_the_tool_call_form():
    """Calls forced by tool_choice are written by the Hermes grammar, whatever the parser."""
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    for name in ("hermes", None):
        assert [c.name for c in parse_calls(name, text)[1]] == ["f"]
    assert [c.name for c in parse_calls("llama3_json", text, forced=True)[1]] == ["f"]
    assert parse_calls("llama3_json", text)[1] == []
    out = CompletionOutput(0, '{"name": "f", "parameters": {}}', [], finish_reason="stop")
    split_calls(out, "llama3_json")
    assert (out.text, out.finish_reason, out.tool_calls[0].name) == ("", "tool_calls", "f")
    with pytest.raises(ValueError, match="unknown tool call parser 'mistral'"):
        parse_calls("mistral", text)
