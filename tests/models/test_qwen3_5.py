"""Qwen3.5 (`qwen3_5_text`): Gated DeltaNet linear-attention layers mixed with gated full
attention, against HF transformers on a tiny random model (tests/models/test_models_parity.py's
recipe: chunked prefill over shuffled pages, then 8 decode steps, float32 logits within `TOL`).

The prompt (`LONG` tokens) is longer than HF's DeltaNet chunk (64), so HF runs its chunked
form while jengine carries the recurrent state token by token across its prefill chunks of 7,
then decodes. The linear layers' conv and state sit in per-sequence slots (`KVCache.conv` /
`.ssm`); the mixed batch of `_check_greedy` decodes three sequences from three slots at once.
Negative controls: the output gate, the decay (A_log), the conv's taps reversed, the value
heads' gated-norm weight; each must move the logits past `TOL`.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
import transformers
from kv_pool import small_kv_pool
from paged import run_paged
from test_deepseek import ONE_BUCKET, _greedy_hf
from test_models_parity import TOL, VOCAB, _build, _max_diff

from jengine import Engine, SamplingParams

GREEDY = 16
LONG = 80  # prompt + decode tokens, past HF's DeltaNet chunk of 64
TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]


def _config(**kw):
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, layer_types=TYPES,
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]},
    )
    return transformers.Qwen3_5TextConfig(**{**base, **kw})


def _multimodal_config():
    """A Qwen3.5 checkpoint as published: `qwen3_5` wrapping the text config, the text model
    under `model.language_model.`, a (tiny) vision tower under `model.visual.`."""
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                  out_hidden_size=64, num_position_embeddings=16)
    return transformers.Qwen3_5Config(text_config=_config().to_dict(), vision_config=vision,
                                      tie_word_embeddings=False)


def _gated_norms_near_one(model) -> None:
    """The DeltaNet's gated norm scales by its weight (no 1 +): centre it at 1 as trained."""
    gen = torch.Generator().manual_seed(5)
    for module in model.modules():
        if hasattr(module, "A_log"):  # a Gated DeltaNet layer
            w = module.norm.weight
            w.copy_(1 + 0.3 * torch.randn(w.shape, generator=gen))


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5")
    loaded, ids, expected = _build(path, _config(), transformers.Qwen3_5ForCausalLM,
                                   norm_offset=0.0, edit=_gated_norms_near_one)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM.from_pretrained(path).eval()
    long_ids = np.random.default_rng(4).integers(3, VOCAB, LONG).tolist()
    with torch.no_grad():
        long_expected = model(torch.tensor([long_ids])).logits[0].float().numpy()
    return loaded, (ids, expected), (long_ids, long_expected)


def test_qwen3_5_reads_the_hybrid_config(qwen3_5):
    cfg = qwen3_5[0].config
    assert cfg.linear_layers == (True, False, True, True)
    assert (cfg.num_kv_layers, cfg.num_linear_layers, cfg.rotary_dim) == (1, 3, 4)
    params = qwen3_5[0].params
    assert params["wqg"].shape[0] == 1 and params["lin_qkv"].shape[0] == 3


def test_qwen3_5_logits_match_hf(qwen3_5):
    loaded, (ids, expected), _ = qwen3_5
    assert _max_diff(loaded, ids, expected) < TOL


def test_qwen3_5_prompt_past_the_deltanet_chunk(qwen3_5):
    loaded, _, (ids, expected) = qwen3_5
    assert _max_diff(loaded, ids, expected) < TOL
    got = run_paged(loaded, ids, prefill_chunk=16, decode_steps=8, page_size=4,
                    layer_layout="as_given")
    assert np.abs(got - expected).max() < TOL


def _reversed_taps(params):
    return {**params, "lin_conv": params["lin_conv"][:, ::-1]}


@pytest.mark.parametrize("wrong", ["gate", "decay", "taps", "norm"])
def test_qwen3_5_negative_controls(qwen3_5, wrong):
    loaded, (ids, expected), _ = qwen3_5
    cfg, params = loaded.config, dict(loaded.params)
    if wrong == "gate":
        gate_off = np.array(params["wqg"])
        gate_off[..., 16:] = 0.0  # sigmoid(gate) = 1/2 everywhere
        params["wqg"] = gate_off
    elif wrong == "decay":
        params["lin_a_log"] = np.full_like(params["lin_a_log"], -30.0)  # no decay
    elif wrong == "taps":
        params = _reversed_taps(params)
    else:
        params["lin_norm"] = np.ones_like(params["lin_norm"])
    diff = _max_diff((cfg, params), ids, expected, decode_steps=0, layer_layout="as_given")
    assert diff > TOL, wrong


@pytest.fixture(scope="module")
def qwen3_5_engine(qwen3_5):
    """The tiny model served by an engine of one step shape (T=16, S=16): the 70-token prompt
    prefills in five chunks while the others decode beside it."""
    loaded = qwen3_5[0]
    engine = Engine(str(loaded.source), config=ONE_BUCKET, dtype="float32",
                    kv_cache_memory="4MiB", max_model_len=128, warmup=True)
    model = transformers.Qwen3_5ForCausalLM.from_pretrained(loaded.source).eval()
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 70, 11, 23)]
    return engine, prompts, _greedy_hf(model, prompts, GREEDY)


