"""Tool-call formats per model family (`--tool-call-parser`, vLLM's names), beside the Hermes
`<tool_call>` format of tools.py:

    hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks amid text
                 (Hermes, Qwen 2.5 / 3, and jengine's own form for templates without tools)
    llama3_json  Llama 3.1+ with its template's JSON tool prompt: the whole output is one or
                 more `{"name": ..., "parameters": {...}}` objects ("arguments" too), separated
                 by `;`, optionally after `<|python_tag|>`; an output that is not wholly calls
                 is content as generated (vLLM's reading)
    mistral, pythonic, qwen3_coder, deepseek_v3   in call_formats.py

`auto` (`resolve_tool_parser`) reads the chat template's text by `AUTO_RULES`, hermes when no
rule matches.

A parser reads the model's free choice (`tool_choice: auto`). Calls forced by `tool_choice`
required / named are written by a grammar in the parser's own format (forced_calls.py) and read
back by the same parser; forced output is nothing but calls, so text that does not parse (a call
cut off by max_tokens) is dropped. `tool_stream` and `parse_calls` give the streamed and whole
readings of a format. Free calls of the JSON-argument formats (llama3_json, mistral,
deepseek_v3) stream their arguments as generated (free_stream.py, whose stream is also their
whole reading, so the two agree); pythonic and qwen3_coder hold their output from the call
syntax's first marker on and send the calls whole at the end (call_formats.HeldCallStream).
Forced calls of hermes and the JSON-argument formats (forced_stream.py) stream their arguments
as generated; forced pythonic and qwen3_coder calls go out whole at the end.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from jengine.outputs import CompletionOutput, ToolCall, new_call_id
from jengine.text.call_formats import (
    DS_BEGIN,
    TOOL_CALLS,
    HeldCallStream,
    parse_deepseek_v3,
    parse_mistral,
    parse_pythonic,
    parse_qwen3_coder,
)
from jengine.text.forced_stream import FORCED_HEADS, ForcedJsonStream, read_forced_json
from jengine.text.free_stream import FORMATS as FREE_JSON
from jengine.text.free_stream import FreeJsonStream, read_stream
from jengine.text.tools import CallArguments, CallStart, ToolCallStream, parse_tool_calls

PYTHON_TAG = "<|python_tag|>"
# format -> (whole reading, streamed reading): the formats of call_formats.py
_HELD = {
    "mistral": (parse_mistral, lambda: HeldCallStream(parse_mistral, (TOOL_CALLS,), ("[{",))),
    "pythonic": (parse_pythonic, lambda: HeldCallStream(
        parse_pythonic, (), ("[", "<|python_start|>"))),
    "qwen3_coder": (parse_qwen3_coder,
                    lambda: HeldCallStream(parse_qwen3_coder, ("<tool_call>",))),
    "deepseek_v3": (parse_deepseek_v3, lambda: HeldCallStream(parse_deepseek_v3, (DS_BEGIN,))),
}
TOOL_FORMATS = ("hermes", "llama3_json", *_HELD)
TOOL_PARSERS = (*TOOL_FORMATS, "auto")  # what --tool-call-parser takes

# `auto`: (marker in the chat template's text, format); the first match wins, else hermes.
AUTO_RULES: tuple[tuple[str, str], ...] = (
    ("<function=", "qwen3_coder"),  # Qwen3-Coder writes <tool_call><function=...>
    ("<tool_call>", "hermes"),
    ("tool▁calls▁begin", "deepseek_v3"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_start|>", "pythonic"),  # Llama 4
    ("[func_name1(", "pythonic"),  # the pythonic templates' instructions (vLLM's examples)
    ("<|python_tag|>", "llama3_json"),  # Llama 3.1
    ('"parameters": ', "llama3_json"),  # Llama 3.2 asks for {"name": ..., "parameters": ...}
)


def check_tool_parser(name: str | None) -> None:
    if name is not None and name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(TOOL_PARSERS)}")


def resolve_tool_parser(name: str | None, chat_template: str | dict | None) -> str | None:
    """The format `name` means for a model with this chat template (`auto`: by `AUTO_RULES`;
    a tokenizer's dict of named templates is read whole); any other name as given."""
    check_tool_parser(name)
    if name != "auto":
        return name
    if isinstance(chat_template, dict):
        chat_template = "\n".join(str(t) for t in chat_template.values())
    for marker, fmt in AUTO_RULES:
        if marker in (chat_template or ""):
            return fmt
    return "hermes"


def _format(name: str | None) -> str:
    check_tool_parser(name)
    if name == "auto":
        raise ValueError("tool call parser 'auto' is chosen from a chat template first "
                         "(resolve_tool_parser)")
    return name or "hermes"


def parse_calls(name: str | None, text: str, *,
                forced: bool = False) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output in format `name` (None: hermes)."""
    fmt = _format(name)
    if fmt == "hermes":
        return parse_tool_calls(text, forced=forced)
    if forced and fmt in FORCED_HEADS:
        return None, read_forced_json(FORCED_HEADS[fmt], text)
    if not forced and fmt in FREE_JSON:  # the streamed reading, so the two agree
        return read_stream(FreeJsonStream(fmt, _whole_reader(fmt)), text)
    content, calls = _whole_reader(fmt)(text)
    return (None, calls) if forced else (content, calls)


def _whole_reader(fmt: str) -> Callable[[str], tuple[str | None, list[ToolCall]]]:
    return parse_llama3_calls if fmt == "llama3_json" else _HELD[fmt][0]


def tool_stream(name: str | None, incremental: bool = False) -> CallStream:
    """The streamed reader of format `name`; `incremental`: the calls are forced. Hermes' free
    calls go out whole once their block closes; the JSON-argument formats' free and forced calls
    and hermes' forced ones stream their arguments as generated; pythonic and qwen3_coder send
    theirs whole at the end."""
    fmt = _format(name)
    if fmt == "hermes":
        return ToolCallStream(incremental=incremental)
    if incremental and fmt in FORCED_HEADS:
        return ForcedJsonStream(FORCED_HEADS[fmt])
    if incremental:
        return ForcedCallStream(_whole_reader(fmt))
    if fmt in FREE_JSON:
        return FreeJsonStream(fmt, _whole_reader(fmt))
    return _HELD[fmt][1]()


def split_calls(output: CompletionOutput, name: str | None, *, forced: bool = False) -> None:
    """A finished output's calls in format `name` into `tool_calls`; one that ended normally with
    calls finishes with "tool_calls". `forced`: as in `tools.parse_tool_calls`."""
    content, calls = parse_calls(name, output.text, forced=forced)
    if forced and not calls:
        output.text = content or ""
    if not calls:
        return
    output.text, output.tool_calls = content or "", calls
    if output.finish_reason == "stop":
        output.finish_reason = "tool_calls"


# -- llama3_json ---------------------------------------------------------------------------------

def parse_llama3_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Llama 3's JSON calls: all of the output, or none of it (then the text is content)."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            data, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return text, []
        call = _llama3_call(data)
        if call is None:
            return text, []
        calls.append(call)
        pos = _after_separator(body, pos)
        if pos < 0:
            return text, []
    return None, calls


def _llama3_call(data: Any) -> ToolCall | None:
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("parameters", data.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict) or set(data) - {"name", "parameters", "arguments", "type"}:
        return None
    return ToolCall(id=new_call_id(), name=data["name"],
                    arguments=json.dumps(args, ensure_ascii=False))


def _after_separator(body: str, pos: int) -> int:
    """The position after the whitespace and one `;` that may follow a call (-1: other text)."""
    while pos < len(body) and body[pos].isspace():
        pos += 1
    if pos < len(body) and body[pos] == ";":
        pos += 1
        while pos < len(body) and body[pos].isspace():
            pos += 1
        return pos if pos < len(body) else -1  # a trailing `;` is not a call list
    return pos if pos == len(body) or body[pos] == "{" else -1


class ForcedCallStream:
    """Forced calls of a format without incremental streaming: the output (only calls) is held
    and read whole at its end; what does not parse (cut off by max_tokens) is dropped."""

    def __init__(self, parse: Callable[[str], tuple[str | None, list[ToolCall]]]) -> None:
        self.parse, self.num_calls, self._buf = parse, 0, ""

    def feed(self, text: str) -> list[str | CallStart | CallArguments]:
        self._buf += text
        return []

    def finish(self) -> list[str | CallStart | CallArguments]:
        _, calls = self.parse(self._buf)
        self._buf = ""
        out: list[str | CallStart | CallArguments] = []
        for call in calls:
            out += [CallStart(self.num_calls, call.id, call.name),
                    CallArguments(self.num_calls, call.arguments)]
            self.num_calls += 1
        return out


# The streamed readers: `feed(text)` and `finish()` give content pieces and call events.
CallStream = (ToolCallStream | HeldCallStream | FreeJsonStream | ForcedCallStream
              | ForcedJsonStream)
