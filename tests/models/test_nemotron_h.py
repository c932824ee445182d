"""Nemotron-H (`nemotron_h`): Mamba2, attention, ReLU² MLP and MoE blocks, against HF
transformers on a tiny random model (tests/models/test_models_parity.py's recipe: chunked
prefill of 7 over shuffled pages of 4, 8 decode steps, float32 logits within `TOL`, 16 greedy
tokens of a mixed batch). The pattern "M-*-ME" has every block kind; the MoE block has a
latent projection and two expert groups. Negative controls: the expert correction bias and
the MLP's square, each must move the logits past `TOL`.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
import transformers
from test_deepseek import ONE_BUCKET, _greedy_hf
from test_models_parity import TOL, VOCAB, _build, _check_greedy, _max_diff

from jengine import Engine, SamplingParams
from jengine.models import model_config_from_hf

PATTERN = "M-*-ME"


def _config(**kw):
    base = dict(
        vocab_size=VOCAB, hidden_size=64, hybrid_override_pattern=PATTERN, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=48, mamba_num_heads=8,
        mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=16,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=32, moe_latent_size=32, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, max_position_embeddings=256, tie_word_embeddings=False,
    )
    return transformers.NemotronHConfig(**{**base, **kw})


def _biased_router(model) -> None:
    """A correction bias that changes which experts are chosen (HF initialises it to 0)."""
    gen = torch.Generator().manual_seed(6)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))


@pytest.fixture(scope="module")
def nemotron_h(tmp_path_factory):
    path = tmp_path_factory.mktemp("nemotron_h")
    captured = []
    loaded, ids, expected = _build(path, _config(), transformers.NemotronHForCausalLM,
                                   edit=lambda m: (_biased_router(m), captured.append(m)),
                                   greedy=False)
    return loaded, ids, expected, captured[0]


def test_nemotron_h_reads_the_block_pattern(nemotron_h):
    cfg = nemotron_h[0].config
    assert cfg.linear_layers == (True, False, False, False, True, False)
    assert cfg.mlp_only_layers == ("", "mlp", "", "mlp", "", "moe")
    assert (cfg.num_kv_layers, cfg.num_linear_layers, cfg.moe_latent_size) == (1, 2, 32)
    params = nemotron_h[0].params
    assert params["wq"].shape[0] == 1 and params["w_up"].shape[0] == 2
    assert params["we_up"].shape == (1, 4, 32, 24)
    assert cfg.num_params == sum(p.numel() for p in nemotron_h[3].parameters())


def test_nemotron_h_logits_match_hf(nemotron_h):
    loaded, ids, expected, _ = nemotron_h
    assert _max_diff(loaded, ids, expected) < TOL


def test_nemotron_h_info_reports_the_recurrent_state(nemotron_h, capsys):
    from jengine.cli.info import cmd_info

    assert cmd_info(argparse.Namespace(model=str(nemotron_h[0].source))) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("linear_layers"))
    # 2 layers x (conv 3 taps x (64 + 2 x 2 x 8) channels + 8 heads x 8 x 8) x 4 bytes = 6400
    assert "2 of 6 Mamba2 (KV pages for 1 attention layers)" in line and "6.2 KiB" in line


@pytest.mark.parametrize("wrong", ["correction_bias", "relu2"])
def test_nemotron_h_negative_controls(nemotron_h, wrong):
    loaded, ids, expected, _ = nemotron_h
    cfg, params = loaded.config, dict(loaded.params)
    if wrong == "correction_bias":
        params["router_bias"] = np.zeros_like(params["router_bias"])
    else:
        params["w_down"] = np.asarray(params["w_down"]) * 2.0  # not what the square gives
    diff = _max_diff((cfg, params), ids, expected, decode_steps=0, layer_layout="as_given")
    assert diff > TOL, wrong


@pytest.mark.slow  # ~20 s; CI: test_nemotron_h_logits_match_hf (prefill chunks, 8 decodes)
def test_nemotron_h_greedy_batch_matches_hf(nemotron_h):
    """16 greedy tokens of three prompts decoded together over the paged cache; the logits
    with the weights stacked per kind (the scan layout) too."""
    loaded, ids, expected, model = nemotron_h
    _check_greedy(model, loaded, [ids[:5], ids[:11], ids[:3]])
    assert _max_diff(loaded, ids, expected, layer_layout="as_given") < TOL


@pytest.mark.slow  # ~40 s: a whole engine; CI: the parity over the paged cache
def test_nemotron_h_engine_greedy_matches_hf(nemotron_h):
    """A mixed batch through the engine (one step shape): a 40-token prompt prefills in
    chunks while the others decode, each sequence in its own state slot."""
    loaded, _, _, model = nemotron_h
    engine = Engine(str(loaded.source), config=ONE_BUCKET, dtype="float32",
                    kv_cache_memory="4MiB", max_model_len=128)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 40, 11)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0,
                                                   ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == _greedy_hf(model, prompts, 16)
    assert engine.core.scheduler.state_slots.num_free == 16


@pytest.mark.slow  # ~20 s; CI: the MoE model's parity (the same Mamba2, attention, MLP blocks)
def test_nemotron_h_dense(tmp_path):
    """No MoE blocks, as Nemotron-H 8B and 4B are published; conv without bias."""
    config = _config(hybrid_override_pattern="M-*-M-", use_conv_bias=False)
    loaded, ids, expected = _build(tmp_path, config, transformers.NemotronHForCausalLM,
                                   greedy=False)
    assert loaded.config.num_experts == 0 and "m_conv_bias" not in loaded.params
    assert _max_diff(loaded, ids, expected) < TOL


@pytest.mark.slow  # ~20 s: a whole engine; CI: the f32 parity (the same forward)
def test_nemotron_h_bfloat16_engine_serves(nemotron_h):
    """bf16 weights on this CPU's default projections (AMX-packed where the CPU has AMX: only
    weights that declare contracted axes are packed; the Mamba2 ones stay XLA's)."""
    engine = Engine(str(nemotron_h[0].source), config=ONE_BUCKET, dtype="bfloat16",
                    kv_cache_memory="4MiB", max_model_len=128)
    [out] = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0,
                                                            ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("spelling", [
    {"hybrid_override_pattern": PATTERN},
    {"layers_block_type": ["mamba", "mlp", "attention", "mlp", "mamba", "moe"]},
    {"layers_block_type": ["linear_attention", "mlp", "full_attention", "mlp",
                           "linear_attention", "moe"]},
])
def test_nemotron_h_config_spellings(spelling):
    hf = json.loads(_config().to_json_string())
    hf.pop("layers_block_type", None)
    hf.update(spelling)
    cfg = model_config_from_hf(hf)
    assert cfg.num_layers == 6 and cfg.linear_layers == (True, False, False, False, True, False)


