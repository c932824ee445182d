"""GLM-4.5 (`glm4_moe`) against HF transformers on a tiny random model (tests/models/
test_models_parity.py's recipe: chunked prefill over shuffled pages, 8 decode steps, float32
logits within `TOL`; then the engine's greedy tokens, alone and under tp=2).

Negative controls, each pushing the logits past `TOL`: the correction bias zeroed, the rotary
over the whole head instead of its first half, the q/k norm dropped, the shared experts dropped.
"""

from __future__ import annotations

import dataclasses

import transformers
from test_deepseek import _num_params
from test_deepseek_v3 import _random_bias, engine_greedy_matches_hf
from test_models_parity import TOL, VOCAB, _build, _max_diff


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
