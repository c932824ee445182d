"""The grammars that write calls forced by `tool_choice` required / named, one per call format
(`--tool-call-parser`), so the format's own parser reads them back:

    hermes       <tool_call>{"name": N, "arguments": {...}}</tool_call>, repeated
    llama3_json  {"name": N, "parameters": {...}}, repeated with "; " between
    mistral      [{"name": N, "arguments": {...}}, ...]: the list without `[TOOL_CALLS]`, which
                 is a special token in Mistral's tokenizers (a grammar would spell it with plain
                 tokens the model never wrote); parse_mistral reads the bare list
    deepseek_v3  <｜tool▁calls▁begin｜> then per call <｜tool▁call▁begin｜>function<｜tool▁sep｜>N
                 and a fenced json block <｜tool▁call▁end｜>, then <｜tool▁calls▁end｜>
    pythonic     [N(p=value, ...), ...]
    qwen3_coder  <tool_call>\n<function=N>\n<parameter=p>\nvalue\n</parameter>\n...
                 </function>\n</tool_call>, repeated

JSON arguments validate against the tool's schema. pythonic and qwen3_coder write one keyword /
`<parameter>` per property of the schema, every property (optional ones too), in the schema's
order, each value the JSON of that property's schema (a Python literal for pythonic, `true` /
`false` / `null` included, which its parser reads; JSON text inside `<parameter>`, which
qwen3_coder's parser reads as JSON, so strings come out quoted); a schema without `properties`
gets a call without arguments. Parallel calls follow each other with nothing forced between
them but a format's own separator, so the model can always end after a call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

# Constrained calls are written as models usually write JSON: `{"a": 1, "b": [2]}`.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _lit(text: str) -> str:
    """A Lark string literal of `text`."""
    return json.dumps(text, ensure_ascii=False)


def _json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


def _params(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object"}


def _call_schema(function: dict[str, Any], key: str = "arguments") -> dict[str, Any]:
    return {"type": "object",
            "properties": {"name": {"const": function["name"]}, key: _params(function)},
            "required": ["name", key], "additionalProperties": False}


def _one_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _hermes(functions: list[dict], repeat: bool) -> str:
    body = _json(_one_of([_call_schema(f) for f in functions]))
    return (f'start: call{"+" if repeat else ""}\n'
            f'call: "<tool_call>" body "</tool_call>"\nbody: {body}\n')


def _llama3_json(functions: list[dict], repeat: bool) -> str:
    call = _json(_one_of([_call_schema(f, "parameters") for f in functions]))
    more = ' ("; " call)*' if repeat else ""
    return f"start: call{more}\ncall: {call}\n"


def _mistral(functions: list[dict], repeat: bool) -> str:
    schema = {"type": "array", "items": _one_of([_call_schema(f) for f in functions]),
              "minItems": 1}
    if not repeat:
        schema["maxItems"] = 1
    return f"start: {_json(schema)}\n"


def _alternatives(functions: list[dict], repeat: bool, sep: str,
                  call: Callable[[int, dict], tuple[str, list[str]]]) -> tuple[str, list[str]]:
    """`calls` (one call, or calls with `sep` between) of per-function rules from `call`, which
    gives a rule's body and extra rules."""
    names, rules = [], []
    for i, fn in enumerate(functions):
        body, extra = call(i, fn)
        names.append(f"call{i}")
        rules += [f"call{i}: {body}", *extra]
    more = (f" ({_lit(sep)} one)*" if sep else "+") if repeat else ""
    return f"calls: one{more}", [f"one: {' | '.join(names)}", *rules]


def _properties(i: int, fn: dict, check: Callable[[str], None] | None = None
                ) -> list[tuple[str, str]]:
    """(property name, rule name) for each property of function `i`, in schema order."""
    props = _params(fn).get("properties") or {}
    out = []
    for j, name in enumerate(props):
        if check is not None:
            check(name)
        out.append((name, f"v{i}_{j}"))
    return out


def _value_rules(fn: dict, props: list[tuple[str, str]]) -> list[str]:
    schemas = _params(fn).get("properties") or {}
    return [f"{rule}: {_json(schemas[name] if isinstance(schemas[name], dict) else {})}"
            for name, rule in props]


def _deepseek_v3(functions: list[dict], repeat: bool) -> str:
    def call(i: int, fn: dict) -> tuple[str, list[str]]:
        head = f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{fn['name']}\n```json\n"
        return (f"{_lit(head)} args{i} {_lit(chr(10) + '```<｜tool▁call▁end｜>')}",
                [f"args{i}: {_json(_params(fn))}"])
    head, rules = _alternatives(functions, repeat, "", call)
    return "\n".join([f'start: {_lit("<｜tool▁calls▁begin｜>")} calls '
                      f'{_lit("<｜tool▁calls▁end｜>")}', head, *rules]) + "\n"


def _pythonic(functions: list[dict], repeat: bool) -> str:
    def identifier(name: str) -> None:
        if not _IDENT.fullmatch(name):
            raise ValueError(f"tool_choice: the pythonic call format cannot write parameter "
                             f"{name!r} (not a Python identifier)")

    def call(i: int, fn: dict) -> tuple[str, list[str]]:
        if not all(_IDENT.fullmatch(part) for part in fn["name"].split(".")):
            raise ValueError(f"tool_choice: the pythonic call format cannot write function "
                             f"{fn['name']!r} (not a Python name)")
        props = _properties(i, fn, identifier)
        parts = [f"{_lit((', ' if k else '') + name + '=')} {rule}"
                 for k, (name, rule) in enumerate(props)]
        return " ".join([_lit(fn["name"] + "("), *parts, _lit(")")]), _value_rules(fn, props)
    head, rules = _alternatives(functions, repeat, ", ", call)
    return "\n".join(['start: "[" calls "]"', head, *rules]) + "\n"


def _qwen3_coder(functions: list[dict], repeat: bool) -> str:
    def call(i: int, fn: dict) -> tuple[str, list[str]]:
        props = _properties(i, fn)
        parts = [f"{_lit(f'<parameter={name}>' + chr(10))} {rule} "
                 f"{_lit(chr(10) + '</parameter>' + chr(10))}" for name, rule in props]
        open_ = f"<tool_call>\n<function={fn['name']}>\n"
        return (" ".join([_lit(open_), *parts, _lit("</function>\n</tool_call>")]),
                _value_rules(fn, props))
    head, rules = _alternatives(functions, repeat, "", call)
    return "\n".join(["start: calls", head, *rules]) + "\n"


# format -> grammar of (the chosen functions, whether several calls may follow each other)
FORCED_GRAMMARS: dict[str, Callable[[list[dict], bool], str]] = {
    "hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral,
    "deepseek_v3": _deepseek_v3, "pythonic": _pythonic, "qwen3_coder": _qwen3_coder,
}


def forced_grammar(fmt: str | None, functions: list[dict], repeat: bool) -> str:
    """The Lark grammar (llguidance's, with `%json`) of forced calls in format `fmt`."""
    return FORCED_GRAMMARS[fmt or "hermes"](functions, repeat)
