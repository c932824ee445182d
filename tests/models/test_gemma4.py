"""Gemma 4 text (`gemma4_text`) against HF transformers on tiny random models
(tests/models/test_models_parity.py's recipe: chunked prefill over shuffled pages, 8 decode
steps, float32 logits within `TOL`), dense and MoE: 3 layers sliding / sliding / full (HF makes
the last layer global), a window of 5 tokens that the 30-token sequence passes, random layer
scalars, a global rope that turns a quarter of its frequency pairs and a final soft cap.
Negative controls, each pushing the logits past `TOL`: no window, the global rope turning every
pair, the sliding layers' rope on the global ones, unit layer scalars; for MoE unit expert
scales. The 26B-A4B / 31B layout small (global heads twice as wide, one global KV head against
two, values that are the keys) per layer and stacked, and as a multimodal checkpoint's text
model. Slow tier: the dense controls, and 16 greedy tokens of a mixed batch through
`Engine.generate` equal HF's for every variant on `reference`, `cpu` and tp=2. Configurations
with what is not built are refused, one line each.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file
from test_deepseek import ONE_BUCKET, _greedy_hf
from test_models_parity import SEQ_LEN, TOL, VOCAB, WINDOW, _build, _max_diff
from tiny_models import randomize, save_tokenizer

from converters import load_source
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


TWO_KINDS = dict(head_dim=8, global_head_dim=16, attention_k_eq_v=True,
                 num_global_key_value_heads=1)


def _build_two_kinds(tmp_path, config):
    """`_build` for a config whose global layers have their own shape: HF's `to_dict` writes
    an empty `per_layer_config` and drops `global_head_dim`, so the saved config.json is made
    what the published ones are (no `per_layer_config`, the global shape as keys)."""
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    model = transformers.Gemma4ForCausalLM(config).eval()
    randomize(model, norm_offset=1.0)
    with torch.no_grad():
        _scalars(model)
    model.save_pretrained(tmp_path)
    save_tokenizer(tmp_path, VOCAB)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved.pop("per_layer_config", None)
    saved.update(global_head_dim=16, num_global_key_value_heads=1)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    ids = np.random.default_rng(2).integers(3, VOCAB, SEQ_LEN).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].float().numpy()
    return model, load_source(str(tmp_path), dtype="float32", progress=False), ids, expected


def test_gemma4_text_global_layers_of_their_own_shape(tmp_path):
    """26B-A4B's and 31B's layout, small: global heads twice as wide as the sliding ones (the
    cache takes the wider; the sliding layers' heads are zero-padded into it), one global KV
    head against two sliding ones (repeated into the cache), the global values their keys, and
    the MoE block. Per-layer weights, and the stacks sliced by layer (the stacked layout)."""
    _, loaded, ids, expected = _build_two_kinds(tmp_path, _config(**TWO_KINDS, **MOE))
    cfg, params = loaded.config, loaded.params
    assert (cfg.head_dim, cfg.sliding_head_dim, cfg.num_kv_heads, cfg.global_kv_heads) == (
        16, 8, 2, 1)
    assert params["wk_g"].shape == (1, 64, 1, 16) and "wv_g" not in params
    assert params["wq"].shape == (2, 64, 4, 8)
    assert _max_diff(loaded, ids, expected) < TOL
    assert _max_diff(loaded, ids, expected, layer_layout="as_given") < TOL
    wide = dataclasses.replace(cfg, partial_rotary_factor=1.0)  # the global layers matter
    assert _control(wide, params, ids, expected) > TOL


def test_gemma4_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """A `Gemma4ForConditionalGeneration` checkpoint's layout (config under `text_config`,
    text weights under `model.language_model.`, towers beside them): the text model's logits."""
    _, _, ids, expected = _build_two_kinds(tmp_path, _config(**TWO_KINDS, **MOE))
    text = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
         "text_config": text, "vision_config": {"hidden_size": 8}}))
    [shard] = tmp_path.glob("*.safetensors")
    weights = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(shard).items()}
    for tower in ("model.vision_tower.x", "model.audio_tower.x", "model.embed_vision.x"):
        weights[tower] = np.zeros(2, np.float32)
    save_file(weights, shard)
    loaded = load_source(str(tmp_path), dtype="float32", progress=False)
    assert loaded.config.model_type == "gemma4_text"
    assert _max_diff(loaded, ids, expected, decode_steps=0) < TOL


@pytest.mark.slow
def test_gemma4_two_kinds_engine_greedy_matches_hf(tmp_path):
    """The layout above through `Engine.generate`: 16 greedy tokens of a mixed batch equal
    HF's on the reference and `cpu` attention and under tp=2 (the sliding KV heads split, the
    one global KV head repeated into both shards)."""
    model, *_ = _build_two_kinds(tmp_path, _config(**TWO_KINDS, **MOE))
    _engine_runs_match(tmp_path, model)


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
    _engine_runs_match(tmp_path, models[0])


def _engine_runs_match(tmp_path, model) -> None:
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 19, 11)]
    expected = _greedy_hf(model, prompts, 16)
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
    (dict(per_layer_config=None, global_head_dim=8), "narrower heads"),
    (dict(per_layer_config={"2": {"num_key_value_heads": 4}}), "more KV heads"),
    (dict(use_bidirectional_attention="all"), "bidirectional"),
])
def test_gemma4_refuses_what_is_not_built(change, message):
    hf = {k: v for k, v in _hf_dict(**change).items() if v is not None or k not in change}
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(hf)


def test_gemma4_reads_the_global_shape_as_hf_does():
    """A config.json without `per_layer_config` (the published ones) gives the global layers
    `global_head_dim` (HF's default 512, also where `layer_types` is left out) and, with
    `attention_k_eq_v`, `num_global_key_value_heads`; the cache takes the wider heads."""
    base = {k: v for k, v in _hf_dict().items() if k != "per_layer_config"}
    cfg = model_config_from_hf({**base, "global_head_dim": 32})
    assert (cfg.head_dim, cfg.sliding_head_dim, cfg.global_kv_heads) == (32, 16, 0)
    cfg = model_config_from_hf({k: v for k, v in base.items() if k != "layer_types"})
    assert (cfg.head_dim, cfg.sliding_head_dim) == (512, 16)
    cfg = model_config_from_hf({**base, "global_head_dim": 16, "attention_k_eq_v": True,
                                "num_global_key_value_heads": 1})
    assert (cfg.head_dim, cfg.sliding_head_dim, cfg.global_kv_heads) == (16, 0, 1)
    assert cfg.global_values_are_keys and gemma4.two_kinds(cfg)


def test_gemma4_global_rope_turns_its_first_quarter():
    cfg = model_config_from_hf(_hf_dict())
    inv = gemma4.global_inv_freq(cfg)  # [8] for head_dim 16
    assert (inv[:2] > 0).all() and (inv[2:] == 0).all()
    assert inv[1] == pytest.approx(100.0 ** (-2 / 16))
