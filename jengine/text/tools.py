"""Tool calling: tools into the prompt, calls out of the generated text.

Every call is written `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (DESIGN.md's form
for chat templates without a tool format, which is also Hermes' and Qwen's). What `tool_choice`
does:

    none       tools are left out of the prompt and nothing is parsed
    auto       tools go into the prompt; calls are parsed from the output, the rest is content
    required   the output is constrained (a grammar, in the `fmt` call format: forced_calls.py)
               to one or more calls, each call's arguments validating against one of the
               tools; one call unless parallel calls.
               Parallel calls follow each other with nothing between them, so after every
               `</tool_call>` the model chooses between EOS and another call: a separator the
               grammar forced ("\n") left it no way to end, and SmolLM2 repeated the same call
               until max_tokens
    {"type": "function", "function": {"name": N}}   constrained to one call of N

A template that mentions `tools` gets them through `apply_chat_template(tools=...)`; any other
gets a system-prompt paragraph describing them, and the assistant's earlier calls and the
`role: tool` results are rendered as text in the same `<tool_call>` / `<tool_response>` form.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from jengine.outputs import ToolCall, new_call_id
from jengine.sampling_params import SamplingParams, StructuredOutputs
from jengine.text.forced_calls import forced_grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


@dataclasses.dataclass(frozen=True)
class ToolSetup:
    """A chat request's tools after validation: what to render, constrain and parse."""

    functions: list[dict[str, Any]]  # OpenAI `function` objects; [] when tools are off
    choice: str  # none | auto | required | named
    name: str | None = None  # the named function
    parallel: bool = True
    fmt: str | None = None  # the call format forced calls are written in (None: hermes)

    @property
    def active(self) -> bool:
        return bool(self.functions) and self.choice != "none"

    def constraint(self) -> StructuredOutputs | None:
        """The output grammar for `required` / named; None when the model chooses freely."""
        if self.choice not in ("required", "named"):
            return None
        chosen = [f for f in self.functions if self.choice == "required" or f["name"] == self.name]
        repeat = self.parallel and self.choice == "required"
        lark = forced_grammar(self.fmt, chosen, repeat)
        return StructuredOutputs(grammar=lark)


def tool_setup(tools: list[dict] | None, tool_choice: Any = None,
               parallel: bool | None = None) -> ToolSetup:
    """Validates OpenAI `tools` and `tool_choice`. Raises ValueError naming the problem."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return ToolSetup([], "none")
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list of function tools")
    functions = [_function(i, tool) for i, tool in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be unique")
    parallel = True if parallel is None else parallel
    if tool_choice in (None, "auto", "none", "required"):
        return ToolSetup(functions, tool_choice or "auto", parallel=parallel)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        return ToolSetup(functions, "named", name=name, parallel=parallel)
    raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                     "{'type': 'function', 'function': {'name': ...}}")


def _function(i: int, tool: Any) -> dict[str, Any]:
    if not (isinstance(tool, dict) and tool.get("type") == "function"
            and isinstance(tool.get("function"), dict)):
        raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    return fn


# -- the prompt ------------------------------------------------------------------------------------

def template_has_tools(tokenizer: Any, chat_template: str | None = None) -> bool:
    """Whether the chat template (`chat_template`, else the tokenizer's) renders `tools`."""
    return "tools" in (chat_template or getattr(tokenizer, "chat_template", None) or "")


def tools_prompt(functions: list[dict[str, Any]]) -> str:
    """The system-prompt paragraph describing the tools to a template without a tool format."""
    lines = ["You can call functions. Each one, with the JSON schema of its arguments:"]
    for fn in functions:
        entry = {"name": fn["name"], "description": fn.get("description", ""),
                 "parameters": fn.get("parameters") or {"type": "object"}}
        lines.append(json.dumps(entry, ensure_ascii=False))
    lines += ["To call a function, reply with one line per call, exactly like this:",
              f'{OPEN}{{"name": "<function name>", "arguments": {{<the arguments>}}}}{CLOSE}',
              "If no function is needed, reply normally."]
    return "\n".join(lines)


def text_messages(messages: list[dict], functions: list[dict[str, Any]]) -> list[dict]:
    """Messages for a template without a tool format: tools described in the system message,
    earlier calls and tool results written out as text."""
    out = []
    names = {}  # tool_call_id -> function name, for the results
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            blocks = []
            for call in m.pop("tool_calls"):
                fn = call.get("function") or {}
                names[call.get("id")] = fn.get("name")
                blocks.append(OPEN + json.dumps({"name": fn.get("name"),
                                                 "arguments": _arguments(fn.get("arguments"))},
                                                ensure_ascii=False) + CLOSE)
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
        elif m.get("role") == "tool":
            name = names.get(m.get("tool_call_id")) or m.get("name")
            head = f'{{"name": {json.dumps(name)}}}\n' if name else ""
            m = {"role": "user",
                 "content": f"<tool_response>\n{head}{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if functions:
        prompt = tools_prompt(functions)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages for a template with a tool format: call arguments as objects, as HF templates
    expect them (OpenAI sends them as JSON text)."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = [{**c, "function": {**(c.get("function") or {}),
                                        "arguments": _arguments((c.get("function") or {})
                                                                .get("arguments"))}}
                     for c in m["tool_calls"]]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments if arguments is not None else {}