def test_qwen3_5_engine_greedy_matches_hf(qwen3_5_engine):
    engine, prompts, expected = qwen3_5_engine
    core = engine.core
    assert core.prefix_cache.snapshots.count == 16  # one per sequence that may run
    before = core.compiles_since_ready
    outs = engine.generate(prompts, SamplingParams(max_tokens=GREEDY, temperature=0,
                                                   ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert core.compiles_since_ready == before
    assert core.scheduler.state_slots.num_free == 16  # every slot back


def test_qwen3_5_preemption_recomputes_the_state(qwen3_5_engine):
    engine, prompts, expected = qwen3_5_engine
    core = engine.core
    before = core.scheduler.num_preemptions
    with small_kv_pool(core, 10):  # 9 pages of 16 tokens: the four sequences need 14
        outs = engine.generate(prompts, SamplingParams(max_tokens=GREEDY, temperature=0,
                                                       ignore_eos=True))
        assert core.scheduler.num_preemptions > before
        # The preempted sequence resumed from a snapshot of its own state, not from zeros.
        assert core.prefix_cache.stats.hit_tokens > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert core.scheduler.state_slots.num_free == 16
    core.reset_prefix_cache()
    assert _all_snapshots_free(core)


def _greedy(engine, prompts, n=1):
    return engine.generate(prompts, SamplingParams(n=n, max_tokens=GREEDY, temperature=0,
                                                   ignore_eos=True))


def _all_snapshots_free(core) -> bool:
    snapshots = core.prefix_cache.snapshots
    return snapshots.num_free == snapshots.count and not snapshots.num_held


def test_qwen3_5_prefix_hit_resumes_from_a_state_snapshot(qwen3_5, qwen3_5_engine):
    """A prompt sharing 50 tokens (3 full pages and 2) with an earlier one resumes from the
    state snapshot taken after their third page: 48 cached tokens, HF's greedy tokens. A
    prompt that differs in its first token hits nothing."""
    engine, _, _ = qwen3_5_engine
    core = engine.core
    core.reset_prefix_cache()
    rng = np.random.default_rng(7)
    first = rng.integers(3, VOCAB, 60).tolist()
    second = first[:50] + rng.integers(3, VOCAB, 12).tolist()
    other = [(first[0] + 1) % VOCAB or 3] + first[1:50]
    model = transformers.Qwen3_5ForCausalLM.from_pretrained(qwen3_5[0].source).eval()
    with torch.no_grad():  # HF's own cache: its recurrent decode (full forwards take 20 s)
        expected = model.generate(torch.tensor([second]), do_sample=False,
                                  max_new_tokens=GREEDY, min_new_tokens=GREEDY)[0, 62:]
    before = core.compiles_since_ready
    _greedy(engine, [first])
    [hit] = _greedy(engine, [second])
    [miss] = _greedy(engine, [other])
    assert (hit.num_cached_tokens, miss.num_cached_tokens) == (48, 0)
    assert hit.outputs[0].token_ids == expected.tolist()
    assert core.compiles_since_ready == before
    assert core.prefix_cache.snapshots.num_held >= 4  # first's 3 pages, second's 1 more
    core.reset_prefix_cache()
    assert _all_snapshots_free(core) and core.scheduler.state_slots.num_free == 16


def test_qwen3_5_forked_samples_resume_from_the_leaders_snapshot(qwen3_5_engine):
    engine, prompts, expected = qwen3_5_engine
    core = engine.core
    core.reset_prefix_cache()
    hits = core.prefix_cache.stats.hit_tokens
    [out] = _greedy(engine, [prompts[1]], n=3)  # 70 tokens: 4 full pages
    assert [o.token_ids for o in out.outputs] == [expected[1]] * 3
    assert core.prefix_cache.stats.hit_tokens - hits == 2 * 64
    core.reset_prefix_cache()
    assert _all_snapshots_free(core)


def test_qwen3_5_refuses_speculative_decoding(qwen3_5):
    with pytest.raises(ValueError, match="recurrent state cannot roll back"):
        Engine(str(qwen3_5[0].source), config=ONE_BUCKET, dtype="float32",
               kv_cache_memory="4MiB", max_model_len=128, speculative="ngram")


def test_qwen3_5_tp2_matches_hf(qwen3_5, qwen3_5_engine):
    """Under tp=2 the attention layers' heads and the MLPs split; the linear layers' weights
    and every recurrent state stay replicated on both devices."""
    _, prompts, expected = qwen3_5_engine
    engine = Engine(str(qwen3_5[0].source), config=ONE_BUCKET, dtype="float32",
                    kv_cache_memory="4MiB", max_model_len=128, mesh="tp=2",
                    attention_backend="cpu")
    outs = engine.generate(prompts, SamplingParams(max_tokens=GREEDY, temperature=0,
                                                   ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_qwen3_5_info_reports_the_recurrent_state(qwen3_5, capsys):
    from jengine.cli.info import cmd_info

    assert cmd_info(argparse.Namespace(model=str(qwen3_5[0].source))) == 0
    capsys_out = capsys.readouterr().out
    line = next(x for x in capsys_out.splitlines() if x.startswith("linear_layers"))
    # 3 layers x (conv 3 taps x 80 channels + 4 heads x 8 x 12) x 4 bytes = 7488 bytes
    assert "3 of 4 Gated DeltaNet" in line and "7.3 KiB" in line
    assert "state_snapshots  64 prefix-cache snapshots" in capsys_out


def test_qwen3_5_multimodal_checkpoint_reads_its_text_model(tmp_path):
    loaded, ids, expected = _build(tmp_path, _multimodal_config(),
                                   transformers.Qwen3_5ForConditionalGeneration,
                                   norm_offset=0.0, edit=_gated_norms_near_one, greedy=False)
    assert loaded.config.model_type == "qwen3_5_text"
    assert _max_diff(loaded, ids, expected) < TOL
