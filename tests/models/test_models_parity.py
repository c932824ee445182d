"""Logits parity with HF transformers on tiny random models of every supported family.

Each test builds a seeded random HF model in torch (every weight randomized, norms and biases
included), saves it as safetensors plus a tiny tokenizer, loads it with `converters.load_source`
and runs one sequence through jengine's paged KV path (`tests/paged.py`: several prefill chunks
over shuffled pages, then single-token decode steps). The float32 logits at every position must
match HF's float32 forward of the same ids, with the layer weights split per layer (the CPU
default) and, for one Llama and the Gemma model, stacked under `lax.scan` too.

Tolerance: both sides compute in float32 from identical weights; they differ only in the order
of float32 operations (einsum vs. matmul groupings, softmax, rope cos/sin evaluation), which
perturbs logits of magnitude 5-80 by 2e-6..2e-5 (measured) over these 2-3 layer models.
`TOL = 1e-4` (the bar issue 18 sets) leaves 5x headroom while staying >1000x below the effect of
any single feature the negative controls switch off (each moved logits by 0.36-6).

Negative controls prove the features are really exercised: switching one off in our config
(sliding window, llama3 rope scaling, Gemma's local rope theta and query_pre_attn_scalar,
Phi-3's partial rotary, the MoE top-k renormalisation), zeroing Qwen2's q/k/v biases,
dropping Gemma's, Qwen3's or OLMo 2's learned q/k norm weights, resetting one of Granite's
multipliers, or exchanging what a mapping must keep apart (two MoE experts, Phi-3's k and v
blocks of the fused qkv_proj or its gate and up halves, OLMo 2's two post-norms) must push the
difference above `TOL` (they run prefill only: one compiled program each). MoE routing itself
is tested token for token in tests/models/test_moe.py.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import transformers
from paged import greedy_paged, run_paged  # tests/paged.py: pytest puts tests/ on sys.path
from tiny_models import randomize, save_tokenizer

from converters import load_source
from jengine.models import model_config_from_hf
from jengine.sharding import pad_query_heads

TOL = 1e-4
VOCAB = 96
SEQ_LEN = 30  # 22 prefilled (chunks of 7: 7+7+7+1) + 8 decode steps; pages of 4
DECODE_STEPS = 8
GREEDY_TOKENS = 16  # generated per prompt by `_check_greedy`, three prompts decoded together
NEAR_TIE = 1e-3
PREFILL_CHUNK = 7
WINDOW = 5  # sliding window, much shorter than SEQ_LEN


def _build(tmp_path, config, model_cls, *, norm_offset: float = 1.0, edit=None,
           greedy: bool = True):
    """Saves a random model to tmp_path; returns (its loaded jengine form, ids, HF logits).
    `edit(model)` may change the randomized torch model before it is saved. With `greedy`,
    also checks `GREEDY_TOKENS` greedy tokens of a mixed batch against HF (`_check_greedy`)."""
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    randomize(model, norm_offset=norm_offset)
    if edit is not None:
        with torch.no_grad():
            edit(model)
    model.save_pretrained(tmp_path)
    save_tokenizer(tmp_path, VOCAB)
    ids = np.random.default_rng(2).integers(3, VOCAB, SEQ_LEN).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].float().numpy()
    loaded = load_source(str(tmp_path), dtype="float32", progress=False)
    if greedy:
        _check_greedy(model, loaded, [ids[:5], ids[:11], ids[:3]])
    return loaded, ids, expected


def _check_greedy(hf_model, loaded, prompts: list[list[int]], *,
                  layer_layout: str = "as_given") -> None:
    """`GREEDY_TOKENS` greedy tokens of each prompt, decoded together as one ragged batch over
    the paged cache (`tests/paged.py`'s `greedy_paged`), equal HF's greedy continuation (its
    forward over the whole sequence each step, end of sequence ignored). A difference passes
    only at a near tie: HF's two best logits within `NEAR_TIE` (the two sides' f32 rounding
    may order them either way), and the continuation is compared up to it."""
    got = greedy_paged(loaded, prompts, GREEDY_TOKENS, prefill_chunk=PREFILL_CHUNK,
                       page_size=4, layer_layout=layer_layout)
    for prompt, ours in zip(prompts, got):
        seq = list(prompt)
        for step in range(GREEDY_TOKENS):
            with torch.no_grad():
                logits = hf_model(torch.tensor([seq])).logits[0, -1].float().numpy()
            theirs = int(np.argmax(logits))
            if ours[step] != theirs:
                top2 = np.sort(logits)[-2:]
                assert top2[1] - top2[0] < NEAR_TIE, (prompt, step, ours, theirs)
                break
            seq.append(theirs)


def _max_diff(model, ids, expected, *, decode_steps: int = DECODE_STEPS,
              layer_layout: str = "unstacked") -> float:
    """Parity runs the per-layer loop (the CPU default); `layer_layout="as_given"` runs the
    scan over stacked weights (TPU/GPU's), as the negative controls do."""
    got = run_paged(
        model, ids, prefill_chunk=PREFILL_CHUNK, decode_steps=decode_steps, page_size=4,
        layer_layout=layer_layout,
    )
    assert got.shape == expected.shape
    assert np.isfinite(got).all()
    return float(np.abs(got - expected).max())


def _control_diff(model, ids, expected) -> float:
    """A negative control's difference: prefill only (one compiled program instead of two)."""
    return _max_diff(model, ids, expected, decode_steps=0, layer_layout="as_given")


def _with(loaded, **changes):
    """(config with `changes`, params): a deliberately wrong variant of the loaded model."""
    return dataclasses.replace(loaded.config, **changes), loaded.params


def _llama_kwargs(**kw):
    base = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    }
    return {**base, **kw}


