"""The call formats beyond Hermes and Llama 3's JSON (tool_parsers.py has the table and those
two), each read whole into (content, calls), and `HeldCallStream`, their streamed reading:

    mistral      [TOOL_CALLS][{"name": N, "arguments": {...}}, ...]  or  [TOOL_CALLS]N[ARGS]{...}
    pythonic     [f(a=1, b="x"), g()]   (read with `ast`, never evaluated)
    qwen3_coder  <tool_call><function=N><parameter=p>value</parameter></function></tool_call>
    deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N
                 ```json {...} ```<｜tool▁call▁end｜>...   (V3.1: N<｜tool▁sep｜>{...})

A malformed call is never half-taken: the output (for qwen3_coder, the block) stays content.
A `HeldCallStream` holds the text from the start of the call syntax to the end of the output and
then sends the content and whole calls: a call list is only known complete once the output is.
mistral and deepseek_v3 stream through free_stream.py instead, which falls back to the whole
readings here for an output whose first call does not open name first.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from typing import Any

from jengine.outputs import ToolCall, new_call_id
from jengine.text.tools import CallArguments, CallStart, _partial_prefix

Piece = str | CallStart | CallArguments
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def _call(name: Any, args: Any) -> ToolCall | None:
    """An OpenAI call from a name and arguments (a dict, or JSON text of one), else None."""
    if not isinstance(name, str) or not _NAME.fullmatch(name.strip()):
        return None
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    args = {} if args is None else args
    if not isinstance(args, dict):
        return None
    return ToolCall(id=new_call_id(), name=name.strip(),
                    arguments=json.dumps(args, ensure_ascii=False))


def _json_values(text: str, sep: str | None = None) -> list[Any] | None:
    """The JSON values making up all of `text` (whitespace, and `sep` between values, allowed);
    None when anything else is there."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return values or None
        if values and sep:
            if not text.startswith(sep, pos):
                return None
            pos += len(sep)
            while pos < len(text) and text[pos].isspace():
                pos += 1
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        values.append(value)


def _content(*parts: str) -> str | None:
    return "".join(parts).strip() or None


# -- mistral --------------------------------------------------------------------------------------

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def parse_mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    """Mistral: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (older templates), or
    `name[ARGS]{...}` after each `[TOOL_CALLS]` (newer ones). With the marker dropped (it is a
    special token), an output that is only such a JSON list still counts."""
    start = text.find(TOOL_CALLS)
    if start < 0:
        if not text.lstrip().startswith("[{"):
            return text, []
        segments, before = [text], ""
    else:
        segments, before = text[start:].split(TOOL_CALLS)[1:], text[:start]
    calls: list[ToolCall | None] = []
    for segment in segments:
        segment = segment.strip()
        if segment.startswith("["):
            values = _json_values(segment)
            if not values or len(values) != 1 or not isinstance(values[0], list):
                return text, []
            calls += [_call(v.get("name"), v.get("arguments")) if isinstance(v, dict) else None
                      for v in values[0]]
            continue
        name, sep, args = segment.partition(ARGS)
        values = _json_values(args) if sep else None
        if not values or len(values) != 1:
            return text, []
        calls.append(_call(name.split(CALL_ID)[0], values[0]))
    if not calls or None in calls:
        return text, []
    return _content(before), calls


# -- pythonic -------------------------------------------------------------------------------------

_PY_MARKERS = ("<|python_start|>", "<|python_end|>")
_JSON_NAMES = {"true": True, "false": False, "null": None}


def parse_pythonic(text: str) -> tuple[str | None, list[ToolCall]]:
    """A Python list of calls with keyword arguments, `[f(a=1), g()]`, as Llama 3.2 / 4 write
    them; values are literals (read by `ast.literal_eval`, JSON's true/false/null too)."""
    body = text.strip()
    for marker in _PY_MARKERS:
        body = body.replace(marker, "")
    body = body.strip()
    if not (body.startswith("[") and body.endswith("]")):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = [_pythonic_call(node) for node in tree.elts]
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return text, []
    if None in calls:
        return text, []
    return None, calls


def _pythonic_call(node: ast.AST) -> ToolCall | None:
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _dotted(node.func)
    if name is None or any(k.arg is None for k in node.keywords):
        return None
    return _call(name, {k.arg: _literal(k.value) for k in node.keywords})


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


