"""The reasoning parsers (jengine/text/reasoning.py) on example outputs of each format: the
whole-text split, and the same split however the text arrives in streamed deltas (a marker cut
anywhere), and `auto`'s choice from chat templates."""

from __future__ import annotations

import pytest

from jengine import SamplingParams
from jengine.text.reasoning import (
    FORMATS,
    ReasoningStream,
    detect_format,
    keep_markers,
    resolve_format,
    split_reasoning,
)

# (format, output, expected reasoning, expected content)
CASES = [
    ("deepseek_r1", "<think>\nAdd 2 and 2.\n</think>\n\nIt is 4.", "Add 2 and 2.", "It is 4."),
    # R1's template opened the block: the output starts inside it
    ("deepseek_r1", "Add 2 and 2.\n</think>\n\nIt is 4.", "Add 2 and 2.", "It is 4."),
    ("deepseek_r1", "still thinking when max_tokens", "still thinking when max_tokens", ""),
    ("deepseek_r1", "</think>Only an answer.", None, "Only an answer."),
    ("deepseek_r1", "", None, ""),
    ("qwen3", "<think>\nHmm, a </ and a <th inside.\n</think>\n\nHello!", "Hmm, a </ and a <th "
     "inside.", "Hello!"),
    ("qwen3", "Hello without thinking.", None, "Hello without thinking."),
    ("qwen3", "  \n leading space is content's", None, "  \n leading space is content's"),
    ("qwen3", "\n<think>a\n\nb</think>c </think> d", "a\n\nb", "c </think> d"),
    ("qwen3", "<think>cut off", "cut off", ""),
    ("qwen3", "<thi", None, "<thi"),
    ("qwen3", "<think></think>\n\nanswer", None, "answer"),
    ("granite", "Here is my thought process:\n1. look\n2. see\n\nHere is my response:\nDone.",
     "1. look\n2. see", "Done."),
    ("granite", "Here's my thought process: short. Here's my response: ok", "short.", "ok"),
    ("granite", "Here is a plain answer.", None, "Here is a plain answer."),
    # harmony's documented example output (its `<|return|>` is the stop token, not text)
    ("openai_gptoss", '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple '
     'arithmetic. Provide answer.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.',
     'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = 4."),
    # several analysis messages; an answer with no reasoning; cut off while thinking
    ("openai_gptoss", "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>"
     "analysis<|message|>b<|end|><|start|>assistant<|channel|>final<|message|> c", "a\nb", " c"),
    ("openai_gptoss", "<|channel|>final<|message|>Only <|end|> an answer.", None,
     "Only <|end|> an answer."),
    ("openai_gptoss", "<|channel|>analysis<|message|>cut off", "cut off", ""),
    ("openai_gptoss", "<|channel|>analysis<|message|>x<|end|><|start|>assis", "x",
     "<|start|>assis"),
    ("openai_gptoss", "no header at all", None, "no header at all"),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_whole_split(name, text, reasoning, content):
    assert split_reasoning(FORMATS[name], text) == (reasoning, content)


def _streamed(name: str, chunks: list[str]) -> tuple[str | None, str, list[str]]:
    stream = ReasoningStream(FORMATS[name])
    pieces = [p for chunk in chunks for p in stream.feed(chunk)] + stream.finish()
    kinds = [kind for kind, _ in pieces]
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    return reasoning or None, "".join(t for kind, t in pieces if kind == "content"), kinds


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_streamed_split_at_every_boundary(name, text, reasoning, content):
    """Two deltas cut at each character, and one delta per character: the same split, and
    every reasoning piece before every content piece."""
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for chunks in cuts:
        got_reasoning, got_content, kinds = _streamed(name, chunks)
        assert (got_reasoning, got_content) == (reasoning, content), chunks
        assert kinds == sorted(kinds, key=lambda k: k == "content"), chunks


def test_reasoning_leaves_as_it_comes():
    """The stream holds back only what may still be a marker or trailing whitespace."""
    stream = ReasoningStream(FORMATS["qwen3"])
    assert stream.feed("<think>one two") == [("reasoning", "one two")]
    assert stream.feed(" three </thi") == [("reasoning", " three")]
    assert stream.feed("nk>\n\nfour") == [("content", "four")]
    assert stream.finish() == []


DEEPSEEK_TEMPLATE = ("{% for m in messages %}<｜User｜>{{ m.content }}{% endfor %}"
                     "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")
QWEN3_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% if enable_thinking is defined and enable_thinking is false %}"
                  "<think>\n\n</think>\n\n{% endif %}{% endif %}"
                  "{# reasoning_content is split at '</think>' #}")
GRANITE_TEMPLATE = ("{% if thinking %}You are Granite. Think: respond with 'Here is my thought "
                    "process:' then 'Here is my response:'{% endif %}"
                    "{% for m in messages %}{{ m.content }}{% endfor %}")
# Harmony's layout (docs/format.md of openai/harmony): an assistant turn names its channel.
HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}"
                    "{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
                    "<|message|>{{ m.content }}<|end|>{% endfor %}"
                    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


class _Tokenizer:
    """Just the template renderer (jinja2, as HF's apply_chat_template), for `auto`."""

    def __init__(self, template: str):
        self.chat_template = template

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, chat_template):
        import jinja2
        return jinja2.Template(chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize(("template", "expected"), [
    (DEEPSEEK_TEMPLATE, "deepseek_r1"), (QWEN3_TEMPLATE, "qwen3"),
    (GRANITE_TEMPLATE, "granite"), (HARMONY_TEMPLATE, "openai_gptoss"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None)])
def test_auto_reads_the_template(template, expected):
    fmt = resolve_format("auto", _Tokenizer(template))
    assert (fmt.name if fmt else None) == expected
    prompt = _Tokenizer(template).apply_chat_template([{"role": "user", "content": "x"}], True,
                                                      False, template)
    assert detect_format(template, prompt) is fmt


def test_thinking_off_and_unknown_names():
    assert resolve_format("qwen3", None, None, {"enable_thinking": False}) is None
    assert resolve_format("granite", None, None, {"thinking": False}) is None
    assert resolve_format("qwen3", None, None, {"enable_thinking": True}) is FORMATS["qwen3"]
    assert resolve_format(None, None) is None
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'"):
        resolve_format("r1", None)


def test_harmony_keeps_its_special_tokens_in_the_text():
    """Harmony's markers are special tokens: the parser's params keep them (and the tool
    parser's), other formats' params are left alone."""
    params = SamplingParams(keep_special_tokens=["<tool_call>"])
    kept = keep_markers(params, FORMATS["openai_gptoss"]).keep_special_tokens
    assert list(kept) == ["<tool_call>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>"]
    assert keep_markers(params, FORMATS["qwen3"]) is params
    assert keep_markers(params, None) is params