def test_llama2(tmp_path):
    config = transformers.LlamaConfig(**_llama_kwargs(num_key_value_heads=4, rope_theta=10000.0))
    loaded, ids, expected = _build(tmp_path, config, transformers.LlamaForCausalLM)
    assert loaded.config.num_kv_heads == loaded.config.num_heads
    assert _max_diff(loaded, ids, expected) < TOL
    assert _max_diff(loaded, ids, expected, layer_layout="as_given") < TOL  # stacked + scan


def test_llama31_rope_scaling(tmp_path):
    # original_max_position_embeddings=16: every rope wavelength above 16 tokens is divided by
    # `factor`, those between 4 and 16 are smoothed, so the scaling changes the angles in use.
    rope = {
        "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
    }
    config = transformers.LlamaConfig(**_llama_kwargs(head_dim=32, rope_parameters=rope))
    loaded, ids, expected = _build(tmp_path, config, transformers.LlamaForCausalLM)
    assert loaded.config.rope.rope_type == "llama3"
    # transformers 4.x spelling of the same config (what most hub checkpoints carry).
    legacy = json.loads((tmp_path / "config.json").read_text())
    legacy["rope_scaling"] = dict(legacy.pop("rope_parameters"))
    legacy["rope_theta"] = legacy["rope_scaling"].pop("rope_theta")
    assert model_config_from_hf(legacy).rope == loaded.config.rope
    assert _max_diff(loaded, ids, expected) < TOL
    unscaled = dataclasses.replace(loaded.config.rope, rope_type="default")
    assert _control_diff(_with(loaded, rope=unscaled), ids, expected) > TOL


def test_mistral_sliding_window(tmp_path):
    config = transformers.MistralConfig(**_llama_kwargs(sliding_window=WINDOW, rope_theta=1e4))
    loaded, ids, expected = _build(tmp_path, config, transformers.MistralForCausalLM)
    assert loaded.config.sliding_window == WINDOW and all(loaded.config.sliding_layers)
    assert _max_diff(loaded, ids, expected) < TOL
    assert _control_diff(_with(loaded, sliding_window=None), ids, expected) > TOL


def test_qwen2_biases(tmp_path):
    config = transformers.Qwen2Config(**_llama_kwargs(rope_theta=1e6))
    loaded, ids, expected = _build(tmp_path, config, transformers.Qwen2ForCausalLM)
    assert loaded.config.qkv_bias and not loaded.config.o_bias
    assert np.abs(loaded.params["bq"]).min() > 0 and np.abs(loaded.params["bk"]).max() > 0.1
    assert _max_diff(loaded, ids, expected) < TOL
    for bias in ("bq", "bk", "bv"):
        zeroed = {**loaded.params, bias: np.zeros_like(loaded.params[bias])}
        assert _control_diff((loaded.config, zeroed), ids, expected) > TOL, bias


