"""The per-family tool-call formats (jengine/text/tool_parsers.py, call_formats.py): Llama 3's
JSON calls read whole and streamed (every cut of the text gives the same calls), Hermes unchanged
behind the same entry points; mistral, pythonic, qwen3_coder and deepseek_v3 on example outputs,
whole and streamed at every split point; `auto` on chat-template text."""

from __future__ import annotations

import dataclasses
import json

import pytest

from jengine.outputs import CompletionOutput
from jengine.text.tool_parsers import (
    parse_calls,
    resolve_tool_parser,
    split_calls,
    tool_stream,
)
from jengine.text.tools import CallArguments, CallStart

# (output, expected calls as (name, arguments: a dict, or the raw text when it is not JSON),
# expected content). A call is taken once its head (`{"name": N, "parameters": `) is complete and
# its arguments begin; what follows cannot take it back (free_stream.py's rule).
LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
     [("get_weather", {"city": "Paris"})], None),
    ('<|python_tag|>{"name": "f", "arguments": {"x": [1, 2]}}', [("f", {"x": [1, 2]})], None),
    ('\n{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": "};{"}}\n',
     [("a", {}), ("b", {"y": "};{"})], None),
    ('{ "name" : "a" ,\n "parameters":{"k": "\\"}"}}', [("a", {"k": '"}'})], None),
    # arguments as a JSON string: no head to stream, read whole at the end as before
    ('{"name": "a", "parameters": "{\\"k\\": 1}"}', [("a", {"k": 1})], None),
    ("The weather is fine.", [], "The weather is fine."),
    ('{"answer": 42}', [], '{"answer": 42}'),  # JSON, but not a call
    ('{"name": "a", "parameters": {}} and more', [("a", {})], "and more"),
    ('{"name": "a", "parameters": {"b": ', [("a", '{"b": ')], None),  # cut off
    ('{"name": "a", "parameters": {}};', [("a", {})], None),
    ('{"name": "a", "parameters": {}}; {"name": "b", "par', [("a", {})],
     '{"name": "b", "par'),  # the second call cut off before its head was complete
    ('{"name": "a", "para', [], '{"name": "a", "para'),
]


