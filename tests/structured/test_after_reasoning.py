"""Output constraints after the reasoning block (jengine/structured/after_reasoning.py): which
texts the wrapped grammar accepts, through llguidance over a byte-level tokenizer whose
`<think>` / `</think>` are tokens, as Qwen3's are."""

from __future__ import annotations

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
