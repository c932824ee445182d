"""Streaming forced calls of the JSON-argument formats (llama3_json, mistral, deepseek_v3) as
they are generated: the grammar of forced_calls.py writes every call well-formed, name first,
so a call goes out as a `CallStart` once its head (the text up to the arguments) is complete,
and its arguments as fragments of the raw text while a small JSON scanner (strings and escapes
aware) tracks where the arguments' object closes. The whole reading of a forced output is this
stream run over the whole text, so streamed fragments always join into the whole `arguments`.
"""

from __future__ import annotations

import json
import re

from jengine.outputs import ToolCall, new_call_id
from jengine.text.tools import CallArguments, CallStart

_N = r"([A-Za-z0-9_.\-]{1,64})"
# format -> the head of one call as its forced grammar writes it, up to the arguments' `{`
FORCED_HEADS = {
    "llama3_json": re.compile(r'\{"name": "' + _N + r'", "parameters": '),
    "mistral": re.compile(r'\{"name": "' + _N + r'", "arguments": '),
    "deepseek_v3": re.compile("<｜tool▁call▁begin｜>function<｜tool▁sep｜>" + _N + "\n```json\n"),
}


class ForcedJsonStream:
    """`feed` / `finish` as the other call streams; calls only (forced output has no content).
    `complete` lists the calls whose arguments closed (a call cut off by max_tokens did not)."""

    def __init__(self, head: re.Pattern[str]) -> None:
        self.head = head
        self.num_calls = 0
        self.complete: list[int] = []
        self._buf = ""
        self._pos = 0  # where the next head is searched for, or the unsent arguments start
        self._in_args = False
        self._scanner = JsonScanner()

    def feed(self, text: str) -> list[CallStart | CallArguments]:
        self._buf += text
        out: list[CallStart | CallArguments] = []
        while True:
            if not self._in_args:
                m = self.head.search(self._buf, self._pos)
                if m is None:
                    return out
                out.append(CallStart(self.num_calls, new_call_id(),
                                     m.group(1)))
                self.num_calls += 1
                self._pos = m.end()
                self._in_args, self._scanner = True, JsonScanner(self._pos)
            end = self._scanner.scan(self._buf)
            stop = len(self._buf) if end < 0 else end
            if stop > self._pos:
                out.append(CallArguments(self.num_calls - 1, self._buf[self._pos:stop]))
            self._pos = stop
            if end < 0:
                return out
            self._in_args = False
            self.complete.append(self.num_calls - 1)

    def finish(self) -> list[CallStart | CallArguments]:
        self._buf, self._pos, self._in_args = "", 0, False
        return []


class JsonScanner:
    """Finds where a JSON value that starts at `start` (an object or array) closes, fed a
    growing buffer: strings and escapes aware, so a `}` inside a string does not close it. It
    does not validate; the caller reads the closed text as JSON if it needs to."""

    def __init__(self, start: int = 0) -> None:
        self._scan, self._depth, self._string, self._escape = start, 0, False, False

    def scan(self, buf: str) -> int:
        """Scans on; the position just after the value's closing bracket (-1: not closed yet)."""
        for i in range(self._scan, len(buf)):
            ch = buf[i]
            if self._string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._string = False
            elif ch == '"':
                self._string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._scan = i + 1
                    return i + 1
        self._scan = len(buf)
        return -1


def collect(pieces: list) -> tuple[list[str], dict[int, tuple[str, str]], dict[int, str]]:
    """A call stream's pieces gathered: (content texts, call index -> (id, name), call index ->
    its argument text joined), so a whole output is read as its stream sends it."""
    content: list[str] = []
    names: dict[int, tuple[str, str]] = {}
    args: dict[int, str] = {}
    for piece in pieces:
        if isinstance(piece, str):
            content.append(piece)
        elif isinstance(piece, CallStart):
            names[piece.index] = (piece.id, piece.name)
        else:
            args[piece.index] = args.get(piece.index, "") + piece.text
    return content, names, args


def read_forced_json(head: re.Pattern[str], text: str) -> list[ToolCall]:
    """The calls of a whole forced output, as `ForcedJsonStream` streams them (arguments the very
    text generated); a call cut off, or whose arguments are not a JSON object, is dropped."""
    stream = ForcedJsonStream(head)
    _, names, args = collect(stream.feed(text) + stream.finish())
    calls = []
    for i in stream.complete:
        try:
            ok = isinstance(json.loads(args[i]), dict)
        except (json.JSONDecodeError, KeyError):
            ok = False
        if ok:
            calls.append(ToolCall(id=names[i][0], name=names[i][1], arguments=args[i]))
    return calls