def _args(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


@pytest.mark.parametrize(("text", "calls", "content"), LLAMA3)
def test_llama3_json_whole(text, calls, content):
    got_content, got = parse_calls("llama3_json", text)
    assert [(c.name, _args(c.arguments)) for c in got] == calls
    assert got_content == content


@pytest.mark.parametrize(("text", "calls", "content"), LLAMA3)
def test_llama3_json_streamed_at_every_cut(text, calls, content):
    whole = [c.arguments for c in parse_calls("llama3_json", text)[1]]
    for cut in range(len(text) + 1):
        stream = tool_stream("llama3_json")
        pieces = stream.feed(text[:cut]) + stream.feed(text[cut:]) + stream.finish()
        starts = [p for p in pieces if isinstance(p, CallStart)]
        args: dict[int, str] = {}
        for p in pieces:
            if isinstance(p, CallArguments):
                args[p.index] = args.get(p.index, "") + p.text
        assert [(s.name, _args(args[s.index])) for s in starts] == calls
        assert [args[i] for i in sorted(args)] == whole
        assert [s.index for s in starts] == list(range(len(calls)))
        assert "".join(p for p in pieces if isinstance(p, str)) == (content or "")
        assert stream.num_calls == len(calls)


def test_llama3_json_content_is_not_held():
    stream = tool_stream("llama3_json")
    assert stream.feed("  ") == []  # may still open a call
    assert stream.feed("Hello") == ["  Hello"]
    assert stream.feed(" there") == [" there"]


def test_forced_calls_are_read_in_the_parsers_format():
    """Calls forced by tool_choice are written in the parser's format (forced_calls.py) and read
    by that parser; hermes' form means nothing to llama3_json, forced or not."""
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    for name in ("hermes", None):
        assert [c.name for c in parse_calls(name, text)[1]] == ["f"]
    assert parse_calls("llama3_json", text, forced=True) == (None, [])
    assert parse_calls("llama3_json", text)[1] == []
    out = CompletionOutput(0, '{"name": "f", "parameters": {}}', [], finish_reason="stop")
    split_calls(out, "llama3_json")
    assert (out.text, out.finish_reason, out.tool_calls[0].name) == ("", "tool_calls", "f")
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        parse_calls("nope", text)


# -- mistral, pythonic, qwen3_coder, deepseek_v3 (and hermes through the same checks) -----------

NESTED = {"filter": {"tags": ["a", "b"], "range": {"lo": 1, "hi": 2.5}}, "q": "Zürich ☃ \"x\"; }"}

# parser -> (output, expected content, expected [(name, arguments)])
CASES = {
    "hermes": [
        ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', None, [("f", {"a": 1})]),
        ('Sure.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
         '<tool_call>{"name": "g", "arguments": ' + json.dumps(NESTED, ensure_ascii=False)
         + "}</tool_call>", "Sure.", [("f", {}), ("g", NESTED)]),
        ('<tool_call>{"name": "f", "arguments": {"a": </tool_call>',
         '<tool_call>{"name": "f", "arguments": {"a": </tool_call>', []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', None, [("f", {"a": 1})]),
        ('[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": '
         + json.dumps(NESTED, ensure_ascii=False) + "}]", None, [("f", {}), ("g", NESTED)]),
        ('Checking.[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]'
         + json.dumps(NESTED, ensure_ascii=False), "Checking.", [("f", {"a": 1}), ("g", NESTED)]),
        ('[{"name": "f", "arguments": {"a": 1}}]', None, [("f", {"a": 1})]),  # marker skipped
        # cut off after the arguments: the call was taken (free_stream.py's rule)
        ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}', None, [("f", {"a": 1})]),
        ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g"', '{"name": "g"',
         [("f", {"a": 1})]),
        ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}] Done.', "Done.", [("f", {"a": 1})]),
        ('[TOOL_CALLS][{"arguments": {}, "name": "f"}]', None, [("f", {})]),  # read whole
        ('[TOOL_CALLS][{"name": 3}]', '[TOOL_CALLS][{"name": 3}]', []),
    ],
    "pythonic": [
        ('[f(a=1)]', None, [("f", {"a": 1})]),
        ('[get_weather(city="Zürich ☃", days=[1, 2], opts={"deep": {"x": None}}), now()]', None,
         [("get_weather", {"city": "Zürich ☃", "days": [1, 2], "opts": {"deep": {"x": None}}}),
          ("now", {})]),
        ("<|python_start|>[ns.f(flag=true)]<|python_end|>", None, [("ns.f", {"flag": True})]),
        ("[f(a=1), __import__('os').system('x')]", "[f(a=1), __import__('os').system('x')]", []),
        ("[f(a=open('x'))]", "[f(a=open('x'))]", []),
        ("[f(a=1)", "[f(a=1)", []),
        ("[1] is a citation.", "[1] is a citation.", []),
    ],
    "qwen3_coder": [
        ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
         None, [("f", {"a": 1})]),
        ("I will call two.\n<tool_call>\n<function=f>\n<parameter=city>\nZürich ☃\n</parameter>\n"
         "</function>\n</tool_call>\n<tool_call>\n<function=g>\n<parameter=filter>\n"
         + json.dumps(NESTED["filter"]) + "\n</parameter>\n</function>\n</tool_call>",
         "I will call two.", [("f", {"city": "Zürich ☃"}), ("g", {"filter": NESTED["filter"]})]),
        ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>",
         "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>", []),
    ],
    "deepseek_v3": [
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n"
         '{"a": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None, [("f", {"a": 1})]),
        ("Two calls.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
         "<｜tool▁call▁begin｜>g<｜tool▁sep｜>" + json.dumps(NESTED, ensure_ascii=False)
         + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Two calls.", [("f", {}), ("g", NESTED)]),
        # malformed arguments after the head: the call stays, its arguments end at the marker
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": <｜tool▁call▁end｜>"
         "<｜tool▁calls▁end｜>", None, [("f", '{"a": ')]),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": 1}<｜tool▁call▁end｜>"
         "<｜tool▁calls▁end｜> Then text.", "Then text.", [("f", {"a": 1})]),
        # cut off inside what might have become the end marker: all of it is arguments
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": \"<｜too", None,
         [("f", '{"a": "<｜too')]),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>[1]<｜tool▁call▁end｜>",
         "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>[1]<｜tool▁call▁end｜>", []),
    ],
}
ALL = [(name, *case) for name, cases in CASES.items() for case in cases]


