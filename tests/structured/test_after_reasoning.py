"""Output constraints after the reasoning block (jengine/structured/after_reasoning.py): which
texts the wrapped grammar accepts, through llguidance over a byte-level tokenizer whose
`<think>` / `</think>` are tokens, as Qwen3's are."""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from tiny_models import save_byte_tokenizer  # tests/tiny_models.py

from jengine.sampling_params import StructuredOutputs
from jengine.structured.after_reasoning import after_reasoning
from jengine.structured.llguidance_backend import LLGuidanceBackend
from jengine.text.reasoning import FORMATS

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    path = tmp_path_factory.mktemp("bytes")
    save_byte_tokenizer(path, added=["<think>", "</think>"], special=["<|im_end|>"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return tokenizer, LLGuidanceBackend(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))


def _accepts(backend, spec: StructuredOutputs, fmt: str, text: str) -> bool:
    tokenizer, llg = backend
    spec = after_reasoning(spec, FORMATS[fmt], set(tokenizer.get_added_vocab()))
    matcher = llg.compile(spec).matcher()
    return all(matcher.accept(t) for t in tokenizer(text).input_ids) and \
        matcher._m.is_accepting()


@pytest.mark.parametrize(("spec", "fmt", "text", "accepted"), [
    (StructuredOutputs(json=SCHEMA), "qwen3", '{"a": 1}', True),
    (StructuredOutputs(json=SCHEMA), "qwen3", '<think>hmm, {"a": "x"}?</think>\n\n{"a": 1}', True),
    (StructuredOutputs(json=SCHEMA), "qwen3", '<think>hmm</think>{"a": "x"}', False),
    # at most two newlines after the block: free whitespace lets a sampled model pad forever
    (StructuredOutputs(json=SCHEMA), "qwen3", '<think>hmm</think>\n\n\n{"a": 1}', False),
    (StructuredOutputs(regex="ab/c+"), "qwen3", "<think>z</think>ab/cc", True),
    # deepseek_r1: the template opened the block, so the answer must follow its end
    (StructuredOutputs(choice=["yes", "no"]), "deepseek_r1", "yes", False),
    (StructuredOutputs(choice=["yes", "no"]), "deepseek_r1", "hm</think>\nno", True),
    (StructuredOutputs(grammar='start: "x" b\nb: "y"'), "granite",
     "Here is my thought process: Here is my Here is my response:xy", True),
    (StructuredOutputs(grammar='root ::= "x" "y"'), "qwen3", "<think>q</think>xy", True),
    (StructuredOutputs(json_object=True), "qwen3", "<think>q</think>{}", True),
])
def test_constraint_applies_after_the_reasoning(backend, spec, fmt, text, accepted):
    assert _accepts(backend, spec, fmt, text) is accepted


def test_a_constraint_that_writes_the_block_is_kept():
    spec = StructuredOutputs(regex="<think>[a-z]+</think>[0-9]")
    assert after_reasoning(spec, FORMATS["qwen3"], {"<think>"}) is spec


def _allowed_after(backend, spec, fmt: str, text: str, budget: int) -> list[str]:
    """The tokens the budgeted grammar allows after `text` (accepted token by token)."""
    tokenizer, llg = backend
    grammar = after_reasoning(spec, FORMATS[fmt], set(tokenizer.get_added_vocab()), budget)
    matcher = llg.compile(grammar).matcher()
    assert all(matcher.accept(t) for t in tokenizer(text).input_ids), matcher.error
    mask = np.zeros((1, (len(tokenizer) + 31) // 32), dtype=np.int32)
    matcher.fill_mask(mask, 0)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:len(tokenizer)]
    return [tokenizer.convert_ids_to_tokens(int(i)) for i in np.nonzero(bits)[0]]


@pytest.mark.parametrize("fmt", ["qwen3", "deepseek_r1"])
def test_a_budget_forces_the_end_marker_after_n_thought_tokens(backend, fmt):
    opened = "<think>" if fmt == "qwen3" else ""
    free = _allowed_after(backend, None, fmt, opened + "abcd", 5)
    assert "e" in free and "</think>" in free  # under the budget: think on, or close
    # at the budget only the end marker (as its token, or its text's first byte) may follow
    assert sorted(_allowed_after(backend, None, fmt, opened + "abcde", 5)) == ["<", "</think>"]
    assert "x" in _allowed_after(backend, None, fmt, opened + "abcde</think>\n\n", 5)
    # a budget of 0: no thought at all
    assert sorted(_allowed_after(backend, None, fmt, "<think>", 0)) == ["<", "</think>"]


@pytest.mark.parametrize(("spec", "text", "accepted"), [
    (None, "<think>abc</think>\n\nfree answer", True),
    (None, "plain answer, no thinking", True),  # qwen3: the block is the model's to open
    (None, "<think>abcdef</think>x", False),  # six thought tokens over a budget of five
    (None, "\n<think>abcdefgh", False),  # nor may the free answer open a block of its own
    (StructuredOutputs(json=SCHEMA), '<think>abcde</think>\n\n{"a": 1}', True),
    (StructuredOutputs(json=SCHEMA), '<think>abcde</think>\n\n{"a": "x"}', False),
])
def test_a_budget_combines_with_the_answer_constraint(backend, spec, text, accepted):
    tokenizer, llg = backend
    grammar = after_reasoning(spec, FORMATS["qwen3"], set(tokenizer.get_added_vocab()), 5)
    matcher = llg.compile(grammar).matcher()
    assert (all(matcher.accept(t) for t in tokenizer(text).input_ids)
            and matcher._m.is_accepting()) is accepted


@pytest.mark.parametrize(("fmt", "budget", "special", "message"), [
    ("qwen3", -1, {"</think>"}, "non-negative integer"),
    ("qwen3", 2.5, {"</think>"}, "non-negative integer"),
    ("qwen3", True, {"</think>"}, "non-negative integer"),
    ("qwen3", 8, set(), "one token"),  # `</think>` is text in this vocabulary
    ("granite", 8, set(), "one token"),
])
def test_a_budget_that_cannot_apply_is_refused(fmt, budget, special, message):
    with pytest.raises(ValueError, match=message):
        after_reasoning(None, FORMATS[fmt], special, budget)