def test_qwen3_qk_norm(tmp_path):
    # head_dim 32 with hidden 64 / 4 heads: Qwen3 sets head_dim apart from hidden // heads.
    config = transformers.Qwen3Config(**_llama_kwargs(head_dim=32, rope_theta=1e6))
    loaded, ids, expected = _build(tmp_path, config, transformers.Qwen3ForCausalLM)
    cfg = loaded.config
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.sliding_window is None
    assert cfg.head_dim == 32 and loaded.params["q_norm"].shape == (2, 32)
    assert _max_diff(loaded, ids, expected) < TOL
    assert _max_diff(loaded, ids, expected, layer_layout="as_given") < TOL  # stacked + scan
    plain = {**loaded.params, "q_norm": np.ones_like(loaded.params["q_norm"]),
             "k_norm": np.ones_like(loaded.params["k_norm"])}
    assert _control_diff((cfg, plain), ids, expected) > TOL


def test_granite_multipliers(tmp_path):
    config = transformers.GraniteConfig(**_llama_kwargs(
        rope_theta=1e4, embedding_multiplier=3.0, residual_multiplier=0.4,
        attention_multiplier=0.05, logits_scaling=2.5,
    ))
    loaded, ids, expected = _build(tmp_path, config, transformers.GraniteForCausalLM)
    cfg = loaded.config
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling) == (
        3.0, 0.4, 2.5)
    assert cfg.sm_scale == pytest.approx(0.05)
    assert _max_diff(loaded, ids, expected) < TOL
    for name, neutral in (("embedding_multiplier", 1.0), ("residual_multiplier", 1.0),
                          ("attention_multiplier", None), ("logits_scaling", 1.0)):
        assert _control_diff(_with(loaded, **{name: neutral}), ids, expected) > TOL, name


def test_smollm2_style_tied_gqa(tmp_path):
    config = transformers.LlamaConfig(**_llama_kwargs(
        hidden_size=72, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
        rope_theta=100000.0,
    ))
    loaded, ids, expected = _build(tmp_path, config, transformers.LlamaForCausalLM)
    assert loaded.config.tie_word_embeddings and "lm_head" not in loaded.params
    assert (loaded.config.num_heads, loaded.config.num_kv_heads) == (9, 3)
    assert _max_diff(loaded, ids, expected) < TOL


def _gemma_kwargs(**kw):
    """3 layers, sliding / full / sliding, head_dim and query_pre_attn_scalar set apart."""
    base = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "query_pre_attn_scalar": 24, "max_position_embeddings": 128, "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rms_norm_eps": 1e-6,
    }
    return {**base, **kw}


def test_gemma3_text(tmp_path):
    config = transformers.Gemma3TextConfig(**_gemma_kwargs(
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ))
    loaded, ids, expected = _build(
        tmp_path, config, transformers.Gemma3ForCausalLM, norm_offset=0.0
    )
    cfg = loaded.config
    assert cfg.sliding_layers == (True, False, True) and cfg.sliding_window == WINDOW
    assert cfg.local_rope.theta == 10.0 and cfg.rope.theta == 10000.0
    assert cfg.sm_scale == pytest.approx(24 ** -0.5)
    assert _max_diff(loaded, ids, expected) < TOL
    assert _max_diff(loaded, ids, expected, layer_layout="as_given") < TOL  # stacked + scan
    assert _control_diff(_with(loaded, local_rope=cfg.rope), ids, expected) > TOL
    assert _control_diff(_with(loaded, sliding_window=None), ids, expected) > TOL
    assert _control_diff(_with(loaded, query_pre_attn_scalar=None), ids, expected) > TOL
    no_qk_norm = {
        **loaded.params,
        "q_norm": np.zeros_like(loaded.params["q_norm"]),
        "k_norm": np.zeros_like(loaded.params["k_norm"]),
    }
    assert _control_diff((cfg, no_qk_norm), ids, expected) > TOL