# -- qwen3_coder ----------------------------------------------------------------------------------

_XML_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def parse_qwen3_coder(text: str) -> tuple[str | None, list[ToolCall]]:
    """Qwen3-Coder's XML: one `<parameter=p>` per argument; a value that reads as JSON is taken
    as JSON (numbers, objects, true), any other as a string."""
    calls, rest, pos = [], [], 0
    for m in _XML_CALL.finditer(text):
        inner = _XML_PARAM.sub("", m.group(2))
        call = _call(m.group(1), {p.group(1).strip(): _xml_value(p.group(2))
                                  for p in _XML_PARAM.finditer(m.group(2))})
        if call is None or inner.strip():
            continue
        rest.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    if not calls:
        return text, []
    return _content(*rest, text[pos:]), calls


def _xml_value(raw: str) -> Any:
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


# -- deepseek_v3 ----------------------------------------------------------------------------------

DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.S)
_FENCE = re.compile(r"\s*```(?:json)?\s*(.*?)\s*```\s*", re.S)


def parse_deepseek_v3(text: str) -> tuple[str | None, list[ToolCall]]:
    """DeepSeek V3 (`function<｜tool▁sep｜>name` and a fenced JSON block) and V3.1
    (`name<｜tool▁sep｜>{json}`) calls inside `<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>`."""
    start = text.find(DS_BEGIN)
    if start < 0:
        return text, []
    end = text.find(DS_END, start)
    end = len(text) if end < 0 else end
    region = text[start + len(DS_BEGIN): end]
    calls: list[ToolCall | None] = []
    for m in _DS_CALL.finditer(region):
        head, body = m.group(1).strip(), m.group(2)
        if head == "function":
            name, _, body = body.partition("\n")
            fenced = _FENCE.fullmatch(body)
            calls.append(_call(name, fenced.group(1)) if fenced else None)
        else:
            calls.append(_call(head, body))
    if not calls or None in calls or _DS_CALL.sub("", region).strip():
        return text, []
    return _content(text[:start], text[end + len(DS_END):]), calls


# -- streaming the held formats -------------------------------------------------------------------

class HeldCallStream:
    """Streams content until a format's call syntax may have begun (a `marker` anywhere, or a
    `leading` string as the first non-space text), then holds the rest and parses it at
    `finish`: content goes out, then each call as a `CallStart` and its whole arguments."""

    def __init__(self, parse: Callable[..., tuple[str | None, list[ToolCall]]],
                 markers: tuple[str, ...], leading: tuple[str, ...] = ()) -> None:
        self.parse, self.markers, self.leading = parse, markers, leading
        self.num_calls = 0
        self._buf = ""
        self._held = False  # in the call syntax: everything is kept to the end
        self._started = False  # anything other than whitespace went out
        self._space = ""

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        if self._held:
            return out
        head = self._buf.lstrip()
        if not self._started and self.leading:
            if not head or any(lead.startswith(head) for lead in self.leading):
                return out  # too little to tell yet
            if any(head.startswith(lead) for lead in self.leading):
                self._held = True
                return out
        found = [i for i in (self._buf.find(m) for m in self.markers) if i >= 0]
        if found:
            self._text(self._buf[:min(found)], out)
            self._buf, self._held = self._buf[min(found):], True
            return out
        keep = max((_partial_prefix(self._buf, m) for m in self.markers), default=0)
        self._text(self._buf[: len(self._buf) - keep], out)
        self._buf = self._buf[len(self._buf) - keep:]
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        content, calls = self.parse(self._buf) if self._held else (self._buf, [])
        self._text(content or "", out)
        for call in calls:
            out += [CallStart(self.num_calls, call.id, call.name),
                    CallArguments(self.num_calls, call.arguments)]
            self.num_calls += 1
        if self._space and not self.num_calls:
            out.append(self._space)
        self._buf, self._space = "", ""
        return out

    def _text(self, text: str, out: list[Piece]) -> None:
        stripped = text.rstrip()
        if stripped:
            out.append(self._space + stripped)
            self._space, self._started = "", True
        self._space += text[len(stripped):]
