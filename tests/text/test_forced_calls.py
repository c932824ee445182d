"""Calls forced by `tool_choice` in each call format (jengine/text/forced_calls.py): the grammar
(through llguidance over a byte-level tokenizer) accepts the format's calls with schema-valid
arguments and refuses invalid ones, and the format's own parser reads what it accepts back,
whole and streamed at every split point."""

from __future__ import annotations

import dataclasses
import json

import pytest
import transformers
from tiny_models import save_byte_tokenizer  # tests/tiny_models.py

from jengine.structured.llguidance_backend import LLGuidanceBackend
from jengine.text.tool_parsers import parse_calls, tool_stream
from jengine.text.tools import CallArguments, CallStart, tool_setup

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}
NOARGS = {"type": "function", "function": {"name": "noargs"}}
TOOLS = [WEATHER, NOARGS]
CALLS = [("get_weather", {"city": "Paris ☃", "days": 2}), ("noargs", {})]
DS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
      "<｜tool▁calls▁end｜>")

# format -> (the two calls of CALLS as the grammar writes them, the first with days "2")
WRITTEN = {
    "hermes": ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris ☃", '
               '"days": 2}}</tool_call><tool_call>{"name": "noargs", "arguments": {}}</tool_call>',
               '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris ☃", '
               '"days": "2"}}</tool_call>'),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris ☃", "days": 2}}; '
                    '{"name": "noargs", "parameters": {}}',
                    '{"name": "get_weather", "parameters": {"city": "Paris ☃", "days": "2"}}'),
    "mistral": ('[{"name": "get_weather", "arguments": {"city": "Paris ☃", "days": 2}}, '
                '{"name": "noargs", "arguments": {}}]',
                '[{"name": "get_weather", "arguments": {"city": "Paris ☃", "days": "2"}}]'),
    "deepseek_v3": (f'{DS[0]}{DS[1]}function{DS[2]}get_weather\n```json\n{{"city": "Paris ☃", '
                    f'"days": 2}}\n```{DS[3]}{DS[1]}function{DS[2]}noargs\n```json\n{{}}\n```'
                    f'{DS[3]}{DS[4]}',
                    f'{DS[0]}{DS[1]}function{DS[2]}get_weather\n```json\n{{"city": "Paris ☃", '
                    f'"days": "2"}}\n```{DS[3]}{DS[4]}'),
    "pythonic": ('[get_weather(city="Paris ☃", days=2), noargs()]',
                 '[get_weather(city="Paris ☃", days="2")]'),
    "qwen3_coder": ('<tool_call>\n<function=get_weather>\n<parameter=city>\n"Paris ☃"\n'
                    '</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>'
                    '<tool_call>\n<function=noargs>\n</function>\n</tool_call>',
                    '<tool_call>\n<function=get_weather>\n<parameter=city>\n"Paris ☃"\n'
                    '</parameter>\n<parameter=days>\n"2"\n</parameter>\n</function>\n'
                    '</tool_call>'),
}


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    path = tmp_path_factory.mktemp("bytes")
    save_byte_tokenizer(path, added=[], special=["<|endoftext|>"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return tokenizer, LLGuidanceBackend(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))


def _accepts(backend, fmt: str, choice, text: str, parallel: bool = True) -> bool:
    tokenizer, llg = backend
    setup = tool_setup(TOOLS, choice, parallel)
    matcher = llg.compile(dataclasses.replace(setup, fmt=fmt).constraint()).matcher()
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return all(matcher.accept(t) for t in ids) and matcher.accept(tokenizer.eos_token_id)


@pytest.mark.parametrize("fmt", sorted(WRITTEN))
def test_the_grammar_writes_what_the_parser_reads(backend, fmt):
    both, invalid = WRITTEN[fmt]
    assert _accepts(backend, fmt, "required", both)
    content, calls = parse_calls(fmt, both, forced=True)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    first = both[: both.index("noargs")]
    named = {"type": "function", "function": {"name": "noargs"}}
    assert not _accepts(backend, fmt, named, both)  # named: only that function
    assert not _accepts(backend, fmt, "required", both, parallel=False)
    assert not _accepts(backend, fmt, "required", invalid)  # "days" must be an integer
    assert not _accepts(backend, fmt, "required", first)  # a call cut off is not the end


@pytest.mark.parametrize("fmt", sorted(WRITTEN))
def test_forced_calls_stream_at_every_split_point(fmt):
    text = WRITTEN[fmt][0]
    whole = [c.arguments for c in parse_calls(fmt, text, forced=True)[1]]
    for cut in range(len(text) + 1):
        stream = tool_stream(fmt, incremental=True)
        pieces = stream.feed(text[:cut]) + stream.feed(text[cut:]) + stream.finish()
        assert not [p for p in pieces if isinstance(p, str)]
        assert [p.name for p in pieces if isinstance(p, CallStart)] == [c[0] for c in CALLS]
        args: dict[int, str] = {}
        for p in pieces:
            if isinstance(p, CallArguments):
                args[p.index] = args.get(p.index, "") + p.text
        assert [args[i] for i in sorted(args)] == whole, cut


@pytest.mark.parametrize("fmt", sorted(WRITTEN))
def test_a_forced_output_cut_off_holds_no_content(fmt):
    text = WRITTEN[fmt][0]
    cut = text[: len(text) // 3]
    content, calls = parse_calls(fmt, cut, forced=True)
    assert content in (None, "") and calls == []
    stream = tool_stream(fmt, incremental=True)
    assert [p for p in stream.feed(cut) + stream.finish() if isinstance(p, str)] == []


def test_pythonic_refuses_a_parameter_it_cannot_write():
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"not-an-identifier": {"type": "string"}}}}}
    setup = tool_setup([bad], "required")
    with pytest.raises(ValueError, match="pythonic call format cannot write parameter"):
        dataclasses.replace(setup, fmt="pythonic").constraint()


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "deepseek_v3"])
def test_forced_json_arguments_go_out_as_they_are_generated(fmt):
    text = WRITTEN[fmt][0]
    head = text[: text.index('"days"')]  # mid-way through the first call's arguments
    stream = tool_stream(fmt, incremental=True)
    pieces = stream.feed(head)
    assert [type(p) for p in pieces] == [CallStart, CallArguments]
    assert pieces[1].text.startswith('{"city": "Paris ☃"')
