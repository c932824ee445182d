"""Granite 4 (`granitemoehybrid`): Mamba2 layers mixed with attention, MoE + shared expert (or
the shared MLP alone), against HF transformers on tiny random models
(tests/models/test_models_parity.py's recipe: chunked prefill of 7 over shuffled pages of 4,
8 decode steps, float32 logits within `TOL`, and 16 greedy tokens of a mixed batch).

The long prompt (`LONG` tokens) is longer than HF's Mamba2 chunk (`CHUNK`), so HF runs its
chunked (SSD) form while jengine carries the state token by token across its prefill chunks.
Negative controls: the conv's taps reversed, no decay (A_log), the D skip, the gated norm's
groups taken as one; each must move the logits past `TOL`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from kv_pool import small_kv_pool
from paged import run_paged
from test_deepseek import ONE_BUCKET, _greedy_hf
from test_models_parity import TOL, VOCAB, _build, _check_greedy, _max_diff

from jengine import Engine, SamplingParams
from jengine.models import model_config_from_hf

CHUNK = 16
LONG = 40  # prompt + decode tokens, past HF's Mamba2 chunk
TYPES = ["mamba", "attention", "mamba", "mamba"]


def _config(**kw):
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, layer_types=TYPES, mamba_n_heads=8,
        mamba_n_groups=2, mamba_d_state=8, mamba_d_head=16, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=CHUNK, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=48, position_embedding_type="rope", max_position_embeddings=256,
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
        logits_scaling=3.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    return transformers.GraniteMoeHybridConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def granite4(tmp_path_factory):
    path = tmp_path_factory.mktemp("granite4")
    loaded, ids, expected = _build(path, _config(), transformers.GraniteMoeHybridForCausalLM,
                                   greedy=False)
    model = transformers.GraniteMoeHybridForCausalLM.from_pretrained(path).eval()
    long_ids = np.random.default_rng(4).integers(3, VOCAB, LONG).tolist()
    with torch.no_grad():
        long_expected = model(torch.tensor([long_ids])).logits[0].float().numpy()
    return loaded, (ids, expected), (long_ids, long_expected), model


def test_granite4_reads_the_hybrid_config(granite4):
    cfg = granite4[0].config
    assert cfg.linear_layers == (True, False, True, True) and cfg.linear_mixer == "mamba2"
    assert (cfg.num_kv_layers, cfg.num_linear_layers) == (1, 3)
    # groups, d_state, heads, head width; conv channels 128 + 2 * 2 * 8
    assert (cfg.linear_k_heads, cfg.linear_k_dim, cfg.linear_v_heads, cfg.linear_v_dim) == (
        2, 8, 8, 16)
    assert cfg.linear_conv_dim == 160 and cfg.num_experts == 4
    assert cfg.num_params == sum(p.numel() for p in granite4[3].parameters())
    assert granite4[0].params["wq"].shape[0] == 1 and granite4[0].params["m_xbc"].shape[0] == 3


def test_granite4_logits_match_hf(granite4):
    loaded, (ids, expected), _, _ = granite4
    assert _max_diff(loaded, ids, expected) < TOL


@pytest.mark.slow  # ~25 s; CI: test_granite4_logits_match_hf (a 22-token prefill past CHUNK)
def test_granite4_prompt_past_the_mamba_chunk(granite4):
    loaded, _, (ids, expected), _ = granite4
    assert _max_diff(loaded, ids, expected) < TOL
    got = run_paged(loaded, ids, prefill_chunk=16, decode_steps=8, page_size=4,
                    layer_layout="as_given")
    assert np.abs(got - expected).max() < TOL


@pytest.mark.parametrize("wrong", ["taps", "decay", "skip", "norm_groups"])
def test_granite4_negative_controls(granite4, wrong):
    import dataclasses

    loaded, (ids, expected), _, _ = granite4
    cfg, params = loaded.config, dict(loaded.params)
    if wrong == "taps":
        params["m_conv"] = np.asarray(params["m_conv"])[:, ::-1]
    elif wrong == "decay":
        params["m_a_log"] = np.full_like(params["m_a_log"], -30.0)  # no decay
    elif wrong == "skip":
        params["m_d"] = np.zeros_like(params["m_d"])
    else:
        cfg = dataclasses.replace(cfg, linear_k_heads=1, linear_k_dim=16)  # same widths
    diff = _max_diff((cfg, params), ids, expected, decode_steps=0, layer_layout="as_given")
    assert diff > TOL, wrong


@pytest.mark.slow  # ~15 s; CI: the MoE model's parity (the same mixer and attention)
def test_granite4_dense_without_rope(tmp_path):
    """The dense variant (no experts: the shared MLP alone) without rope, as Granite 4.0-H
    Micro is published."""
    config = _config(num_local_experts=0, position_embedding_type="nope")
    loaded, ids, expected = _build(tmp_path, config, transformers.GraniteMoeHybridForCausalLM)
    assert loaded.config.num_experts == 0 and loaded.config.rope_layers == (False,) * 4
    assert _max_diff(loaded, ids, expected) < TOL


@pytest.mark.slow  # ~20 s; CI: test_granite4_logits_match_hf (prefill chunks, 8 decodes)
def test_granite4_greedy_batch_matches_hf(granite4):
    """16 greedy tokens of three prompts decoded together over the paged cache."""
    loaded, (ids, _), _, model = granite4
    _check_greedy(model, loaded, [ids[:5], ids[:11], ids[:3]])


@pytest.mark.slow  # ~40 s: a whole engine; CI: the greedy batch over the paged cache
def test_granite4_engine_greedy_matches_hf(granite4):
    """A mixed batch through the engine (one step shape, T=16): the 70-token prompt prefills
    in chunks while the others decode beside it, each sequence in its own state slot; then
    again with 9 KV pages of 16 (the four need 13), so sequences are preempted and recompute
    their state from position 0 (or from a snapshot of their own); a shared prefix hits the
    prefix cache and resumes from a state snapshot."""
    loaded, _, _, model = granite4
    engine = Engine(str(loaded.source), config=ONE_BUCKET, dtype="float32",
                    kv_cache_memory="4MiB", max_model_len=128)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 70, 11, 23)]
    expected = _greedy_hf(model, prompts, 16)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    core = engine.core
    assert core.scheduler.state_slots.num_free == 16
    # A prompt sharing the 70-token one's first 50 resumes from the Mamba2 state snapshot
    # taken at a page boundary (the prefix cache's snapshots are generic over the state).
    second = prompts[1][:50] + rng.integers(3, VOCAB, 9).tolist()
    [hit] = engine.generate([second], params)
    assert hit.num_cached_tokens >= 32
    assert hit.outputs[0].token_ids == _greedy_hf(model, [second], 16)[0]
    core.reset_prefix_cache()
    before = core.scheduler.num_preemptions
    with small_kv_pool(core, 10):
        outs = engine.generate(prompts, params)
        assert core.scheduler.num_preemptions > before
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.slow  # ~40 s: a whole engine on two devices; CI: Qwen3.5's tp=2 run (same state)
def test_granite4_tp2_matches_hf(granite4):
    """Under tp=2 the attention heads, the experts' and the shared MLP's columns split; the
    Mamba2 weights and every recurrent state stay replicated on both devices."""
    loaded, _, _, model = granite4
    engine = Engine(str(loaded.source), config=ONE_BUCKET, dtype="float32",
                    kv_cache_memory="4MiB", max_model_len=128, mesh="tp=2",
                    attention_backend="cpu")
    rng = np.random.default_rng(6)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 40, 11)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0,
                                                   ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == _greedy_hf(model, prompts, 16)


@pytest.mark.parametrize("key,types", [
    ("layer_types", ["mamba", "attention", "mamba", "mamba"]),
    ("layers_block_type", ["mamba", "attention", "mamba", "mamba"]),
    ("layer_types", ["linear_attention", "full_attention", "linear_attention",
                     "linear_attention"]),
])
def test_granite4_config_spellings(key, types):
    hf = json.loads(_config().to_json_string())
    hf.pop("layer_types", None)
    hf[key] = types
    assert model_config_from_hf(hf).linear_layers == (True, False, True, True)


def test_granite4_published_config():
    """Granite 4.0-H Tiny's config.json as published: "mamba" / "attention" layer names,
    no rope ("nope"), 64 experts + a shared expert, tied embeddings."""
    types = ["mamba"] * 5 + ["attention"] + ["mamba"] * 9 + ["attention"]
    hf = {"model_type": "granitemoehybrid", "vocab_size": 100352, "hidden_size": 1536,
          "intermediate_size": 512, "num_hidden_layers": 16, "num_attention_heads": 12,
          "num_key_value_heads": 4, "layer_types": types, "position_embedding_type": "nope",
          "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1,
          "mamba_d_conv": 4, "mamba_expand": 2, "mamba_conv_bias": True,
          "mamba_proj_bias": False, "num_local_experts": 64, "num_experts_per_tok": 6,
          "shared_intermediate_size": 1024, "embedding_multiplier": 12,
          "attention_multiplier": 0.0078125, "residual_multiplier": 0.22, "logits_scaling": 6,
          "rope_theta": 10000, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
          "tie_word_embeddings": True}
    cfg = model_config_from_hf(hf)
    assert (cfg.num_linear_layers, cfg.num_kv_layers, cfg.rope_layers) == (14, 2, (False,) * 16)
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.intermediate_size) == (64, 512, 1024)
    assert cfg.shared_expert_intermediate_size == 1024 and not cfg.shared_expert_gate
    assert cfg.linear_conv_dim == 48 * 64 + 2 * 128 and cfg.sm_scale == 0.0078125


def test_granite4_biased_projections_are_refused():
    hf = json.loads(_config().to_json_string())
    hf["mamba_proj_bias"] = True
    with pytest.raises(ValueError, match="biases are not supported"):
        model_config_from_hf(hf)


def test_granite4_unknown_layer_type_is_refused():
    hf = json.loads(_config().to_json_string())
    hf["layer_types"] = ["mamba", "sliding_attention", "mamba", "mamba"]
    with pytest.raises(ValueError, match="granitemoehybrid layer types"):
        model_config_from_hf(hf)
