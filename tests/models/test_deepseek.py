"""DeepSeek-V2 (`deepseek_v2`): multi-head latent attention over the compressed KV cache and
DeepSeek's MoE, against HF transformers on tiny random models (tests/models/test_models_parity.py's
recipe: chunked prefill over shuffled pages, then 8 decode steps, float32 logits within `TOL`).

- Parity with q_lora_rank unset (q_proj) and set (q_a_proj / q_a_layernorm / q_b_proj), with
  yarn rope scaling whose mscale and mscale_all_dim differ (both the rope's attention factor
  and the softmax scale move), a dense first layer then MoE layers (routed + shared experts,
  routed_scaling_factor), greedy and group-limited greedy routing.
- Negative controls: Llama's half-split rope instead of DeepSeek's adjacent pairs, the plain
  (qk_head_dim ** -0.5) softmax scale without yarn's mscale, the rope's attention factor
  (mscale / mscale_all_dim) dropped, the routed scaling factor reset,
  group-limited routing switched to greedy: each must push the logits past `TOL`.
- The cache holds (kv_lora_rank + qk_rope_head_dim) numbers per token per layer, no values.
- Through the engine: the native `cpu` attention backend and `reference` give HF's greedy
  tokens, and so does tp=2 on fake devices (the latent kv head replicated, q heads split).
- At V2's real widths (576-wide rows, 512-wide values, 16 heads): the `cpu` kernel and the
  reference's blocked layout equal the reference's per-token layout, which equals a NumPy
  softmax over the rows; the Pallas backends refuse latent attention.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from test_models_parity import TOL, VOCAB, _build, _max_diff

from jengine import Engine, SamplingParams
from jengine.models import AttentionMetadata, KVCache, deepseek, model_config_from_hf
from jengine.models.attention import attend_latent
from jengine.pallas_kernels import quantize_rows
from jengine.pallas_kernels.block_layout import num_query_blocks
from jengine.pallas_kernels.reference import query_blocks

ONE_BUCKET = str(Path(__file__).parents[1] / "one_bucket.yaml")
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
        "original_max_position_embeddings": 16, "mscale": 0.707, "mscale_all_dim": 1.3}


def _config(**kw):
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=2,
        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
        routed_scaling_factor=2.5, max_position_embeddings=128, rms_norm_eps=1e-5,
        rope_parameters=YARN, tie_word_embeddings=False,
    )
    return transformers.DeepseekV2Config(**{**base, **kw})


def _control_diff(model, ids, expected) -> float:
    return _max_diff(model, ids, expected, decode_steps=0)


def _half_split_rope(x, positions, inv_freq, scale):
    from jengine.models.layers import apply_rope
    return apply_rope(x, positions, inv_freq, scale)


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_mla_parity_q_projection(tmp_path, monkeypatch):
    models: list = []
    loaded, ids, expected = _build(tmp_path, _config(), transformers.DeepseekV2ForCausalLM,
                                   edit=models.append, greedy=False)  # greedy: the engine test
    cfg = loaded.config
    assert cfg.num_params == _num_params(models[0])
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.q_lora_rank) == (1, 32 + 8, 0)
    assert cfg.first_dense_layers == 1 and cfg.shared_expert_intermediate_size == 64
    assert cfg.rope.attention_factor != 1.0 and cfg.sm_scale != pytest.approx(24 ** -0.5)
    assert _max_diff(loaded, ids, expected) < TOL
    plain = dataclasses.replace(cfg, attention_multiplier=24 ** -0.5)  # no yarn mscale
    assert _control_diff((plain, loaded.params), ids, expected) > TOL
    flat_rope = dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, attention_factor=1.0))
    assert _control_diff((flat_rope, loaded.params), ids, expected) > TOL
    unscaled = dataclasses.replace(cfg, routed_scaling_factor=1.0)
    assert _control_diff((unscaled, loaded.params), ids, expected) > TOL
    monkeypatch.setattr(deepseek, "_rope_pairs", _half_split_rope)
    retraced = dataclasses.replace(cfg, max_position_embeddings=129)  # not the cached program
    assert _control_diff((retraced, loaded.params), ids, expected) > TOL


def test_mla_parity_q_lora_group_limited(tmp_path):
    config = _config(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4,
                     topk_group=2, num_experts_per_tok=3, first_k_dense_replace=2,
                     num_hidden_layers=3)
    models: list = []
    loaded, ids, expected = _build(tmp_path, config, transformers.DeepseekV2ForCausalLM,
                                   edit=models.append, greedy=False)
    cfg = loaded.config
    assert cfg.num_params == _num_params(models[0])
    assert cfg.q_lora_rank == 24 and "wq_a" in loaded.params and "wq" not in loaded.params
    assert (cfg.expert_groups, cfg.topk_groups) == (4, 2)
    assert _max_diff(loaded, ids, expected) < TOL
    greedy = dataclasses.replace(cfg, expert_groups=0, topk_groups=0)
    assert _control_diff((greedy, loaded.params), ids, expected) > TOL
    with pytest.raises(ValueError, match="per-layer weights"):  # dense + MoE layers, stacked
        _max_diff(loaded, ids, expected, decode_steps=0, layer_layout="as_given")


def test_mla_stacked_layers_all_moe(tmp_path):
    """With every layer sparse the weights stack, and the layers run under `lax.scan`."""
    config = _config(first_k_dense_replace=0, num_hidden_layers=2, rope_parameters=None)
    loaded, ids, expected = _build(tmp_path, config, transformers.DeepseekV2ForCausalLM,
                                   greedy=False)
    assert loaded.config.first_dense_layers == 0 and loaded.config.rope.rope_type == "default"
    assert _max_diff(loaded, ids, expected, layer_layout="as_given") < TOL


def test_mla_cache_holds_latent_rows_only():
    cfg = model_config_from_hf(_config().to_dict())
    page_size = 16
    per_token = (32 + 8) * 4 * cfg.num_layers  # (kv_lora_rank + rope dim) f32, every layer
    assert KVCache.bytes_per_page(cfg, page_size, jnp.float32) == per_token * page_size
    kv = KVCache.zeros(cfg, 5, page_size, jnp.float32)
    assert kv.k.shape == (2, 1, 5, page_size, 40) and kv.v.size == 0
    assert kv.k.nbytes + kv.v.nbytes == 5 * KVCache.bytes_per_page(cfg, page_size, jnp.float32)


# DeepSeek-V2-Lite's config.json (transformers 4.x spelling), the sizes that matter here.
V2_LITE = dict(
    model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
    num_hidden_layers=27, num_attention_heads=16, kv_lora_rank=512, q_lora_rank=None,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
    n_shared_experts=2, num_experts_per_tok=6, moe_intermediate_size=1408,
    first_k_dense_replace=1, max_position_embeddings=163840, rope_theta=10000,
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                      mscale=0.707, mscale_all_dim=0.707, beta_fast=32, beta_slow=1),
    topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
)


def test_v2_lite_sizes():
    """At V2-Lite's sizes: 15.7B parameters, 576 cached numbers per token and layer (bf16:
    31,104 bytes per token over 27 layers) where full keys and values of its 16 heads would be
    16 * (192 + 128) = 5,120, and yarn's mscale in the softmax scale."""
    cfg = model_config_from_hf(V2_LITE)
    assert round(cfg.num_params / 1e9, 1) == 15.7
    assert KVCache.bytes_per_page(cfg, 16, jnp.bfloat16) == 16 * 576 * 2 * 27
    mscale = 0.1 * 0.707 * np.log(40) + 1
    assert cfg.sm_scale == pytest.approx(192 ** -0.5 * mscale ** 2)
    assert cfg.rope.attention_factor == pytest.approx(1.0)  # mscale / mscale_all_dim