def test_gemma2_soft_capping(tmp_path):
    # Caps low enough to bite on these random logits (scores and logits of ~5-80 unscaled).
    config = transformers.Gemma2Config(**_gemma_kwargs(
        attn_logit_softcapping=2.0, final_logit_softcapping=5.0, rope_theta=10000.0,
    ))
    loaded, ids, expected = _build(
        tmp_path, config, transformers.Gemma2ForCausalLM, norm_offset=0.0
    )
    cfg = loaded.config
    assert cfg.sliding_layers == (True, False, True) and cfg.local_rope is None
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (2.0, 5.0)
    assert "q_norm" not in loaded.params
    assert _max_diff(loaded, ids, expected) < TOL
    assert _max_diff(loaded, ids, expected, layer_layout="as_given") < TOL  # stacked + scan
    assert _control_diff(_with(loaded, attn_logit_softcapping=None), ids, expected) > TOL
    assert _control_diff(_with(loaded, final_logit_softcapping=None), ids, expected) > TOL
    assert _control_diff(_with(loaded, sliding_window=None), ids, expected) > TOL


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_gemma_untied_output_head(tmp_path, family):
    """`tie_word_embeddings: false`, which HF's Gemma classes accept (the default ties): the
    checkpoint's own `lm_head.weight` is the output head (it was refused as unexpected). The
    control puts the embedding back as the head."""
    config_cls, model_cls = {
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[family]
    config = config_cls(**_gemma_kwargs(tie_word_embeddings=False, final_logit_softcapping=None))
    loaded, ids, expected = _build(tmp_path, config, model_cls, norm_offset=0.0)
    cfg, params = loaded.config, loaded.params
    assert cfg.model_type == family and not cfg.tie_word_embeddings
    assert params["lm_head"].shape == (cfg.hidden_size, VOCAB)
    assert _max_diff(loaded, ids, expected) < TOL
    tied = dataclasses.replace(cfg, tie_word_embeddings=True)
    embed_as_head = {k: v for k, v in params.items() if k != "lm_head"}
    assert _control_diff((tied, embed_as_head), ids, expected) > TOL


def test_a_config_without_tie_word_embeddings_means_the_hf_class_default():
    base = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4}
    for model_type, tied in (("llama", False), ("qwen2", False), ("smollm3", True),
                             ("gemma2", True), ("gemma3_text", True)):
        cfg = model_config_from_hf({**base, "model_type": model_type})
        assert cfg.tie_word_embeddings == tied == transformers.AutoConfig.for_model(
            model_type).tie_word_embeddings, model_type


def _swapped_experts(params, a: int, b: int) -> dict:
    """Params with experts a and b exchanged in every expert weight (not in the router)."""
    out = dict(params)
    for name in ("we_gate", "we_up", "we_down"):
        w = np.array(params[name])
        w[:, [a, b]] = w[:, [b, a]]
        out[name] = w
    return out


def test_mixtral_moe(tmp_path):
    # 8 experts, top 2: a prefill chunk of 7 tokens (14 picks) runs every expert densely, a
    # decode step (2 picks) gathers its two experts; most experts get no token there.
    config = transformers.MixtralConfig(**_llama_kwargs(
        num_local_experts=8, num_experts_per_tok=2, rope_theta=1e4,
    ))
    loaded, ids, expected = _build(tmp_path, config, transformers.MixtralForCausalLM)
    cfg = loaded.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 96)
    assert cfg.norm_topk_prob and "w_gate" not in loaded.params
    assert loaded.params["we_gate"].shape == (2, 8, 64, 96)
    assert _max_diff(loaded, ids, expected) < TOL
    assert _max_diff(loaded, ids, expected, layer_layout="as_given") < TOL  # stacked + scan
    swapped = _swapped_experts(loaded.params, 0, 5)
    assert _control_diff((cfg, swapped), ids, expected) > TOL
    assert _control_diff(_with(loaded, norm_topk_prob=False), ids, expected) > TOL


