"""Streaming free calls (`tool_choice: auto`) of the JSON-argument formats (llama3_json, mistral,
deepseek_v3) as they are generated, as hermes' and the forced calls' streams do.

Content goes out as `HeldCallStream` sends it until the format's call syntax may begin; from
there a call's head (the syntax up to its arguments' `{`, the name first) is matched as it
grows, and once complete the call goes out as a `CallStart`, its arguments as fragments of the
raw text while forced_stream's `JsonScanner` finds where their object closes.

The rule for a call that turns out malformed: a call is taken once its head is complete (as
vLLM's parsers stream it); its arguments are the text generated for them, whatever follows. So a
call cut off by max_tokens keeps the arguments it got (finish_reason `length` says so), and text
after the calls that does not continue the call syntax is content, sent at the end. An output
whose call syntax breaks before the first head is complete (arguments written as a string, keys
in another order) is held to its end and read whole by the format's parser, as before. The whole
reading of an output (`read_free_json`) is this stream run over all of it, so the streamed
fragments always join into the whole response's `arguments`.
"""

from __future__ import annotations

from collections.abc import Callable

from jengine.outputs import ToolCall, new_call_id
from jengine.text.call_formats import ARGS, DS_BEGIN, TOOL_CALLS, HeldCallStream, Piece
from jengine.text.forced_stream import JsonScanner, collect
from jengine.text.tools import CallArguments, CallStart, _partial_prefix

# The syntax is a token sequence: a literal string, WS (any whitespace), NAME (a function
# name, captured), PEEK (an arguments object begins here; not consumed), or a tuple of
# alternative sequences (the first that matches or may still match wins).
WS, NAME, PEEK = object(), object(), object()
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
PYTHON_TAG = "<|python_tag|>"
DS_CALL = "<｜tool▁call▁begin｜>"
DS_SEP, DS_CALL_END, DS_END = "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"


def _object_head(*keys: str) -> list:
    """`{"name": "N", "<key>": ` as a JSON object call writes it, whitespace anywhere."""
    return ["{", WS, '"name"', WS, ":", WS, '"', NAME, '"', WS, ",", WS,
            tuple([f'"{k}"'] for k in keys), WS, ":", WS, PEEK]


_LLAMA3 = _object_head("parameters", "arguments")
_MISTRAL_OBJ, _MISTRAL_NEW = _object_head("arguments"), [NAME, ARGS, WS, PEEK]
_DS_HEAD = [DS_CALL, (["function", DS_SEP, NAME, WS, "```json", WS], [NAME, DS_SEP]), PEEK]
_DS_TAIL = ([WS, "```", WS, DS_CALL_END], [WS, DS_CALL_END])
# format -> (leading strings, markers) as HeldCallStream takes them, and the syntax: `first`
# from the held text's start to the first arguments, `next` from one call's arguments' end to
# the next one's start, `end` from the last arguments' end to the end of the output; `stop`: a
# marker that ends a call's arguments even when their object never closed
FORMATS = {
    "llama3_json": dict(leading=("{", PYTHON_TAG), markers=(),
                        first=[WS, ([PYTHON_TAG, WS], []), *_LLAMA3],
                        next=[WS, "}", WS, ([";", WS], []), *_LLAMA3],
                        end=[WS, "}", WS, ([";"], []), WS]),
    "mistral": dict(leading=("[{",), markers=(TOOL_CALLS,),
                    first=[([TOOL_CALLS], []), WS, (["[", WS, *_MISTRAL_OBJ], _MISTRAL_NEW)],
                    next=([WS, "}", WS, ",", WS, *_MISTRAL_OBJ],
                          [WS, TOOL_CALLS, WS, *_MISTRAL_NEW]),
                    end=[([WS, "}", WS, (["]"], [","], [])], []), WS]),
    "deepseek_v3": dict(leading=(), markers=(DS_BEGIN,),
                        first=[DS_BEGIN, WS, *_DS_HEAD],
                        next=[_DS_TAIL, WS, *_DS_HEAD],
                        end=[([_DS_TAIL], []), WS, ([DS_END], []), WS],
                        stop=DS_CALL_END),
}


def match(tokens: list | tuple, buf: str, pos: int, final: bool) -> tuple[str, int, str | None]:
    """Matches `tokens` at `pos`: ("ok", end, name), ("partial", ...) when `buf` ends before the
    syntax is decided (never when `final`: the output ended), or ("fail", ...)."""
    if isinstance(tokens, tuple):  # alternatives on their own
        tokens = [tokens]
    return _match(list(tokens), 0, buf, pos, final, None)