def test_nemotron_h_published_config():
    """Nemotron-H 4B's config.json as published (older keys: `hybrid_override_pattern`,
    `attention_head_dim` 128 at hidden 3072 / 32 heads, `layer_norm_epsilon`, an infinite
    `time_step_limit`)."""
    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    hf = json.loads("""{"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"],
        "vocab_size": 131072, "hidden_size": 3072, "intermediate_size": 12288,
        "num_hidden_layers": 52, "num_attention_heads": 32, "num_key_value_heads": 8,
        "attention_head_dim": 128, "mamba_num_heads": 112, "mamba_head_dim": 64,
        "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4, "expand": 2,
        "chunk_size": 128, "use_conv_bias": true, "use_bias": false, "mlp_bias": false,
        "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "layer_norm_epsilon": 1e-05,
        "time_step_limit": [0.0, Infinity], "sliding_window": null,
        "max_position_embeddings": 8192, "tie_word_embeddings": false}""")
    hf["hybrid_override_pattern"] = pattern
    cfg = model_config_from_hf(hf)
    assert (cfg.num_layers, cfg.num_linear_layers, cfg.num_kv_layers) == (52, 24, 4)
    assert cfg.head_dim == 128 and cfg.rms_norm_eps == 1e-5 and cfg.mamba_dt_limit is None
    assert cfg.linear_conv_dim == 112 * 64 + 2 * 8 * 128 and cfg.mlp_only_layers.count("mlp") == 24


def test_nemotron_h_bad_pattern_is_refused():
    hf = json.loads(_config().to_json_string())
    hf.pop("layers_block_type", None)
    hf["hybrid_override_pattern"] = "M-X"
    with pytest.raises(ValueError, match="hybrid_override_pattern"):
        model_config_from_hf(hf)
