"""gpt-oss (`gpt_oss`) against HF transformers on a tiny random model (tests/models/
test_models_parity.py's recipe: chunked prefill over shuffled pages, 8 decode steps, float32
logits within `TOL`), with a sliding window of 5 tokens on the first of two layers (the
30-token sequence passes it), YaRN rope past its original 16 positions, sinks of a size that
matters and a SwiGLU limit of 1.0 that the random activations cross; and its experts stored as
MXFP4 by our own packer, read as transformers dequantizes them. Slow tier (CI checks the sinks
of the `cpu` kernel against float64 in tests/kernels/test_attention_sinks.py): the same logits
on the native `cpu` backend, negative controls (no sinks, no clamp, no window, the rope without
YaRN, the experts' gate and up columns read as halves instead of interleaved), and through the
engine 16 greedy tokens of three prompts (5, 19, 11 tokens) decoded together equal HF's on
`reference`, `cpu` and `cpu` under tp=2, while a Pallas backend asked for by name is refused at
start.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file
from test_deepseek import ONE_BUCKET, _num_params
from test_deepseek_v3 import engine_greedy_matches_hf
from test_models_parity import TOL, VOCAB, WINDOW, _build, _max_diff
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from converters import load_source, mxfp4
from jengine import Engine
from jengine.models import moe
from jengine.models.config import RopeConfig

YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}


def gpt_oss_config(**kw):
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=WINDOW, rope_parameters=YARN,
        max_position_embeddings=64, rms_norm_eps=1e-5, swiglu_limit=1.0,
        tie_word_embeddings=False,
    )
    return transformers.GptOssConfig(**{**base, **kw})


def big_sinks(model) -> None:
    """Sink logits of the scores' size (randomize's are ~0.5), some heads' above most scores."""
    gen = torch.Generator().manual_seed(4)
    for layer in model.model.layers:
        sinks = layer.self_attn.sinks
        sinks.copy_(2.0 * torch.randn(sinks.shape, generator=gen))


def _control(cfg, params, ids, expected) -> float:
    return _max_diff((cfg, params), ids, expected, decode_steps=0)


_clamped_swiglu = moe.clamped_swiglu


def _halves(gate_up, cfg):
    """The wrong reading of the fused weight: gate the first F columns, up the last F."""
    f = gate_up.shape[-1] // 2
    return _clamped_swiglu(
        jnp.stack([gate_up[..., :f], gate_up[..., f:]], -1).reshape(gate_up.shape), cfg)


def _built(tmp_path, **kw):
    models: list = []
    loaded, ids, expected = _build(tmp_path, gpt_oss_config(), transformers.GptOssForCausalLM,
                                   edit=lambda m: (big_sinks(m), models.append(m)), **kw)
    return models[0], loaded, ids, expected


def test_gpt_oss(tmp_path):
    model, loaded, ids, expected = _built(tmp_path, greedy=False)
    cfg = loaded.config
    assert cfg.model_type == "gpt_oss" and cfg.num_params == _num_params(model)
    assert cfg.sliding_layers == (True, False) and cfg.rope.rope_type == "yarn"
    assert _max_diff(loaded, ids, expected) < TOL


@pytest.mark.slow
def test_gpt_oss_cpu_backend_and_negative_controls(tmp_path, monkeypatch):
    _, loaded, ids, expected = _built(tmp_path, greedy=False)
    cfg, params = loaded.config, loaded.params
    native = dataclasses.replace(cfg, attention_backend="cpu")
    assert _max_diff((native, params), ids, expected) < TOL
    no_sinks = {k: v for k, v in params.items() if k != "sinks"}
    assert _control(cfg, no_sinks, ids, expected) > TOL
    for wrong in (dict(swiglu_limit=100.0), dict(sliding_window=None),
                  dict(rope=RopeConfig(theta=1e4))):
        assert _control(dataclasses.replace(cfg, **wrong), params, ids, expected) > TOL, wrong
    monkeypatch.setattr(moe, "clamped_swiglu", _halves)
    retraced = dataclasses.replace(cfg, max_position_embeddings=130)  # not the cached program
    assert _control(retraced, params, ids, expected) > TOL


