"""`load_format="dummy"`: an engine from a model's config and tokenizer alone, with random
weights of the declared shapes made on the devices (vLLM's `--load-format dummy`), which is how
scripts/gpu_bench.py times Llama-3-8B shapes without 16 GB of weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import transformers
from tiny_models import save_tokenizer

from converters import ModelLoadError
from jengine import Engine, SamplingParams
from jengine.engine_flags import engine_kwargs, engine_parent
from jengine.models import family_module

ONE_BUCKET = str(Path(__file__).parents[1] / "one_bucket.yaml")


@pytest.fixture(scope="module")
def config_only(tmp_path_factory) -> Path:
    """A Llama's config.json and tokenizer, and no weight file."""
    path = tmp_path_factory.mktemp("config_only")
    transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2,
    ).save_pretrained(path)
    save_tokenizer(path, 96)
    return path


def test_dummy_weights_have_the_declared_shapes_and_generate(config_only):
    engine = Engine(str(config_only), load_format="dummy", config=ONE_BUCKET, progress=False)
    cfg = engine.core.model_config
    specs = family_module(cfg).param_specs(cfg)
    params = engine.core.runner.params
    assert params["embed"].shape == specs["embed"].shape
    embed = np.asarray(params["embed"], np.float32)
    assert 0.015 < embed.std() < 0.025  # N(0, 0.02), not zeros or ones
    assert np.all(np.asarray(params["final_norm"]) == 1)  # a norm's `ones` init
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    [a] = engine.generate([[5, 6, 7]], params)
    assert len(a.outputs[0].token_ids) == 6
    [b] = Engine(str(config_only), load_format="dummy", config=ONE_BUCKET,
                 progress=False).generate([[5, 6, 7]], params)
    assert b.outputs[0].token_ids == a.outputs[0].token_ids  # the same weights each start


def test_dummy_weights_quantize_like_real_ones(config_only):
    engine = Engine(str(config_only), load_format="dummy", quantization="w8a16",
                    config=ONE_BUCKET, progress=False)
    [out] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3


def test_without_dummy_the_missing_weights_are_a_clear_error(config_only):
    with pytest.raises(ModelLoadError, match="no .safetensors"):
        Engine(str(config_only), config=ONE_BUCKET, progress=False)
    with pytest.raises(ValueError, match="load_format"):
        Engine(str(config_only), load_format="random", config=ONE_BUCKET, progress=False)


def test_the_flag_reaches_the_engine_keywords():
    args = engine_parent().parse_args(["--load-format", "dummy"])
    assert engine_kwargs(args)["load_format"] == "dummy"
