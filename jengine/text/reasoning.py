"""Reasoning parsers: a reasoning model's thinking split from its answer (`--reasoning-parser`).

A reasoning model writes its thinking first, between markers, then the answer. One table-driven
class reads every format, as vLLM's parsers of the same names do:

    deepseek_r1  `<think>` ... `</think>` answer; the chat template may have opened the block
                 (R1 and Qwen3-Thinking-2507 end the prompt with `<think>`), so the text up to
                 `</think>` is reasoning with or without `<think>`, and all of an output that
                 never closes it (cut off while thinking) is reasoning
    qwen3        `<think>` ... `</think>` answer, reasoning only when the output opens the block
                 (Qwen3 with `enable_thinking: false` renders an empty block into the prompt and
                 writes none; the output is then all content)
    granite      Granite 3.x: "Here is my thought process:" ... "Here is my response:" answer
                 ("Here's" too)
    openai_gptoss  gpt-oss's harmony messages after the generation prompt's
                 `<|start|>assistant`: each `<|channel|>analysis<|message|>` ... `<|end|>` is
                 reasoning (several join with a newline), and the `final` channel's message is
                 the answer, its header `<|start|>assistant<|channel|>final<|message|>` dropped
                 (an output that opens with it has no reasoning). The markers are special tokens:
                 `keep_markers` keeps them in the text the parser reads. The `commentary`
                 channel (harmony's tool calls) is not read: it stays in the answer as written.
    auto         chosen from the chat template (`detect_format`): a template that mentions
                 `<think>` is deepseek_r1 when its generation prompt ends in `<think>`, else qwen3;
                 one that mentions "my thought process" is granite, `<|channel|>` openai_gptoss;
                 any other has none

The reasoning text is stripped of the whitespace around it and the answer of the whitespace
that follows the closing marker (the newlines models put there); an output without reasoning is
content exactly as generated. `ReasoningStream` splits streamed deltas (a marker may arrive
split across them); `split_reasoning` is the same split of a whole text, so a streamed and a
whole answer agree.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from jengine.sampling_params import SamplingParams

Kind = Literal["reasoning", "content"]


@dataclasses.dataclass(frozen=True)
class ReasoningFormat:
    """Where one model family's reasoning begins and ends."""

    name: str
    starts: tuple[str, ...]  # markers that open the reasoning (any of them)
    ends: tuple[str, ...]  # markers that close it; the answer follows
    implicit_start: bool = False  # reasoning from the first token, start marker or not
    # Headers dropped where the answer begins (harmony's final channel), and whether a start
    # marker after the reasoning opens more of it (harmony's several analysis messages).
    answer_starts: tuple[str, ...] = ()
    repeats: bool = False
    # The special tokens the markers are made of, which the text must keep (`keep_markers`).
    special_tokens: tuple[str, ...] = ()


_HARMONY = ReasoningFormat(
    "openai_gptoss",
    ("<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>analysis<|message|>"),
    ("<|end|>",),
    answer_starts=("<|start|>assistant<|channel|>final<|message|>",
                   "<|channel|>final<|message|>"),
    repeats=True,
    special_tokens=("<|start|>", "<|channel|>", "<|message|>", "<|end|>"),
)
FORMATS = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", ("<think>",), ("</think>",), True),
    "qwen3": ReasoningFormat("qwen3", ("<think>",), ("</think>",)),
    "granite": ReasoningFormat("granite", ("Here is my thought process:",
                                           "Here's my thought process:"),
                               ("Here is my response:", "Here's my response:")),
    "openai_gptoss": _HARMONY,
}
REASONING_PARSERS = ("auto", *FORMATS)


def check_parser_name(name: str | None) -> None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: "
                         f"{', '.join(REASONING_PARSERS)}")


def detect_format(template: str | None, generation_prompt: str) -> ReasoningFormat | None:
    """`auto`'s choice from the chat template's text and what it renders as the generation
    prompt of a one-message conversation (see the module docstring)."""
    template = template or ""
    if "<think>" in template or "</think>" in template:
        opened = generation_prompt.rstrip().endswith("<think>")
        return FORMATS["deepseek_r1" if opened else "qwen3"]
    if "my thought process" in template:
        return FORMATS["granite"]
    if "<|channel|>" in template:
        return FORMATS["openai_gptoss"]
    return None


def keep_markers(params: SamplingParams, fmt: ReasoningFormat | None) -> SamplingParams:
    """`params` whose text keeps the special tokens `fmt`'s markers are made of (harmony's),
    which `skip_special_tokens` would otherwise drop before the parser sees them."""
    if fmt is None or not fmt.special_tokens or not params.skip_special_tokens:
        return params
    kept = (*(params.keep_special_tokens or ()), *fmt.special_tokens)
    return dataclasses.replace(params, keep_special_tokens=kept)


def thinking_off(template_kwargs: dict[str, Any] | None) -> bool:
    """Whether `chat_template_kwargs` turn the model's thinking off."""
    kwargs = template_kwargs or {}
    return kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False