def test_qwen3_moe(tmp_path):
    # HF's default norm_topk_prob=False: the top-k probabilities are used as they are.
    config = transformers.Qwen3MoeConfig(**_llama_kwargs(
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, head_dim=32,
        rope_theta=1e6,
    ))
    loaded, ids, expected = _build(tmp_path, config, transformers.Qwen3MoeForCausalLM)
    cfg = loaded.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 3, 32)
    assert cfg.qk_norm and not cfg.norm_topk_prob
    assert _max_diff(loaded, ids, expected) < TOL
    assert _control_diff(_with(loaded, norm_topk_prob=True), ids, expected) > TOL
    assert _control_diff((cfg, _swapped_experts(loaded.params, 2, 7)), ids, expected) > TOL
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["decoder_sparse_step"] = 2  # dense MLPs on every other layer: refused, not misloaded
    with pytest.raises(ValueError, match="dense MLP"):
        model_config_from_hf(hf)


def test_phi3_fused_projections_and_partial_rotary(tmp_path):
    # Phi-4-mini's layout: one qkv_proj and one gate_up_proj per layer, rope on 3/4 of each
    # head (12 of 16 dims). kv heads (2) differ from q heads (4), so a wrong split offset
    # would misalign every block after wq.
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}
    config = transformers.Phi3Config(**_llama_kwargs(rope_parameters=rope, pad_token_id=0))
    loaded, ids, expected = _build(tmp_path, config, transformers.Phi3ForCausalLM)
    cfg = loaded.config
    assert cfg.rotary_dim == 12 and loaded.params["wk"].shape == (2, 64, 2, 16)
    assert _max_diff(loaded, ids, expected) < TOL
    assert _control_diff(_with(loaded, partial_rotary_factor=1.0), ids, expected) > TOL
    swapped = {**loaded.params, "wk": loaded.params["wv"], "wv": loaded.params["wk"]}
    assert _control_diff((cfg, swapped), ids, expected) > TOL
    gate_up = {**loaded.params, "w_gate": loaded.params["w_up"], "w_up": loaded.params["w_gate"]}
    assert _control_diff((cfg, gate_up), ids, expected) > TOL


def test_olmo2_post_norms_and_full_width_qk_norm(tmp_path):
    config = transformers.Olmo2Config(**_llama_kwargs(rope_theta=1e4, pad_token_id=0))
    loaded, ids, expected = _build(tmp_path, config, transformers.Olmo2ForCausalLM)
    cfg = loaded.config
    assert cfg.post_norms and cfg.qk_norm_full and "attn_norm" not in loaded.params
    assert loaded.params["q_norm"].shape == (2, 4, 16)  # [L, H, D]: one weight per q dim
    assert _max_diff(loaded, ids, expected) < TOL
    swapped = {**loaded.params, "post_attn_norm": loaded.params["post_mlp_norm"],
               "post_mlp_norm": loaded.params["post_attn_norm"]}
    assert _control_diff((cfg, swapped), ids, expected) > TOL
    plain = {**loaded.params, "q_norm": np.ones_like(loaded.params["q_norm"])}
    assert _control_diff((cfg, plain), ids, expected) > TOL
    # Under tp=8 the 2 kv heads replicate and the 4 q heads pad to 8 zero-filled heads: the
    # norm's mean must still be over the 4 real heads' width.
    padded_cfg, padded = pad_query_heads(cfg, loaded.params, 8)
    assert padded_cfg.padded_heads == 4 and padded["q_norm"].shape == (2, 8, 16)
    assert _control_diff((padded_cfg, padded), ids, expected) < TOL
    counted = dataclasses.replace(padded_cfg, padded_heads=0)
    assert _control_diff((counted, padded), ids, expected) > TOL


def test_ministral_per_layer_sliding_window(tmp_path):
    config = transformers.MinistralConfig(**_llama_kwargs(
        head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        rope_theta=1e4,
    ))
    loaded, ids, expected = _build(tmp_path, config, transformers.MinistralForCausalLM)
    assert loaded.config.sliding_layers == (True, False)
    assert _max_diff(loaded, ids, expected) < TOL
    assert _control_diff(_with(loaded, sliding_layers=(True, True)), ids, expected) > TOL


