"""LoRA adapters with the rest of the engine: the bundled SmolLM2's real weights against HF
transformers + PEFT, structured outputs, n > 1 and n-gram speculative decoding under an
adapter (docs/lora.md)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
from hf_gguf import load_hf_gguf  # tests/hf_gguf.py
from lora_adapters import base_model, hf_greedy, random_adapter

from converters.source import default_model_path
from jengine import Engine, LoRARequest, SamplingParams
from jengine.sampling_params import StructuredOutputs

ONE_BUCKET = str(Path(__file__).parents[1] / "one_bucket.yaml")


@pytest.mark.slow  # ~30 s; CI: HF + PEFT parity on the tiny models (tests/engine/test_lora.py)
def test_smollm2_adapter_equals_hf_peft_and_keeps_structured_outputs(tmp_path):
    tok, model = load_hf_gguf(default_model_path())
    lora = peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                           target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    model = peft.get_peft_model(model, lora)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    model.save_pretrained(tmp_path / "smol_lora")
    model.eval()
    prompt = tok("The capital of France is").input_ids
    engine = Engine(config=ONE_BUCKET, enable_lora=True, max_loras=1, max_lora_rank=8,
                    progress=False)
    adapter = LoRARequest("smol", 1, str(tmp_path / "smol_lora"))
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    [out] = engine.generate([prompt], greedy, lora_request=adapter)
    expected = hf_greedy(model, prompt, 8)
    with model.disable_adapter():
        assert expected != hf_greedy(model, prompt, 8)  # the adapter changes the text
    assert out.outputs[0].token_ids == expected
    constrained = SamplingParams(max_tokens=12, temperature=0,
                                 structured_outputs=StructuredOutputs(regex=r"[0-9]{3}-[a-z]+"))
    [out] = engine.generate([prompt], constrained, lora_request=adapter)
    assert re.fullmatch(r"[0-9]{3}-[a-z]+", out.outputs[0].text), out.outputs[0].text


def test_ngram_speculation_and_n_samples_keep_the_adapters_tokens(tmp_path):
    """Speculative verification under an adapter reads the adapter's logits for every proposed
    row (greedy output unchanged), and each of n samples runs under it."""
    base_model(tmp_path / "base", "llama")
    model = random_adapter(tmp_path / "base", tmp_path / "a", "llama", r=4, alpha=8, seed=7)
    rng = np.random.default_rng(5)
    motif = rng.integers(3, 96, 6).tolist()
    prompts = [motif * 4, rng.integers(3, 96, 9).tolist()]  # a repeated motif: ngram proposes
    expected = [hf_greedy(model, p, 24) for p in prompts]
    adapter = LoRARequest("a", 1, str(tmp_path / "a"))
    engine = Engine(str(tmp_path / "base"), config=ONE_BUCKET, enable_lora=True, max_loras=1,
                    max_lora_rank=4, speculative="ngram", num_speculative_tokens=4,
                    progress=False)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, n=2)
    outs = engine.generate(prompts, greedy, lora_request=adapter)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[e, e] for e in expected]
    assert engine.core.scheduler.spec_counters.num_draft_tokens > 0
