"""Output constraints that apply after the reasoning, as vLLM applies them.

With a reasoning parser, a request's structured output (JSON schema, regex, choice, grammar, or
the tool-call grammar of `tool_choice` required / named) constrains the answer, not the
thinking before it. The constraint becomes one Lark grammar that llguidance runs as usual:

    start: reasoning? answer        (reasoning required when the format's block is opened by
                                     the template, deepseek_r1: the answer must follow `</think>`)
    reasoning: START THOUGHT_END /\\n{0,2}/   (the newlines models write after the block, at
                 most two: free whitespace there lets a sampled model pad until max_tokens)
    THOUGHT_END: text up to and with the first end marker (one lexeme, so that a thought cannot
                 stop inside a marker written as text)
    answer: the request's constraint, as a nested grammar (`%json`, `%lark`) or a regex

A marker that is one token of the vocabulary (Qwen3's `<think>`) is matched as that token or as
its text. A constraint that writes the block itself (its text holds a start or end marker)
is left as it is: it constrains the whole output.

A thinking budget (`thinking_token_budget`) caps the thought at N tokens with llguidance's
`max_tokens` on the rule that reads it: `reasoning: START thought END /\\n{0,2}/` where
`thought[max_tokens=N]` is text without the end marker; once N tokens are written the rule ends
and only the end marker may follow, so the answer comes after at most N tokens of thinking.
Without a request constraint the answer is free text (not another opened block). The budget
needs an end marker that is one token (`</think>` of the `<think>` families): a text marker
(granite's) would end the budgeted lexeme inside itself, which is why the unbudgeted grammar
reads thought and marker as one lexeme.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from llguidance.gbnf_to_lark import any_to_lark

from jengine.sampling_params import SamplingParams, StructuredOutputs
from jengine.structured.llguidance_backend import JSON_OPTIONS
from jengine.text.reasoning import ReasoningFormat

_RUST_META = re.compile(r"([\\.+*?()|\[\]{}^$#&\-~/])")


def after_reasoning(spec: StructuredOutputs | None, fmt: ReasoningFormat,
                    special_tokens: set[str], budget: int | None = None) -> StructuredOutputs:
    """`spec` with an optional (or, for a template-opened block, required) reasoning block
    allowed before it. `special_tokens`: the vocabulary's added tokens, matched as tokens.
    `budget`: the most tokens the thought may take (None: no cap; `spec` None: a free answer)."""
    if budget is not None:
        return _budgeted(spec, fmt, special_tokens, budget)
    if spec is None:
        raise ValueError("structured_outputs: no constraint set")
    if any(marker in _spec_text(spec) for marker in fmt.starts + fmt.ends):
        return spec
    start = " | ".join([json.dumps(m) for m in fmt.starts] + _tokens(fmt.starts, special_tokens))
    opening = f"({start})?" if fmt.implicit_start else f"({start})"
    ends = "|".join(_rust_escape(m) for m in fmt.ends)
    # The thought and its end marker as one lexeme (text that ends at the first end marker):
    # a thought lexeme of its own could stop inside a marker that is text ("Here is my").
    closing = ["THOUGHT_END"] + [f"THOUGHT {t}" for t in _tokens(fmt.ends, special_tokens)]
    optional = "" if fmt.implicit_start else "?"
    lark = (f"start: reasoning{optional} answer\n"
            f"reasoning: {opening} ({' | '.join(closing)}) /\\n{{0,2}}/\n"
            f"THOUGHT_END: /(?s:.*)({ends})/ & ~/(?s:.*({ends}).+)/\n"
            f"THOUGHT: /(?s:.*)/ & ~/(?s:.*({ends}).*)/\n"
            f"answer: {_answer(spec)}\n")
    return StructuredOutputs(grammar=lark)


def _budgeted(spec: StructuredOutputs | None, fmt: ReasoningFormat, special_tokens: set[str],
              budget: int) -> StructuredOutputs:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"thinking_token_budget must be a non-negative integer, got {budget!r}")
    end_tokens = _tokens(fmt.ends, special_tokens)
    if not end_tokens:
        raise ValueError(f"thinking_token_budget needs a reasoning end marker that is one token "
                         f"of the vocabulary; {fmt.name}'s {fmt.ends[0]!r} is not")
    if spec is not None and any(m in _spec_text(spec) for m in fmt.starts + fmt.ends):
        raise ValueError("thinking_token_budget: the output constraint writes the reasoning "
                         "block itself, so the budget cannot apply")
    start = " | ".join([json.dumps(m) for m in fmt.starts] + _tokens(fmt.starts, special_tokens))
    opening = f"({start})?" if fmt.implicit_start else f"({start})"
    close = " | ".join(end_tokens + [json.dumps(m) for m in fmt.ends])
    ends = "|".join(_rust_escape(m) for m in fmt.ends)
    starts = "|".join(_rust_escape(m) for m in fmt.starts)
    optional = "" if fmt.implicit_start else "?"
    answer = _answer(spec) if spec is not None else "ANSWER"
    return StructuredOutputs(grammar=(
        f"start: reasoning{optional} answer\n"
        f"reasoning: {opening} thought ({close}) /\\n{{0,2}}/\n"
        f"thought[max_tokens={budget}]: /(?s:.*)/ & ~/(?s:.*({ends}).*)/\n"
        f"answer: {answer}\n"
        f"ANSWER: /(?s:.*)/ & ~/(?s:\\s*({starts}).*)/\n"))


def _tokens(markers: tuple[str, ...], special_tokens: set[str]) -> list[str]:
    """The markers that are one token of the vocabulary, as Lark's token references."""
    return [m for m in markers if m in special_tokens and re.fullmatch(r"<[^<>\s]+>", m)]