def _greedy_hf(model, prompts, max_tokens):
    """HF's greedy continuation by full forwards (no early stop at eos, as `ignore_eos`)."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            seq = list(p)
            for _ in range(max_tokens):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            outs.append(seq[len(p):])
    return outs


def test_mla_engine_backends_and_tp_match_hf(tmp_path):
    models: list = []
    _build(tmp_path, _config(), transformers.DeepseekV2ForCausalLM, edit=models.append,
           greedy=False)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 19, 11)]
    expected = _greedy_hf(models[0], prompts, 16)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for kwargs in ({"attention_backend": "reference"}, {"attention_backend": "cpu"},
                   {"attention_backend": "cpu", "mesh": "tp=2"}):
        engine = Engine(str(tmp_path), config=ONE_BUCKET, dtype="float32",
                        kv_cache_memory="4MiB", max_model_len=64, **kwargs)
        outs = engine.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == expected, kwargs


def _latent_q() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((5, 16, 576)).astype(np.float32)


def _latent_step(backend: str, num_pages: int = 9, page_size: int = 16, *,
                 blocked: bool = False, dtype=jnp.float32):
    """One ragged step of `attend_latent` at DeepSeek-V2's widths (latent 512 + rope 64,
    16 q heads): a 3-token prefill chunk after 37 cached tokens, and two decodes; `blocked`:
    the reference's per-query-block layout (prefill-heavy buckets); `dtype` int8: the random
    cache quantized, one scale per latent row."""
    cfg = model_config_from_hf(_config(kv_lora_rank=512, qk_rope_head_dim=64,
                                      num_attention_heads=16).to_dict())
    rng = np.random.default_rng(0)
    kv = KVCache.zeros(cfg, num_pages, page_size, dtype)
    rows = jnp.asarray(rng.standard_normal(kv.k.shape), jnp.float32)
    if dtype == jnp.int8:
        k, k_scale = quantize_rows(rows)
        kv = dataclasses.replace(kv, k=k, k_scale=k_scale)
    else:
        kv = dataclasses.replace(kv, k=rows)
    page_table = np.asarray([[3, 7, 1, 0], [5, 0, 0, 0], [2, 8, 0, 0]], np.int32)
    seqs, positions = np.asarray([0, 0, 0, 1, 2]), np.asarray([37, 38, 39, 4, 20])
    slots = page_table[seqs, positions // page_size] * page_size + positions % page_size
    md = AttentionMetadata(
        token_ids=jnp.zeros(5, jnp.int32), positions=jnp.asarray(positions, jnp.int32),
        slot_mapping=jnp.asarray(slots, jnp.int32), token_seq=jnp.asarray(seqs, jnp.int32),
        page_table=jnp.asarray(page_table), logits_indices=jnp.asarray([2, 3, 4], jnp.int32))
    if blocked:
        tokens, block_seq = query_blocks([3, 1, 1], 5, num_query_blocks(5, 3, 2), 2)
        md = dataclasses.replace(md, block_tokens=jnp.asarray(tokens),
                                 block_seq=jnp.asarray(block_seq))
    q = jnp.asarray(_latent_q())
    rows = jnp.asarray(rng.standard_normal((5, 1, 576)), jnp.float32)
    out, kv = attend_latent(q, rows, kv, jnp.int32(1), md, value_dim=512, sm_scale=0.05,
                            backend=backend)
    return np.asarray(out), kv


def test_latent_attention_cpu_kernel_equals_reference_at_real_widths():
    ref, ref_kv = _latent_step("reference")
    assert ref.shape == (5, 16, 512)
    for got, got_kv in (_latent_step("cpu"), _latent_step("reference", blocked=True)):
        np.testing.assert_array_equal(np.asarray(got_kv.k), np.asarray(ref_kv.k))
        np.testing.assert_allclose(got, ref, atol=2e-5)
    # Token 3 decodes sequence 1 at position 4 (page 5, slots 0-4, the last its new row):
    # softmax(q . rows) over the whole rows, averaging the rows' first 512 columns.
    keys = np.asarray(ref_kv.k)[1, 0, 5, :5]  # [5, 576]
    q = _latent_q()[3]  # [16, 576]
    scores = q @ keys.T * 0.05
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    np.testing.assert_allclose(ref[3], weights @ keys[:, :512], atol=2e-5)
    with pytest.raises(ValueError, match="latent attention"):
        _latent_step("pallas_tpu")


def test_latent_attention_on_an_int8_cache():
    """An int8 cache holds each latent row with one scale (`k_scale`; `v_scale` empty): the
    `cpu` kernel equals the reference (per token and per query block), both write the same
    cache, and the result stays near the f32 cache's."""
    ref, ref_kv = _latent_step("reference", dtype=jnp.int8)
    assert ref_kv.k.dtype == jnp.int8 and ref_kv.k_scale.shape == ref_kv.k.shape[:-1] + (1,)
    assert ref_kv.v_scale.size == 0
    for got, got_kv in (_latent_step("cpu", dtype=jnp.int8),
                        _latent_step("reference", blocked=True, dtype=jnp.int8)):
        for a, b in zip(jax.tree.leaves(got_kv), jax.tree.leaves(ref_kv), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_allclose(got, ref, atol=2e-5)
    np.testing.assert_allclose(ref, _latent_step("reference")[0], atol=0.05)