# -- the output ------------------------------------------------------------------------------------

def parse_call(body: str) -> ToolCall | None:
    """The call inside one `<tool_call>` block, or None when it is not a well-formed call."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return ToolCall(id=new_call_id(), name=data["name"],
                    arguments=json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, *, forced: bool = False) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output: the text outside the well-formed call blocks
    (None when nothing but calls and whitespace is left), and the calls in order.

    `forced` (the grammar wrote nothing but calls): a last block cut off by max_tokens is
    dropped, not left in the content."""
    if forced:
        start = text.rfind(OPEN)
        if start >= 0 and text.find(CLOSE, start) < 0:
            text = text[:start]
    calls, rest, pos = [], [], 0
    for m in _BLOCK.finditer(text):
        call = parse_call(m.group(1))
        if call is None:
            continue
        rest.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    if not calls:
        return text, []
    rest.append(text[pos:])
    content = "".join(rest).strip()
    return content or None, calls


@dataclasses.dataclass(frozen=True)
class CallStart:
    """A streamed tool call begins: its position among the output's calls, id and name."""

    index: int
    id: str
    name: str


@dataclasses.dataclass(frozen=True)
class CallArguments:
    """A fragment of the arguments (JSON text) of streamed call `index`."""

    index: int
    text: str


# The head of a call as the required / named grammar writes it: name first, then arguments.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.\-]{1,64})"\s*,\s*"arguments"\s*:\s*')