def _answer(spec: StructuredOutputs) -> str:
    if spec.json is not None:
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        if not isinstance(schema, dict):
            raise ValueError("structured_outputs: a JSON schema must be an object")
        return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})
    if spec.json_object:
        return "%json " + json.dumps({"type": "object", "x-guidance": JSON_OPTIONS})
    if spec.regex is not None:
        return "/" + re.sub(r"(?<!\\)/", r"\\/", spec.regex) + "/"
    if spec.choice is not None:
        return " | ".join(json.dumps(c) for c in spec.choice)
    if spec.grammar is not None:
        try:
            lark = any_to_lark(spec.grammar)
        except Exception as e:  # noqa: BLE001 - the converter's error is the request's fault
            raise ValueError(f"structured_outputs: the grammar does not convert: {e}") from None
        return "%lark {\n" + lark + "\n}"
    raise ValueError("structured_outputs: no constraint set")


def _spec_text(spec: StructuredOutputs) -> str:
    parts = [spec.regex, spec.grammar, *(spec.choice or ())]
    if spec.json is not None:
        parts.append(spec.json if isinstance(spec.json, str) else json.dumps(spec.json))
    return "\n".join(p for p in parts if isinstance(p, str))


def _rust_escape(text: str) -> str:
    return _RUST_META.sub(r"\\\1", text)


def params_after_reasoning(params: SamplingParams, fmt: ReasoningFormat | None,
                           tokenizer: Any, budget: int | None = None) -> SamplingParams:
    """`params` whose output constraint, if any, applies after `fmt`'s reasoning block, and
    whose thought is capped at `budget` tokens (unchanged without a format, or without a
    constraint and a budget: thinking turned off leaves nothing to cap)."""
    spec = params.structured_outputs
    if fmt is None or (spec is None and budget is None):
        return params
    special = set(tokenizer.get_added_vocab()) if hasattr(tokenizer, "get_added_vocab") else set()
    return dataclasses.replace(params,
                               structured_outputs=after_reasoning(spec, fmt, special, budget))