def resolve_format(name: str | None, tokenizer: Any, chat_template: str | None = None,
                   template_kwargs: dict[str, Any] | None = None) -> ReasoningFormat | None:
    """The format a request's output is read with: None without a parser, or when the request
    turned thinking off (`chat_template_kwargs: {"enable_thinking": false}`, Qwen3's and
    SmolLM3's switch; `{"thinking": false}`, Granite's)."""
    check_parser_name(name)
    if name is None or thinking_off(template_kwargs):
        return None
    if name != "auto":
        return FORMATS[name]
    template = chat_template or getattr(tokenizer, "chat_template", None)
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                               add_generation_prompt=True, tokenize=False,
                                               chat_template=template)
    except Exception:  # noqa: BLE001 - a template that cannot render alone: judge its text
        prompt = ""
    return detect_format(template if isinstance(template, str) else None, prompt)


class ReasoningStream:
    """Splits streamed text into reasoning and content pieces, in order.

    States: `start` (nothing decided: leading whitespace and a partial start marker are held),
    `reasoning` (text is held only while it could be the start of an end marker, or trailing
    whitespace), `after` (the whitespace after the end marker is dropped) and `content`.
    """

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self.state = "start"
        self.found = False  # whether the output has a reasoning part
        self._buf = ""
        self._space = ""  # reasoning's trailing whitespace, out only if more reasoning follows

    def feed(self, text: str) -> list[tuple[Kind, str]]:
        self._buf += text
        out: list[tuple[Kind, str]] = []
        while self._step(out):
            pass
        return _merged(out)

    def finish(self) -> list[tuple[Kind, str]]:
        """Whatever is held: a partial marker is text of the part it was read in."""
        out: list[tuple[Kind, str]] = []
        if self.state == "start" and self._buf:
            if self.fmt.implicit_start:
                self.found = True
                self._reasoning(self._buf.lstrip(), out)
            else:
                out.append(("content", self._buf))
        elif self.state == "reasoning":
            self._reasoning(self._buf, out)
        elif self.state in ("content", "after") and self._buf:  # "after": a partial header
            out.append(("content", self._buf))
        self._buf, self._space = "", ""
        return _merged(out)

    def _step(self, out: list[tuple[Kind, str]]) -> bool:
        """One transition; False when it must wait for more text."""
        buf = self._buf
        if self.state == "start":
            head = buf.lstrip()
            for marker in self.fmt.starts:
                if head.startswith(marker):
                    self._enter_reasoning(head[len(marker):])
                    return True
            if self._answer_begins(head):
                return True
            if not head or any(m.startswith(head) for m in self.fmt.starts):
                return False  # whitespace or a partial start marker so far
            if any(m.startswith(head) for m in self.fmt.answer_starts):
                return False
            if self.fmt.implicit_start:
                self._enter_reasoning(head)
            else:
                self.state = "content"
            return True
        if self.state == "reasoning":
            if not self.found:  # the whitespace right after the start marker
                buf = self._buf = buf.lstrip()
                if not buf:
                    return False
                self.found = True
            end, marker = _first(buf, self.fmt.ends)
            if marker is not None:
                self._reasoning(buf[:end], out)
                self._buf, self._space, self.state = buf[end + len(marker):], "", "after"
                return True
            keep = max(_partial_suffix(buf, m) for m in self.fmt.ends)
            self._reasoning(buf[: len(buf) - keep], out, hold_space=True)
            self._buf = buf[len(buf) - keep:]
            return False
        if self.state == "after":
            buf = self._buf = buf.lstrip()
            if self._answer_begins(buf):
                return True
            markers = self.fmt.answer_starts + (self.fmt.starts if self.fmt.repeats else ())
            if self.fmt.repeats:
                for marker in self.fmt.starts:
                    if buf.startswith(marker):
                        self._space = "\n"  # the next message's reasoning on a line of its own
                        self._enter_reasoning(buf[len(marker):])
                        return True
            if not buf or any(m.startswith(buf) for m in markers):
                return False
            self.state = "content"
            return True
        if buf:
            out.append(("content", buf))
            self._buf = ""
        return False

    def _answer_begins(self, head: str) -> bool:
        """At an answer header (harmony's final channel): dropped, and the answer follows."""
        for marker in self.fmt.answer_starts:
            if head.startswith(marker):
                self.state, self._buf = "content", head[len(marker):]
                return True
        return False

    def _enter_reasoning(self, rest: str) -> None:
        self.state, self._buf = "reasoning", rest

    def _reasoning(self, text: str, out: list, hold_space: bool = False) -> None:
        stripped = text.rstrip()
        if stripped:
            out.append(("reasoning", self._space + stripped))
            self._space = ""
        if hold_space:
            self._space += text[len(stripped):]


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a whole output: reasoning None when there is none."""
    stream = ReasoningStream(fmt)
    pieces = stream.feed(text) + stream.finish()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    content = "".join(t for kind, t in pieces if kind == "content")
    return reasoning or None, content


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(found) if found else (-1, None)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _merged(pieces: list[tuple[Kind, str]]) -> list[tuple[Kind, str]]:
    out: list[tuple[Kind, str]] = []
    for kind, text in pieces:
        if not text:
            continue
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out
