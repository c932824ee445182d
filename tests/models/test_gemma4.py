"""Gemma 4 text (`gemma4_text`) against HF transformers on tiny random models
(tests/models/test_models_parity.py's recipe: chunked prefill over shuffled pages, 8 decode
steps, float32 logits within `TOL`), dense and MoE: 3 layers sliding / sliding / full (HF makes
the last layer global), a window of 5 tokens that the 30-token sequence passes, random layer
scalars, a global rope that turns a quarter of its frequency pairs and a final soft cap.
Negative controls, each pushing the logits past `TOL`: no window, the global rope turning every
pair, the sliding layers' rope on the global ones, unit layer scalars; for MoE unit expert
scales and zeroed experts. Slow tier: 16 greedy tokens of a mixed batch through
`Engine.generate` equal HF's. Configurations with what is not built are refused, one line each.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import transformers
from test_deepseek import ONE_BUCKET, _greedy_hf
from test_models_parity import TOL, VOCAB, WINDOW, _build, _max_diff

from jengine import Engine, SamplingParams
from jengine.models import gemma4, model_config_from_hf


def _config(**kw):
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=16,
        sliding_window=WINDOW, hidden_size_per_layer_input=0, max_position_embeddings=128,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 100.0},
        },
        rms_norm_eps=1e-6, final_logit_softcapping=30.0,
    )
    return transformers.Gemma4TextConfig(**{**base, **kw})


MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)


def _scalars(model) -> None:
    """Layer scalars away from 1 (HF keeps them as buffers, which `randomize` leaves at 1)."""
    for i, layer in enumerate(model.model.layers):
        layer.layer_scalar.fill_(0.5 + 0.4 * i)


def _control(cfg, params, ids, expected) -> float:
    return _max_diff((cfg, params), ids, expected, decode_steps=0)


def _checked(tmp_path, config, *, controls: bool):
    models: list = []
    loaded, ids, expected = _build(tmp_path, config, transformers.Gemma4ForCausalLM,
                                   edit=lambda m: (_scalars(m), models.append(m)), greedy=False)
    cfg, params = loaded.config, loaded.params
    assert cfg.model_type == "gemma4_text"
    assert cfg.sliding_layers == (True, True, False) and cfg.sliding_window == WINDOW
    assert cfg.partial_rotary_factor == 0.25 and cfg.local_rope.theta == 10.0
    assert _max_diff(loaded, ids, expected) < TOL
    if controls:
        assert _max_diff(loaded, ids, expected, layer_layout="as_given") < TOL  # stacked + scan
        for wrong in (dict(sliding_window=None), dict(partial_rotary_factor=1.0),
                      dict(local_rope=cfg.rope)):
            assert _control(dataclasses.replace(cfg, **wrong), params, ids, expected) > TOL, wrong
        unscaled = {**params, "layer_scalar": np.ones_like(params["layer_scalar"])}
        assert _control(cfg, unscaled, ids, expected) > TOL
    return cfg, params, ids, expected


def test_gemma4_text_moe(tmp_path):
    """The default tier's parity: the MoE variant runs the dense MLP too (beside the experts;
    the prefill chunks take the dense expert path, the decodes the gathered one)."""
    cfg, params, ids, expected = _checked(tmp_path, _config(**MOE), controls=False)
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (4, 2)
    flat = {**params, "per_expert_scale": np.ones_like(params["per_expert_scale"])}
    assert _control(cfg, flat, ids, expected) > TOL


@pytest.mark.slow
def test_gemma4_text(tmp_path):
    """Slow tier (CI: the MoE variant's parity, whose layers hold the same dense path): the
    dense variant's parity, per layer and stacked under `lax.scan`, and the negative controls
    of the window, the two ropes and the layer scalars."""
    _checked(tmp_path, _config(), controls=True)


RUNS = ({"attention_backend": "reference"}, {"attention_backend": "cpu"},
        {"attention_backend": "cpu", "mesh": "tp=2"})


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, MOE], ids=["dense", "moe"])
def test_gemma4_engine_greedy_matches_hf(tmp_path, kw):
    """16 greedy tokens of three prompts (5, 19, 11 tokens: two past the window) decoded
    together by `Engine.generate` equal HF's, on the reference and native `cpu` attention and
    under tp=2."""
    models: list = []
    _build(tmp_path, _config(**kw), transformers.Gemma4ForCausalLM,
           edit=lambda m: (_scalars(m), models.append(m)), greedy=False)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 19, 11)]
    expected = _greedy_hf(models[0], prompts, 16)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for run in RUNS:
        engine = Engine(str(tmp_path), config=ONE_BUCKET, dtype="float32",
                        kv_cache_memory="4MiB", max_model_len=64, **run)
        assert [o.outputs[0].token_ids for o in engine.generate(prompts, params)] == expected, run


def _hf_dict(**kw) -> dict:
    return {**_config().to_dict(), **kw}


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size_per_layer_input=256), "per-layer input embeddings"),
    (dict(num_kv_shared_layers=1), "KV shared across layers"),
    (dict(attention_k_eq_v=True), "keys reused as values"),
    (dict(per_layer_config=None, global_head_dim=32), "their own head width"),
    (dict(per_layer_config=None, layer_types=None), "their own head width"),  # HF's 512
    (dict(per_layer_config={"2": {"num_key_value_heads": 1}}), "their own KV heads"),
    (dict(use_bidirectional_attention="all"), "bidirectional"),
])
def test_gemma4_refuses_what_is_not_built(change, message):
    """A config.json without `per_layer_config` (the published ones) gives the global layers
    `global_head_dim` (HF's default 512) and, with `attention_k_eq_v`, their own KV heads."""
    hf = {k: v for k, v in _hf_dict(**change).items() if v is not None or k not in change}
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(hf)


def test_gemma4_global_rope_turns_its_first_quarter():
    cfg = model_config_from_hf(_hf_dict())
    inv = gemma4.global_inv_freq(cfg)  # [8] for head_dim 16
    assert (inv[:2] > 0).all() and (inv[2:] == 0).all()
    assert inv[1] == pytest.approx(100.0 ** (-2 / 16))