class ToolCallStream:
    """Splits streamed text into content pieces and tool-call events, in order.

    Text is held back while it could be the start of `<tool_call>`. A call goes out as a
    `CallStart` and `CallArguments`: with `incremental` (for grammar-forced calls, which are
    always well-formed and name the function first) the arguments go out in fragments as they
    are generated, held back only from the last `}` on (it may close the call); otherwise the
    block is held until its `</tool_call>` and goes out whole if it parses (as text if not).
    Whitespace is held until something other than a call follows it, so the newlines around
    calls never become content.
    """

    def __init__(self, incremental: bool = False) -> None:
        self.incremental = incremental
        self.num_calls = 0
        self._buf = ""  # from `<tool_call>` on while in a call
        self._space = ""  # trailing whitespace not yet emitted
        self._in_call = False
        self._sent = 0  # in an incremental call: where in `_buf` the unsent arguments start
        self._args_begun = False  # ... and whether any of them went out yet

    def feed(self, text: str) -> list[str | CallStart | CallArguments]:
        self._buf += text
        out: list[str | CallStart | CallArguments] = []
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE)
                if end < 0:
                    if self.incremental:
                        self._stream_arguments(out)
                    return out
                self._close(end, out)
                continue
            start = self._buf.find(OPEN)
            if start < 0:
                keep = _partial_prefix(self._buf, OPEN)
                self._text(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            self._text(self._buf[:start], out)
            self._buf = self._buf[start:]
            self._in_call, self._sent = True, 0

    def finish(self) -> list[str | CallStart | CallArguments]:
        """Whatever is left, as text (an unterminated block stays text, except under a forcing
        `tool_choice`: `incremental` output holds only calls, so a cut-off one is dropped)."""
        out: list[str | CallStart | CallArguments] = []
        if not self._sent and not (self.incremental and self._in_call):
            self._text(self._buf, out)
        self._buf, self._in_call, self._sent = "", False, 0
        if self._space and not self.num_calls:
            out.append(self._space)
        self._space = ""
        return out

    def _stream_arguments(self, out: list) -> None:
        if not self._sent:
            head = _HEAD.match(self._buf, len(OPEN))
            if head is None:
                return
            out.append(CallStart(self.num_calls, new_call_id(), head.group(1)))
            self.num_calls += 1
            self._space, self._sent = "", head.end()
            self._args_begun = False
        if not self._args_begun:  # whitespace before the arguments' `{` is not theirs
            self._sent = _skip_space(self._buf, self._sent)
        stop = self._buf.rfind("}", self._sent)
        stop = len(self._buf) if stop < 0 else stop
        if stop > self._sent:
            out.append(CallArguments(self.num_calls - 1, self._buf[self._sent:stop]))
            self._sent, self._args_begun = stop, True

    def _close(self, end: int, out: list) -> None:
        block, self._buf = self._buf[: end + len(CLOSE)], self._buf[end + len(CLOSE):]
        self._in_call, sent, self._sent = False, self._sent, 0
        body = block[len(OPEN): end]
        if sent:  # the rest of the arguments: up to the `}` that closes the call
            if not self._args_begun:
                sent = _skip_space(block, sent)
            rest = block[sent: len(OPEN) + len(body.rstrip()) - 1]
            if rest:
                out.append(CallArguments(self.num_calls - 1, rest))
            return
        call = parse_call(body)
        if call is None:
            self._text(block, out)
            return
        self._space = ""
        out += [CallStart(self.num_calls, call.id, call.name),
                CallArguments(self.num_calls, call.arguments)]
        self.num_calls += 1

    def _text(self, text: str, out: list) -> None:
        if not text:
            return
        stripped = text.rstrip()
        if stripped:
            out.append(self._space + stripped)
            self._space = ""
        self._space += text[len(stripped):]


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _partial_prefix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


# -- glue for Engine.chat and the server ----------------------------------------------------------

# format -> its call markers that tokenizers make special tokens, which skip_special_tokens would
# strip before the parser sees them (vLLM's Mistral parser turns skip_special_tokens off for the
# request instead, which lets every other special token into the content too). Hermes'
# `<tool_call>` and the markers that llama3_json / pythonic may do without are not listed.
SPECIAL_MARKERS = {
    "mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
    "deepseek_v3": ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"),
}


def constrain(params: SamplingParams, setup: ToolSetup) -> SamplingParams:
    """`params` with the tool-call grammar of `required` / named, and the format's special-token
    markers kept in the text whenever tools are on (unchanged otherwise)."""
    markers = SPECIAL_MARKERS.get(setup.fmt or "", ()) if setup.active else ()
    if markers and params.skip_special_tokens:
        params = dataclasses.replace(params, keep_special_tokens=(
            *(params.keep_special_tokens or ()), *markers))
    constraint = setup.constraint()
    if constraint is None:
        return params
    if params.structured_outputs is not None:
        raise ValueError("tool_choice required or a named function constrains the output; it "
                         "cannot be combined with another structured output constraint")
    return dataclasses.replace(params, structured_outputs=constraint)