def test_seed_oss_qkv_bias_without_o_bias(tmp_path):
    # Seed-OSS-36B's own switches: q/k/v biases on (attention_bias), o_proj's off.
    config = transformers.SeedOssConfig(**_llama_kwargs(
        attention_bias=True, attention_out_bias=False, rope_theta=1e4,
    ))
    loaded, ids, expected = _build(tmp_path, config, transformers.SeedOssForCausalLM)
    assert loaded.config.qkv_bias and not loaded.config.o_bias
    assert _max_diff(loaded, ids, expected) < TOL
    zeroed = {**loaded.params, "bk": np.zeros_like(loaded.params["bk"])}
    assert _control_diff((loaded.config, zeroed), ids, expected) > TOL


def test_smollm3_no_rope_layers(tmp_path):
    config = transformers.SmolLM3Config(**_llama_kwargs(
        no_rope_layer_interval=2, rope_theta=1e4, pad_token_id=0,
    ))
    loaded, ids, expected = _build(tmp_path, config, transformers.SmolLM3ForCausalLM)
    assert loaded.config.rope_layers == (True, False)  # layer 1 has no rope
    assert _max_diff(loaded, ids, expected) < TOL
    assert _control_diff(_with(loaded, rope_layers=()), ids, expected) > TOL


def test_olmo3_sliding_layers_with_their_own_rope(tmp_path):
    # As OLMo 3's long-context models: yarn on the global layer only, so the rope's attention
    # factor differs per layer.
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
            "original_max_position_embeddings": 16}
    config = transformers.Olmo3Config(**_llama_kwargs(
        num_hidden_layers=3, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                         "full_attention": yarn},
        pad_token_id=0,
    ))
    loaded, ids, expected = _build(tmp_path, config, transformers.Olmo3ForCausalLM)
    cfg = loaded.config
    assert cfg.sliding_layers == (True, False, True) and cfg.local_rope.theta == 10.0
    assert cfg.rope.rope_type == "yarn" and cfg.local_rope.attention_factor == 1.0
    assert cfg.post_norms and cfg.qk_norm_full
    assert _max_diff(loaded, ids, expected) < TOL
    assert _control_diff(_with(loaded, local_rope=None), ids, expected) > TOL
    assert _control_diff(_with(loaded, sliding_window=None), ids, expected) > TOL
    unscaled = dataclasses.replace(cfg.rope, attention_factor=1.0)
    assert _control_diff(_with(loaded, rope=unscaled), ids, expected) > TOL


def test_exaone4_post_norms_per_head_qk_norm_and_global_nope(tmp_path):
    # sliding_window_pattern 3: layers 0, 1 slide with rope; layer 2 is global without rope.
    config = transformers.Exaone4Config(**_llama_kwargs(
        num_hidden_layers=3, sliding_window=WINDOW, sliding_window_pattern=3, rope_theta=1e4,
        pad_token_id=0,
    ))
    loaded, ids, expected = _build(tmp_path, config, transformers.Exaone4ForCausalLM)
    cfg = loaded.config
    assert cfg.sliding_layers == (True, True, False) and cfg.rope_layers == (True, True, False)
    assert cfg.post_norms and cfg.qk_norm and loaded.params["q_norm"].shape == (3, 16)
    assert _max_diff(loaded, ids, expected) < TOL
    assert _control_diff(_with(loaded, rope_layers=()), ids, expected) > TOL
    plain = {**loaded.params, "k_norm": np.ones_like(loaded.params["k_norm"])}
    assert _control_diff((cfg, plain), ids, expected) > TOL


