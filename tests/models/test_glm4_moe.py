"""GLM-4.5 (`glm4_moe`) against HF transformers on a tiny random model (tests/models/
test_models_parity.py's recipe: chunked prefill over shuffled pages, 8 decode steps, float32
logits within `TOL`; then the engine's greedy tokens, alone and under tp=2).

Negative controls, each pushing the logits past `TOL`: the correction bias zeroed, the rotary
over the whole head instead of its first half, the q/k norm dropped, the shared experts dropped.
A GGUF file as llama.cpp's `glm4moe` converter writes it (its MTP layer counted in the block
count, with tensors of its own) loads with the same logits.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import transformers
from test_deepseek import _num_params
from test_deepseek_v3 import _random_bias, engine_greedy_matches_hf
from test_gguf_families import _base_meta, _convert
from test_models_parity import TOL, VOCAB, _build, _max_diff

from converters import load_source


def _config(**kw):
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, n_group=4, topk_group=2,
        first_k_dense_replace=1, routed_scaling_factor=2.5, attention_bias=True,
        use_qk_norm=True, max_position_embeddings=128, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    return transformers.Glm4MoeConfig(**{**base, **kw})


def _control(cfg, params, ids, expected) -> float:
    return _max_diff((cfg, params), ids, expected, decode_steps=0)


def test_glm4_moe(tmp_path):
    models: list = []
    loaded, ids, expected = _build(tmp_path, _config(), transformers.Glm4MoeForCausalLM,
                                   edit=lambda m: (_random_bias(m), models.append(m)),
                                   greedy=False)  # greedy: the engine test below
    cfg, params = loaded.config, loaded.params
    assert cfg.num_params == _num_params(models[0])
    assert (cfg.first_dense_layers, cfg.rotary_dim, cfg.qkv_bias, cfg.o_bias) == (1, 8, True,
                                                                                 False)
    assert params["w_gate"].shape[0] == 1 and params["we_gate"].shape[:2] == (2, 8)
    assert _max_diff(loaded, ids, expected) < TOL
    unbiased = {**params, "router_bias": params["router_bias"] * 0}
    assert _control(cfg, unbiased, ids, expected) > TOL
    no_shared = {**params, "ws_down": params["ws_down"] * 0}
    assert _control(cfg, no_shared, ids, expected) > TOL
    whole_rotary = dataclasses.replace(cfg, partial_rotary_factor=1.0)
    assert _control(whole_rotary, params, ids, expected) > TOL
    no_norm = {**params, "q_norm": params["q_norm"] * 0 + 1, "k_norm": params["k_norm"] * 0 + 1}
    assert _control(cfg, no_norm, ids, expected) > TOL


def test_glm4_moe_engine_greedy_matches_hf(tmp_path):
    engine_greedy_matches_hf(tmp_path, _config(), transformers.Glm4MoeForCausalLM,
                             ({}, {"mesh": "tp=2"}))


def _glm4moe_meta(w, hf):
    """Glm4MoeModel.set_gguf_parameters: the base keys with the MTP layer in the block count,
    the head and rotary widths, the MoE keys and sigmoid gating."""
    _base_meta(w, {**hf, "num_hidden_layers": hf["num_hidden_layers"] + 1})
    w.add_nextn_predict_layers(1)
    w.add_key_length(hf["head_dim"])
    w.add_value_length(hf["head_dim"])
    w.add_rope_dimension_count(int(hf["head_dim"] * 0.5))
    w.add_expert_count(hf["n_routed_experts"])
    w.add_expert_used_count(hf["num_experts_per_tok"])
    w.add_expert_shared_count(hf["n_shared_experts"])
    w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    w.add_leading_dense_block_count(hf["first_k_dense_replace"])
    w.add_expert_weights_scale(hf["routed_scaling_factor"])
    w.add_expert_weights_norm(hf["norm_topk_prob"])
    w.add_expert_group_count(hf["n_group"])
    w.add_expert_group_used_count(hf["topk_group"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def _with_mtp_layer(tensors, hf):
    """The MTP layer llama.cpp writes after the last one: a block of its own tensors."""
    last, rng = hf["num_hidden_layers"], np.random.default_rng(0)
    e = hf["hidden_size"]
    return {**tensors, f"blk.{last}.nextn.eh_proj.weight": rng.standard_normal((e, 2 * e)),
            f"blk.{last}.nextn.enorm.weight": np.ones(e),
            f"blk.{last}.attn_norm.weight": np.ones(e)}


def test_glm4_moe_gguf(tmp_path):
    _, ids, expected = _build(tmp_path, _config(), transformers.Glm4MoeForCausalLM,
                              edit=_random_bias, greedy=False)
    path = _convert(tmp_path, gguf.MODEL_ARCH.GLM4_MOE, _glm4moe_meta, base=False,
                    edit=_with_mtp_layer)
    loaded = load_source(str(path), dtype="float32", progress=False)
    cfg = loaded.config
    assert loaded.kind == "gguf" and cfg.model_type == "glm4_moe"
    assert (cfg.num_layers, cfg.mtp_layers, cfg.rotary_dim, cfg.qk_norm) == (3, 1, 8, True)
    assert _max_diff(loaded, ids, expected) < TOL
