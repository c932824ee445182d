"""DeepSeek-V3 (`deepseek_v3`, Kimi K2's architecture): DeepSeek-V2's latent attention and MoE
with V3's router, against HF transformers on tiny random models (tests/models/test_deepseek.py's
recipe: chunked prefill over shuffled pages, then 8 decode steps, float32 logits within `TOL`).

- The router: sigmoid scores; `e_score_correction_bias` (random here, large enough to move the
  choice) picks the groups (each ranked by its two best biased scores) and the experts, and the
  chosen experts weigh their unbiased scores, renormalised. Negative controls: the bias zeroed,
  V2's softmax scoring, no renormalisation, no group limit: each must push the logits past `TOL`.
- The multi-token-prediction layer a published checkpoint carries after its last layer
  (`num_nextn_predict_layers`) is skipped; the same tensors with that key 0 are an error.
- A GGUF file as llama.cpp writes V3 (`deepseek2` with sigmoid gating, the bias as
  `exp_probs_b`) loads as `deepseek_v3` with the same logits.
- Through the engine: greedy tokens equal HF's with the native `cpu` attention and under tp=2.
"""

from __future__ import annotations

import dataclasses
import json

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file
from test_deepseek import ONE_BUCKET, YARN, _greedy_hf, _num_params
from test_gguf_families import _convert, _deepseek2_meta
from test_models_parity import TOL, VOCAB, _build, _max_diff

from converters import ModelLoadError, load_source
from jengine import Engine, SamplingParams


def _config(**kw):
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=3, moe_intermediate_size=32, first_k_dense_replace=1, n_group=4,
        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        max_position_embeddings=128, rms_norm_eps=1e-5, rope_parameters=YARN,
        tie_word_embeddings=False,
    )
    return transformers.DeepseekV3Config(**{**base, **kw})


def _random_bias(model) -> None:
    """A correction bias of the size of the sigmoid scores' spread, so it changes the choice."""
    gen = torch.Generator().manual_seed(3)
    for layer in model.model.layers:
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None:
            gate.e_score_correction_bias.copy_(0.3 * torch.randn(gate.num_experts, generator=gen))


def _control(cfg, params, ids, expected) -> float:
    return _max_diff((cfg, params), ids, expected, decode_steps=0)


def test_deepseek_v3_sigmoid_routing(tmp_path):
    models: list = []
    loaded, ids, expected = _build(tmp_path, _config(), transformers.DeepseekV3ForCausalLM,
                                   edit=lambda m: (_random_bias(m), models.append(m)),
                                   greedy=False)  # greedy: the engine test
    cfg, params = loaded.config, loaded.params
    assert cfg.model_type == "deepseek_v3" and cfg.router_scoring == "sigmoid"
    assert cfg.num_params == _num_params(models[0])
    assert (cfg.expert_groups, cfg.topk_groups, cfg.norm_topk_prob) == (4, 2, True)
    bias = np.asarray(params["router_bias"])  # [MoE layers, experts]
    assert bias.shape == (2, 8) and np.abs(bias).max() > 0.1  # the file's, not zeros
    assert _max_diff(loaded, ids, expected) < TOL
    unbiased = {**params, "router_bias": params["router_bias"] * 0}
    assert _control(cfg, unbiased, ids, expected) > TOL
    for wrong in (dict(router_scoring="softmax"), dict(norm_topk_prob=False),
                  dict(expert_groups=0, topk_groups=0)):
        assert _control(dataclasses.replace(cfg, **wrong), params, ids, expected) > TOL, wrong


def test_deepseek_v3_skips_its_mtp_layer(tmp_path):
    _build(tmp_path, _config(num_hidden_layers=2), transformers.DeepseekV3ForCausalLM,
           greedy=False)
    weights = load_file(tmp_path / "model.safetensors")
    rng = np.random.default_rng(0)
    mtp = {"model.layers.2.eh_proj.weight": (64, 128), "model.layers.2.enorm.weight": (64,),
           "model.layers.2.self_attn.kv_b_proj.weight": (128, 32),
           "model.layers.2.mlp.gate.e_score_correction_bias": (8,)}
    weights.update({k: rng.standard_normal(s).astype(np.float32) for k, s in mtp.items()})
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1  # what transformers writes, as published
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ModelLoadError, match="layers.2"):
        load_source(str(tmp_path), dtype="float32", progress=False)
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_source(str(tmp_path), dtype="float32", progress=False)
    assert loaded.config.mtp_layers == 1 and loaded.config.num_layers == 2


def engine_greedy_matches_hf(tmp_path, config, model_cls, runs) -> None:
    """A tiny random model (with a random correction bias) served by the engine under each of
    `runs` (Engine kwargs) gives HF's 16 greedy tokens for three prompts decoded together."""
    models: list = []
    _build(tmp_path, config, model_cls, edit=lambda m: (_random_bias(m), models.append(m)),
           greedy=False)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 19, 11)]
    expected = _greedy_hf(models[0], prompts, 16)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for kwargs in runs:
        engine = Engine(str(tmp_path), config=ONE_BUCKET, dtype="float32",
                        kv_cache_memory="4MiB", max_model_len=64, **kwargs)
        outs = engine.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == expected, kwargs


def test_deepseek_v3_engine_greedy_matches_hf(tmp_path):
    engine_greedy_matches_hf(tmp_path, _config(), transformers.DeepseekV3ForCausalLM,
                             ({"attention_backend": "cpu"},
                              {"attention_backend": "cpu", "mesh": "tp=2"}))


def test_deepseek_v3_gguf(tmp_path):
    # A file says mscale and mscale_all_dim with one key: llama.cpp takes them equal.
    yarn = {**YARN, "mscale": 1.3, "mscale_all_dim": 1.3}
    _, ids, expected = _build(tmp_path, _config(rope_parameters=yarn),
                              transformers.DeepseekV3ForCausalLM, edit=_random_bias,
                              greedy=False)
    path = _convert(tmp_path, gguf.MODEL_ARCH.DEEPSEEK2, lambda w, hf: _deepseek2_meta(
        w, hf, gating=gguf.ExpertGatingFuncType.SIGMOID), base=False)
    loaded = load_source(str(path), dtype="float32", progress=False)
    assert loaded.kind == "gguf" and loaded.config.model_type == "deepseek_v3"
    assert loaded.config.norm_topk_prob and loaded.config.expert_groups == 4
    assert np.abs(np.asarray(loaded.params["router_bias"])).max() > 0.1
    assert _max_diff(loaded, ids, expected) < TOL