def test_phi3_longrope(tmp_path):
    # Phi-3-mini-128k / Phi-4-mini's longrope within the original context (64 here): every
    # frequency divided by its short factor, q and k's rotated dims scaled by the attention
    # factor sqrt(1 + ln(128 / 64) / ln(64)) = 1.08.
    short = np.random.default_rng(4).uniform(1.0, 3.0, 6).round(3).tolist()
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
            "short_factor": short, "long_factor": [f * 4 for f in short]}
    config = transformers.Phi3Config(**_llama_kwargs(
        rope_parameters=rope, original_max_position_embeddings=64, pad_token_id=0,
    ))
    loaded, ids, expected = _build(tmp_path, config, transformers.Phi3ForCausalLM)
    cfg = loaded.config
    assert cfg.rope.rope_type == "longrope" and cfg.rope.freq_factors == tuple(short)
    assert cfg.rope.attention_factor == pytest.approx((1 + np.log(2) / np.log(64)) ** 0.5)
    assert cfg.rope.long_factors == tuple(f * 4 for f in short)
    assert cfg.max_position_embeddings == 128  # the long factors take it past 64
    # transformers 4.x spelling (Phi-3-mini-128k's config.json): "su" in rope_scaling, the
    # theta, the partial rotary factor and the original context at the top level.
    legacy = json.loads((tmp_path / "config.json").read_text())
    legacy["rope_scaling"] = dict(legacy.pop("rope_parameters"), type="su")
    legacy["rope_theta"] = legacy["rope_scaling"].pop("rope_theta")
    legacy["partial_rotary_factor"] = legacy["rope_scaling"].pop("partial_rotary_factor")
    for key in ("rope_type", "original_max_position_embeddings"):
        del legacy["rope_scaling"][key]
    assert model_config_from_hf(legacy) == cfg
    assert _max_diff(loaded, ids, expected) < TOL
    unscaled = dataclasses.replace(cfg.rope, attention_factor=1.0)
    assert _control_diff(_with(loaded, rope=unscaled), ids, expected) > TOL
    plain = dataclasses.replace(cfg.rope, rope_type="default")
    assert _control_diff(_with(loaded, rope=plain), ids, expected) > TOL


def test_qwen2_moe_shared_expert(tmp_path):
    config = transformers.Qwen2MoeConfig(**_llama_kwargs(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, rope_theta=1e6,
    ))
    loaded, ids, expected = _build(tmp_path, config, transformers.Qwen2MoeForCausalLM)
    cfg = loaded.config
    assert cfg.qkv_bias and cfg.shared_expert_intermediate_size == 48
    assert loaded.params["ws_router"].shape == (2, 64)
    assert _max_diff(loaded, ids, expected) < TOL
    ungated = {**loaded.params, "ws_router": np.zeros_like(loaded.params["ws_router"])}
    assert _control_diff((cfg, ungated), ids, expected) > TOL  # sigmoid(0) = 1/2 everywhere
    assert _control_diff((cfg, _swapped_experts(loaded.params, 1, 6)), ids, expected) > TOL


def test_granitemoe(tmp_path):
    # One input_linear [X, 2F, E] per layer holds every expert's gate and up rows; the router
    # is a softmax over the top-k logits (= renormalised top-k probabilities).
    config = transformers.GraniteMoeConfig(**_llama_kwargs(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, rope_theta=1e4,
        embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.05,
        logits_scaling=2.5,
    ))
    loaded, ids, expected = _build(tmp_path, config, transformers.GraniteMoeForCausalLM)
    cfg = loaded.config
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (8, 32, True)
    assert cfg.residual_multiplier == 0.4
    assert _max_diff(loaded, ids, expected) < TOL
    gate_up = {**loaded.params, "we_gate": loaded.params["we_up"],
               "we_up": loaded.params["we_gate"]}
    assert _control_diff((cfg, gate_up), ids, expected) > TOL
    assert _control_diff((cfg, _swapped_experts(loaded.params, 3, 4)), ids, expected) > TOL


def test_qwen3_yarn(tmp_path):
    # Qwen3's long-context setting: yarn factor 4 over an original context of 16, so all but
    # the fastest dims are interpolated and q/k's rotated dims scale by 0.1 ln 4 + 1.
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
            "original_max_position_embeddings": 16}
    config = transformers.Qwen3Config(**_llama_kwargs(head_dim=32, rope_parameters=rope))
    loaded, ids, expected = _build(tmp_path, config, transformers.Qwen3ForCausalLM)
    cfg = loaded.config
    assert cfg.rope.rope_type == "yarn"
    assert cfg.rope.attention_factor == pytest.approx(0.1 * np.log(4) + 1)
    assert _max_diff(loaded, ids, expected) < TOL
    unscaled = dataclasses.replace(cfg.rope, attention_factor=1.0)
    assert _control_diff(_with(loaded, rope=unscaled), ids, expected) > TOL
    untruncated = dataclasses.replace(cfg.rope, truncate=False)
    assert _control_diff(_with(loaded, rope=untruncated), ids, expected) > TOL