def _match(tokens: list, i: int, buf: str, pos: int, final: bool,
           name: str | None) -> tuple[str, int, str | None]:
    while i < len(tokens):
        tok = tokens[i]
        if isinstance(tok, tuple):
            for alt in tok:
                got = _match([*alt, *tokens[i + 1:]], 0, buf, pos, final, name)
                if got[0] != "fail":
                    return got
            return "fail", pos, name
        if tok is WS:
            while pos < len(buf) and buf[pos].isspace():
                pos += 1
            if pos == len(buf) and not final:
                return "partial", pos, name
        elif tok is NAME:
            start = pos
            while pos < len(buf) and buf[pos] in _NAME_CHARS:
                pos += 1
            if pos == len(buf) and not final:
                return "partial", pos, name
            if not 0 < pos - start <= 64:
                return "fail", pos, name
            name = buf[start:pos]
        elif tok is PEEK:
            if pos == len(buf):
                return ("fail" if final else "partial"), pos, name
            if buf[pos] != "{":
                return "fail", pos, name
        elif buf.startswith(tok, pos):
            pos += len(tok)
        elif not final and tok.startswith(buf[pos:]):
            return "partial", pos, name
        else:
            return "fail", pos, name
        i += 1
    return "ok", pos, name


class FreeJsonStream(HeldCallStream):
    """`feed` / `finish` as the other call streams, for free calls of format `fmt`."""

    def __init__(self, fmt: str, parse: Callable[[str], tuple[str | None, list[ToolCall]]]
                 ) -> None:
        spec = FORMATS[fmt]
        super().__init__(parse, spec["markers"], spec["leading"])
        self.spec = spec
        self._phase = "first"  # first | args | after | fallback
        self._pos = 0  # in the held text: where matching resumes / unsent arguments start
        self._scanner = JsonScanner()

    def feed(self, text: str) -> list[Piece]:
        out = super().feed(text)
        if self._held:
            self._advance(out, final=False)
        return out

    def finish(self) -> list[Piece]:
        if not self._held or self._phase in ("first", "fallback"):
            return super().finish()  # no call taken: the whole reading decides, as before
        out: list[Piece] = []
        self._advance(out, final=True)
        if self._phase == "after":
            rest = self._buf[self._pos:]
            state, end, _ = match(self.spec["end"], rest, 0, True)
            extra = rest[end:] if state == "ok" else rest
            if extra.strip():
                out.append(extra.strip())
        self._buf, self._space, self._pos = "", "", 0
        return out

    def _advance(self, out: list[Piece], final: bool) -> None:
        while True:
            if self._phase in ("first", "after"):
                tokens = self.spec[self._phase if self._phase == "first" else "next"]
                state, end, name = match(tokens, self._buf, self._pos, final)
                if state != "ok":
                    if state == "fail" and self._phase == "first":
                        self._phase = "fallback"
                    return  # partial: wait; fail after a call: the rest is read at finish
                out.append(CallStart(self.num_calls, new_call_id(), name or ""))
                self.num_calls += 1
                self._phase, self._pos, self._scanner = "args", end, JsonScanner(end)
            if self._phase != "args":
                return
            end = self._scanner.scan(self._buf)
            stop = len(self._buf) if end < 0 else end
            marker = self.spec.get("stop")
            if marker:  # malformed arguments end at the call's end marker, not past it
                at = self._buf.find(marker, self._pos, stop)
                if at >= 0:
                    end = stop = at
                elif end < 0 and not final:  # it may be the marker's beginning
                    stop = max(self._pos, stop - _partial_prefix(self._buf, marker))
            if stop > self._pos:
                out.append(CallArguments(self.num_calls - 1, self._buf[self._pos:stop]))
            self._pos = stop
            if end < 0:
                return
            self._phase = "after"



def read_stream(stream: FreeJsonStream, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output as `stream` streams it, so the two readings agree."""
    content, names, args = collect(stream.feed(text) + stream.finish())
    calls = [ToolCall(id=cid, name=name, arguments=args.get(i, ""))
             for i, (cid, name) in sorted(names.items())]
    text_out = "".join(content).strip()
    return (text_out or None) if calls else "".join(content), calls
