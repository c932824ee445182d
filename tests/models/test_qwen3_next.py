"""Qwen3-Next (`qwen3_next`): Qwen3.5's hybrid with a sparse MoE + gated shared expert in every
layer, against HF transformers on a tiny random model: an 80-token sequence (past HF's DeltaNet
chunk of 64) prefilled in chunks of 16 over shuffled pages, then 8 decode steps, float32 logits
within `TOL` (tests/models/test_models_parity.py's bar).

Two key heads with two value heads each make the per-key-head grouping of `in_proj_qkvz`
matter: read as a plain projection (the negative control `ungrouped`) it moves the logits past
`TOL`, as does halving the shared expert's gate. The config tests read the spellings of the
published Qwen3-Next-80B-A3B config (no `layer_types`; `full_attention_interval`, top-level rope
keys, `decoder_sparse_step`, `mlp_only_layers`); a model with dense MLP layers among the
sparse ones matches HF too. The engine's greedy batch (slow tier) is the 16-token check through
`Engine.generate`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from paged import run_paged
from safetensors.numpy import load_file
from test_deepseek import ONE_BUCKET, _greedy_hf
from test_models_parity import TOL, VOCAB, _build
from test_qwen3_5 import _gated_norms_near_one

from jengine import Engine, SamplingParams
from jengine.models import model_config_from_hf

GREEDY = 16
LONG = 80  # prompt + decode tokens, past HF's DeltaNet chunk of 64


def _config(**kw):
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention",
                     "linear_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=256,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=True,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25},
    )
    return transformers.Qwen3NextConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """The tiny model saved by HF and loaded by jengine, an 80-token sequence and HF's logits
    over it. (`_build`'s own short-prompt parity and greedy batch are left to the long
    sequence here and to the engine's greedy run: each costs compiles.)"""
    path = tmp_path_factory.mktemp("qwen3_next")
    loaded, _, _ = _build(path, _config(), transformers.Qwen3NextForCausalLM, norm_offset=0.0,
                          edit=_gated_norms_near_one, greedy=False)
    model = transformers.Qwen3NextForCausalLM.from_pretrained(path).eval()
    ids = np.random.default_rng(4).integers(3, VOCAB, LONG).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].float().numpy()
    return loaded, ids, expected, sum(p.numel() for p in model.parameters())


def _paged_diff(model, ids, expected) -> float:
    """Chunked prefill (chunks of 16 over pages of 4; the per-layer weights of the CPU default)
    of all but the last 8 tokens, then 8 decode steps: the largest logit difference."""
    got = run_paged(model, ids, prefill_chunk=16, decode_steps=8, page_size=4,
                    layer_layout="unstacked")
    assert got.shape == expected.shape and np.isfinite(got).all()
    return float(np.abs(got - expected).max())


def test_qwen3_next_logits_match_hf(qwen3_next):
    loaded, ids, expected, num_params = qwen3_next
    cfg = loaded.config
    assert cfg.num_params == num_params  # the MoE counted in every layer
    assert cfg.linear_layers == (True, False, True, True)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (8, 2, True)
    assert loaded.params["lin_qkvz"].shape[0] == 3 and "w_gate" not in loaded.params
    assert _paged_diff(loaded, ids, expected) < TOL


def _ungrouped(loaded) -> np.ndarray:
    """`lin_qkvz` as a plain projection of HF's rows (no regrouping by kind)."""
    weights = load_file(f"{loaded.source}/model.safetensors")
    return np.stack([weights[f"model.layers.{i}.linear_attn.in_proj_qkvz.weight"].T
                     for i in (0, 2, 3)])


@pytest.mark.parametrize("wrong", ["ungrouped", "shared_gate"])
def test_qwen3_next_negative_controls(qwen3_next, wrong):
    """Weights only change: the parity run's compiled programs serve these too."""
    loaded, ids, expected, _ = qwen3_next
    params = dict(loaded.params)
    if wrong == "ungrouped":
        params["lin_qkvz"] = _ungrouped(loaded)
    else:
        params["ws_router"] = np.zeros_like(params["ws_router"])  # sigmoid(0) = 1/2
    assert _paged_diff((loaded.config, params), ids, expected) > TOL, wrong