@pytest.mark.slow
def test_gpt_oss_engine_greedy_and_backends(tmp_path):
    engine_greedy_matches_hf(tmp_path, gpt_oss_config(), transformers.GptOssForCausalLM,
                             ({"attention_backend": "reference"}, {"attention_backend": "cpu"},
                              {"attention_backend": "cpu", "mesh": "tp=2"}))
    with pytest.raises(ValueError, match="sinks"):
        Engine(str(tmp_path), config=ONE_BUCKET, dtype="float32", kv_cache_memory="4MiB",
               max_model_len=64, attention_backend="pallas_gpu")


def pack_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Our own MXFP4 packer: float [..., R, I] (I a multiple of 32) -> blocks uint8
    [..., R, I / 32, 16] (two e2m1 codes a byte, the low nibble first) and e8m0 scales uint8
    [..., R, I / 32]; each group's scale the least power of two that fits its largest value
    into e2m1's 6, each value rounded to the nearest code."""
    groups = w.reshape(*w.shape[:-1], -1, mxfp4.GROUP).astype(np.float64)
    amax = np.abs(groups).max(-1)
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127)
    exp = np.clip(exp, -127, 127).astype(np.int32)
    scaled = groups / np.ldexp(1.0, exp)[..., None]
    codes = np.abs(np.abs(scaled)[..., None] - mxfp4.E2M1[:8]).argmin(-1)
    codes = (codes + 8 * (scaled < 0)).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    # C order: safetensors' numpy writer copies an array's buffer whatever its strides.
    return np.ascontiguousarray(blocks), np.ascontiguousarray(exp + 127, np.uint8)


def _as_mxfp4_checkpoint(path) -> dict[str, np.ndarray]:
    """Rewrites the saved model's expert weights [X, in, out] as MXFP4 pairs of their [X, out,
    in] rows, the way the published checkpoints store them; returns the float originals."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    originals = {}
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        originals[key] = tensors.pop(key)
        blocks, scales = pack_mxfp4(np.swapaxes(originals[key], 1, 2))
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
    save_file(tensors, str(file), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (path / "config.json").write_text(json.dumps(config))
    return originals


def test_gpt_oss_mxfp4_experts(tmp_path):
    """The experts stored as MXFP4 load as transformers' own dequantization of them, on the
    eager and the lazy (sharded) paths, and the logits match HF's model holding those
    dequantized experts."""
    model, _, ids, _ = _built(tmp_path, greedy=False)
    originals = _as_mxfp4_checkpoint(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    loaded = load_source(str(tmp_path), dtype="float32", progress=False)
    lazy = load_source(str(tmp_path), dtype="float32", progress=False, lazy=True)
    with torch.no_grad():
        for key, original in originals.items():
            layer = int(key.split(".")[2])
            theirs = convert_moe_packed_tensors(
                torch.from_numpy(tensors[key + "_blocks"]),
                torch.from_numpy(tensors[key + "_scales"]), dtype=torch.float32)
            name = "we_gate_up" if "gate_up" in key else "we_down"
            np.testing.assert_array_equal(np.asarray(loaded.params[name])[layer], theirs.numpy())
            np.testing.assert_array_equal(np.asarray(lazy.params[name][layer:layer + 1, 1:3, 5:40]),
                                          theirs.numpy()[None, 1:3, 5:40])
            assert 0 < np.abs(theirs.numpy() - original).max() < 0.5 * np.abs(original).max()
            model.get_parameter(key).copy_(theirs)
        expected = model(torch.tensor([ids])).logits[0].float().numpy()
    assert _max_diff(loaded, ids, expected) < TOL
