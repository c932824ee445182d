"""`Engine.chat(..., reasoning_parser=...)`: the thinking in `CompletionOutput.reasoning`, the
answer in `text`, on a tiny random Qwen3 whose output a grammar forces into a think block
(tests/tiny_models.py); the server's view: tests/server/test_server_reasoning.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import qwen3_thinking  # tests/tiny_models.py

from jengine import Engine, SamplingParams
from jengine.sampling_params import StructuredOutputs

THINK = 'start: <think> /[a-z ]{3,12}/ </think> "\\n\\n" /[a-z]{2,6}/\n'
HI = [{"role": "user", "content": "hi"}]


def test_chat_splits_reasoning_from_the_answer(tmp_path):
    engine = Engine(str(qwen3_thinking(tmp_path)), config=str(Path(__file__).parents[1] /
                                                               "one_bucket.yaml"), progress=False)
    params = SamplingParams(max_tokens=40, temperature=0,
                            structured_outputs=StructuredOutputs(grammar=THINK))
    [[raw]] = [o.outputs for o in engine.chat(HI, params)]
    assert raw.reasoning is None and raw.text.startswith("<think>")
    thought, answer = raw.text.removeprefix("<think>").split("</think>\n\n")
    [[out]] = [o.outputs for o in engine.chat(HI, params, reasoning_parser="qwen3")]
    assert (out.reasoning, out.text) == (thought.strip(), answer)
    [[off]] = [o.outputs for o in engine.chat(HI, params, reasoning_parser="auto",
                                              chat_template_kwargs={"enable_thinking": False})]
    assert off.reasoning is None and off.text.startswith("<think>")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        engine.chat(HI, params, reasoning_parser="r1")

    # a thinking budget: `</think>` forced after 3 tokens of thought, then the answer
    free = SamplingParams(max_tokens=16, temperature=0)
    [[capped]] = [o.outputs for o in engine.chat(HI, free, reasoning_parser="deepseek_r1",
                                                 thinking_token_budget=3)]
    tokenizer = engine.tokenizer
    assert tokenizer.decode(capped.token_ids[3:]).startswith("</think>")
    assert capped.reasoning == tokenizer.decode(capped.token_ids[:3]).strip()
    with pytest.raises(ValueError, match="thinking_token_budget"):
        engine.chat(HI, free, thinking_token_budget=3)  # no reasoning parser