def _published(**kw) -> dict:
    """Qwen3-Next-80B-A3B-Instruct's config.json spellings, at a tiny size: no `layer_types`
    (`full_attention_interval`), rope keys at the top level, `decoder_sparse_step` and an
    empty `mlp_only_layers`."""
    return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
            "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 8, "linear_value_head_dim": 12, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48, "norm_topk_prob": True,
            "rope_theta": 10000000, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 262144, "tie_word_embeddings": False, **kw}


def test_qwen3_next_reads_the_published_config():
    cfg = model_config_from_hf(_published())
    assert cfg.linear_layers == (True, True, True, False) * 2
    assert (cfg.rotary_dim, cfg.rope.theta) == (4, 10000000)
    assert (cfg.num_experts, cfg.shared_expert_intermediate_size) == (8, 48)
    assert cfg.shared_expert_gate and cfg.norm_topk_prob
    without = {k: v for k, v in _published().items() if k != "norm_topk_prob"}
    assert model_config_from_hf(without).norm_topk_prob  # Qwen3NextConfig's default


@pytest.mark.parametrize(("spelling", "dense"), [
    ({"mlp_only_layers": [2]}, tuple(i == 2 for i in range(8))),
    ({"decoder_sparse_step": 2}, (True, False) * 4),
    ({"num_experts": 0}, ()),  # no experts: Qwen3.5's dense MLP on every layer
])
def test_qwen3_next_reads_the_dense_mlp_layers(spelling, dense):
    cfg = model_config_from_hf(_published(**spelling))
    assert cfg.dense_mlp_layers == dense
    assert cfg.num_experts == (8 if dense else 0)


def test_qwen3_next_dense_layers_among_sparse_match_hf(tmp_path):
    """`mlp_only_layers` [1, 2]: an attention and a linear layer with a dense MLP, the MoE on
    the two others; each kind's weights stack over its own layers (the stacked layout, whose
    per-layer slicing follows `layer_ordinals`). Prefill only: one compiled program."""
    loaded, _, _ = _build(tmp_path, _config(mlp_only_layers=[1, 2]),
                          transformers.Qwen3NextForCausalLM, norm_offset=0.0,
                          edit=_gated_norms_near_one, greedy=False)
    model = transformers.Qwen3NextForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.dense_mlp_layers == (False, True, True, False)
    assert loaded.config.num_params == sum(p.numel() for p in model.parameters())
    assert loaded.params["w_gate"].shape[0] == 2 and loaded.params["router"].shape[0] == 2
    ids = np.random.default_rng(4).integers(3, VOCAB, LONG).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].float().numpy()
    got = run_paged(loaded, ids, prefill_chunk=16, decode_steps=0, page_size=4,
                    layer_layout="as_given")
    assert np.abs(got - expected).max() < TOL


@pytest.fixture(scope="module")
def greedy_batch(qwen3_next):
    """Four prompts (one of 70 tokens: it prefills in chunks while the others decode) and HF's
    16 greedy tokens for each."""
    model = transformers.Qwen3NextForCausalLM.from_pretrained(qwen3_next[0].source).eval()
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 70, 11, 23)]
    return prompts, _greedy_hf(model, prompts, GREEDY)


@pytest.mark.slow  # ~20 s of engine build and run; CI: the paged logits parity above
@pytest.mark.parametrize("mesh", ["tp=1", "tp=2"])
def test_qwen3_next_engine_greedy_matches_hf(qwen3_next, greedy_batch, mesh):
    """16 greedy tokens of a mixed batch through `Engine.generate` (one step shape, T=16)
    equal HF's. Under tp=2 the attention heads, the MLP axis of every expert and the shared
    expert split; the linear layers and their states stay replicated."""
    prompts, expected = greedy_batch
    engine = Engine(str(qwen3_next[0].source), config=ONE_BUCKET, dtype="float32",
                    kv_cache_memory="4MiB", max_model_len=128, mesh=mesh,
                    attention_backend="cpu", warmup=True)
    outs = engine.generate(prompts, SamplingParams(max_tokens=GREEDY, temperature=0,
                                                   ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert engine.core.scheduler.state_slots.num_free == 16  # every state slot back