@pytest.mark.parametrize("parser,text,content,calls", ALL)
def test_whole_output(parser, text, content, calls):
    got_content, got = parse_calls(parser, text)
    assert got_content == content
    assert [(c.name, _args(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got)
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("parser,text,content,calls", ALL)
def test_streamed_at_every_split_point(parser, text, content, calls):
    whole = [c.arguments for c in parse_calls(parser, text)[1]]
    splits = [(i,) for i in range(len(text) + 1)] + [tuple(range(1, len(text)))]
    for cuts in splits:  # one cut at each point, and one character at a time
        stream, pieces, last = tool_stream(parser), [], 0
        for cut in (*cuts, len(text)):
            pieces += stream.feed(text[last:cut])
            last = cut
        pieces += stream.finish()
        starts = [p for p in pieces if isinstance(p, CallStart)]
        assert [(s.index, s.name) for s in starts] == [(i, c[0]) for i, c in enumerate(calls)]
        args: dict[int, str] = {}
        for p in pieces:
            if isinstance(p, CallArguments):
                args[p.index] = args.get(p.index, "") + p.text
        assert [args[i] for i in sorted(args)] == whole, cuts
        streamed = "".join(p for p in pieces if isinstance(p, str))
        if parser == "hermes":  # hermes drops the whitespace between calls as it streams
            streamed, content = streamed.replace("\n", ""), (content or "").replace("\n", "")
        assert streamed.strip() == (content or ""), cuts
        assert stream.num_calls == len(calls)


LLAMA31 = ("{%- if builtin_tools is defined %}{{- '<|python_tag|>' + tool_call.name }}{%- endif %}"
           "<|start_header_id|>assistant<|end_header_id|>")
LLAMA32 = ('Respond in the format {"name": function name, "parameters": dictionary of argument '
           "name and its value}.<|eot_id|>")
TEMPLATES = {
    "hermes": "{%- if tools %}<tools>{{ tools }}</tools> ... <tool_call>\n{{ call }}\n</tool_call>",
    "qwen3_coder": "<tool_call>\n<function={{ tool_call.name }}>\n<parameter={{ k }}>\n",
    "llama3_json": LLAMA31,
    "mistral": "{%- if message.tool_calls %}{{ '[TOOL_CALLS]' }}{{ message.tool_calls|tojson }}",
    "pythonic": "{{- '<|python_start|>[' }}{{ tool_call.name }}(...){{ ']<|python_end|>' }}",
    "deepseek_v3": "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + t['type']}}",
}


@pytest.mark.parametrize("expected,template", [*TEMPLATES.items(), ("llama3_json", LLAMA32),
                                               ("hermes", "{{ message['content'] }}"),
                                               ("hermes", None),
                                               ("pythonic", {"default": "x", "tool_use":
                                                             TEMPLATES["pythonic"]})])
def test_auto_reads_the_chat_template(expected, template):
    assert resolve_tool_parser("auto", template) == expected


def test_a_named_parser_is_used_as_given():
    assert resolve_tool_parser("mistral", TEMPLATES["hermes"]) == "mistral"
    assert resolve_tool_parser(None, TEMPLATES["mistral"]) is None  # no flag: hermes
    with pytest.raises(ValueError, match="chosen from a chat template first"):
        parse_calls("auto", "x")


FREE_STREAMED = {
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Zürich", "days": [1, 2]}}',
    "mistral": 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": '
               '{"city": "Zürich", "days": [1, 2]}}]',
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                   '```json\n{"city": "Zürich", "days": [1, 2]}\n```<｜tool▁call▁end｜>'
                   "<｜tool▁calls▁end｜>",
}


@pytest.mark.parametrize("parser", FREE_STREAMED)
def test_free_json_calls_stream_as_generated(parser):
    """Fed a character at a time, a free call's name goes out as soon as its head is complete
    and its arguments while they are still being generated, not whole at the end."""
    text = FREE_STREAMED[parser]
    stream, seen = tool_stream(parser), []
    for i, ch in enumerate(text):
        seen += [(i, p) for p in stream.feed(ch)]
    seen += [(len(text), p) for p in stream.finish()]
    start = next(i for i, p in seen if isinstance(p, CallStart))
    args = [(i, p.text) for i, p in seen if isinstance(p, CallArguments)]
    assert start == text.index("{", text.index("get_weather"))  # the `{` that opens the args
    assert len(args) > 10 and args[0][0] == start
    assert args[-1][0] == text.index("]}") + 1  # the last fragment: the arguments' own `}`
    assert "".join(t for _, t in args) == '{"city": "Zürich", "days": [1, 2]}'
    assert parse_calls(parser, text)[1][0].arguments == '{"city": "Zürich", "days": [1, 2]}'


def test_tools_keep_the_formats_special_markers():
    """With tools on under mistral / deepseek_v3, the request's params keep the format's
    special-token markers in the text (the parser needs them); not for hermes, not with tools
    off, and not where the client already keeps every special token."""
    from jengine.sampling_params import SamplingParams
    from jengine.text.tools import SPECIAL_MARKERS, constrain, tool_setup

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for fmt in ("mistral", "deepseek_v3"):
        for choice in ("auto", "required"):
            setup = dataclasses.replace(tool_setup(tools, choice), fmt=fmt)
            params = constrain(SamplingParams(), setup)
            assert params.keep_special_tokens == SPECIAL_MARKERS[fmt]
        off = dataclasses.replace(tool_setup(tools, "none"), fmt=fmt)
        assert constrain(SamplingParams(), off).keep_special_tokens == ()
        raw = constrain(SamplingParams(skip_special_tokens=False),
                        dataclasses.replace(tool_setup(tools), fmt=fmt))
        assert raw.keep_special_tokens == ()
    assert constrain(SamplingParams(), tool_setup(tools)).keep_special_tokens == ()
    with pytest.raises(ValueError, match="keep_special_tokens"):
        SamplingParams(keep_special_tokens=[""])