def _hf_incremental(model, ids: list[int], prompt_len: int) -> np.ndarray:
    """HF's float32 logits of `ids` as `generate` computes them: the first `prompt_len` in one
    forward, then one token per forward over its KV cache (HF's dynamic ropes pick their
    frequencies per forward from its longest position, so this differs from one full forward
    once the sequence passes the original context)."""
    with torch.no_grad():
        out = model(torch.tensor([ids[:prompt_len]]), use_cache=True)
        rows, cache = [out.logits[0]], out.cache
        for token in ids[prompt_len:]:
            out = model(torch.tensor([[token]]), cache=cache, use_cache=True)
            rows.append(out.logits[0])
            cache = out.cache
    return torch.cat(rows).float().numpy()


def _build_incremental(tmp_path, config, model_cls, prompt_len: int):
    """`_build`, with HF's logits computed incrementally (`_hf_incremental`)."""
    captured = []
    # greedy=False: `_check_greedy`'s reference is HF's full forward each step, which past the
    # original context is not HF's incremental generate (what these tests compare with).
    loaded, ids, _ = _build(tmp_path, config, model_cls, edit=captured.append, greedy=False)
    return loaded, ids, _hf_incremental(captured[0], ids, prompt_len)


def _incremental_diff(model, ids, expected, prompt_len: int) -> float:
    return _max_diff(model, ids, expected, decode_steps=len(ids) - prompt_len)


def test_phi3_longrope_long_factors_past_the_original_context(tmp_path):
    # Original context 16: a 14-token prompt runs on the short factors, then decoding crosses
    # position 16, where HF's generate (and jengine, by position) switch to the long factors;
    # the cached keys below 16 keep their short-factor rotation in both.
    short = np.random.default_rng(5).uniform(1.0, 3.0, 8).round(3).tolist()
    long = np.random.default_rng(6).uniform(2.0, 8.0, 8).round(3).tolist()
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": short,
            "long_factor": long}
    config = transformers.Phi3Config(**_llama_kwargs(
        rope_parameters=rope, original_max_position_embeddings=16, pad_token_id=0))
    loaded, ids, expected = _build_incremental(tmp_path, config, transformers.Phi3ForCausalLM, 14)
    cfg = loaded.config
    assert cfg.rope.by_position and cfg.max_position_embeddings == 128
    assert _incremental_diff(loaded, ids, expected, 14) < TOL
    short_only = dataclasses.replace(cfg.rope, long_factors=None)
    assert _incremental_diff(_with(loaded, rope=short_only), ids, expected, 14) > TOL


def test_llama_dynamic_ntk_past_the_original_context(tmp_path):
    # max_position_embeddings 16, factor 4: each decode step past position 15 turns its q and k
    # with HF's NTK base for p + 1 tokens; the prompt's keys keep the plain rope.
    rope = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}
    config = transformers.LlamaConfig(**_llama_kwargs(
        rope_parameters=rope, max_position_embeddings=16))
    loaded, ids, expected = _build_incremental(tmp_path, config, transformers.LlamaForCausalLM, 12)
    cfg = loaded.config
    assert cfg.rope.rope_type == "dynamic" and cfg.max_position_embeddings == 64
    assert _incremental_diff(loaded, ids, expected, 12) < TOL
    assert _max_diff(loaded, ids, expected, decode_steps=18, layer_layout="as_given") < TOL
    plain = dataclasses.replace(cfg.rope, rope_type="default")
    assert _incremental_diff(_with(loaded, rope=plain), ids, expected, 12) > TOL
    # Within the original context the rope is the plain one, exactly as HF's.
    assert _max_diff(_with(loaded, rope=plain), ids[:16], expected[:16], decode_steps=4) < TOL
