"""GGUF files of every family llama.cpp's converter writes, read back and run against HF.

Each test builds the family's tiny random HF checkpoint (`test_models_parity._build`: saved as
safetensors, HF's float32 logits of its ids) and converts that checkpoint the way llama.cpp's
`convert_hf_to_gguf.py` does: tensor names from `gguf`'s own `TensorNameMap` (llama.cpp's
canonical table), the metadata keys its model class writes, q/k rows permuted for its
`LlamaModel` subclasses, Gemma's norms stored as 1 + w, per-expert tensors stacked,
Granite-MoE's fused input_linear split and DeepSeek-V2's kv_b_proj split per head (newer
converters). jengine loads the file and its logits over the paged KV path must equal HF's
within the parity tolerance (and, where asked, its greedy tokens HF's); a negative control per
file shows that the feature the header carries is really read (a wrong header must fail it).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import transformers
from gguf_writer import add_tiny_vocab, llama_cpp_permute, write_gguf  # tests/gguf_writer.py
from safetensors.numpy import load_file
from test_deepseek import _config as _deepseek_config
from test_models_parity import (
    TOL,
    VOCAB,
    WINDOW,
    _build,
    _check_greedy,
    _control_diff,
    _gemma_kwargs,
    _llama_kwargs,
    _max_diff,
    _with,
)

from converters import load_source
from converters.gguf_file import GGUFModel

Meta = Callable[[gguf.GGUFWriter, dict], None]
Tensors = dict[str, np.ndarray]

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def _base_meta(w: gguf.GGUFWriter, hf: dict) -> None:
    """What llama.cpp's `TextModel.set_gguf_parameters` writes from an HF config."""
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    rope = hf.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    w.add_rope_freq_base(full["rope_theta"])
    if full.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(full["factor"])
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        if full.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(full["attention_factor"])
        if full.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
    if "sliding_attention" in rope:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(hf["num_experts_per_tok"])
    if hf.get("head_dim"):
        w.add_key_length(hf["head_dim"])
        w.add_value_length(hf["head_dim"])


def _llama_cpp_tensors(arch: gguf.MODEL_ARCH, hf: dict, state: dict, *, permute: bool,
                       norm_shift: float) -> dict[str, np.ndarray]:
    """The HF checkpoint's tensors under llama.cpp's names, transformed as its converter does."""
    names = gguf.get_tensor_name_map(arch, hf["num_hidden_layers"])
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for key, value in state.items():
        if key == "lm_head.weight" and hf.get("tie_word_embeddings"):
            continue
        if m := _EXPERT.fullmatch(key):  # stacked per layer: [X, out, in]
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = value
            continue
        if key.endswith("block_sparse_moe.input_linear.weight"):  # Granite-MoE: [X, 2F, E]
            layer, width = key.split(".")[2], value.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"] = value[:, :width]
            out[f"blk.{layer}.ffn_up_exps.weight"] = value[:, width:]
            continue
        if permute and key.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, heads, heads)
        elif permute and key.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, heads, kv_heads)
        if norm_shift and key.endswith("norm.weight"):
            value = value + norm_shift
        if key.endswith("e_score_correction_bias"):  # llama.cpp's DeepSeek-V3 rename
            key = key.removesuffix("_bias") + ".bias"
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        out[name] = value
    for (layer, kind), by_expert in experts.items():
        out[f"blk.{layer}.ffn_{kind}_exps.weight"] = np.stack(
            [by_expert[i] for i in range(len(by_expert))])
    return out


def _convert(hf_dir: Path, arch: gguf.MODEL_ARCH, meta: Meta | None = None, *,
             base: bool = True, permute: bool = False, norm_shift: float = 0.0,
             arch_name: str | None = None,
             edit: Callable[[Tensors, dict], Tensors] | None = None) -> Path:
    """`hf_dir`'s checkpoint as llama.cpp's converter writes it: its base keys (unless the
    family's class writes its own), then `meta`'s, then every tensor in float32 (after `edit`,
    a family's own transform of the named tensors). `arch_name` replaces `arch`'s name in the
    header (a file another writer made)."""
    hf = json.loads((hf_dir / "config.json").read_text())
    path = hf_dir / "model.gguf"
    w = gguf.GGUFWriter(str(path), arch_name or gguf.MODEL_ARCH_NAMES[arch])
    if base:
        _base_meta(w, hf)
    if meta is not None:
        meta(w, hf)
    add_tiny_vocab(w, VOCAB)
    state = load_file(str(hf_dir / "model.safetensors"))
    tensors = _llama_cpp_tensors(arch, hf, state, permute=permute, norm_shift=norm_shift)
    if edit is not None:
        tensors = edit(tensors, hf)
    for name, value in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(value, np.float32))
    write_gguf(w)
    return path


def _gguf_parity(tmp_path, config, model_cls, arch, meta=None, *, norm_offset=1.0,
                 greedy=False, **kw):
    """(GGUF-loaded model, ids, HF logits), after asserting logit parity over the paged path
    (and with `greedy`, the greedy tokens of a mixed batch: `test_models_parity._check_greedy`)."""
    models: list = []
    _, ids, expected = _build(tmp_path, config, model_cls, norm_offset=norm_offset,
                              edit=models.append, greedy=False)
    path = _convert(tmp_path, arch, meta, **kw)
    loaded = load_source(str(path), dtype="float32", progress=False)
    assert loaded.kind == "gguf" and loaded.config.model_type == config.model_type
    assert _max_diff(loaded, ids, expected) < TOL
    if greedy:
        _check_greedy(models[0], loaded, [ids[:5], ids[:11], ids[:3]], layer_layout="unstacked")
    return loaded, ids, expected


def test_qwen2(tmp_path):
    config = transformers.Qwen2Config(**_llama_kwargs(rope_theta=1e6))
    loaded, _, _ = _gguf_parity(tmp_path, config, transformers.Qwen2ForCausalLM,
                                gguf.MODEL_ARCH.QWEN2)
    assert loaded.config.qkv_bias and loaded.config.sliding_window is None


def test_mistral_named_file_with_sliding_window(tmp_path):
    # llama.cpp writes Mistral as `llama` (tested in test_gguf.py); other writers name the
    # architecture `mistral`, with the same permuted q/k rows and the window as a key.
    config = transformers.MistralConfig(**_llama_kwargs(sliding_window=WINDOW, rope_theta=1e4))
    loaded, ids, expected = _gguf_parity(
        tmp_path, config, transformers.MistralForCausalLM, gguf.MODEL_ARCH.LLAMA,
        lambda w, hf: w.add_sliding_window(hf["sliding_window"]), permute=True,
        arch_name="mistral")
    assert loaded.config.sliding_window == WINDOW
    assert _control_diff(_with(loaded, sliding_window=None), ids, expected) > TOL


def test_gemma2(tmp_path):
    # llama.cpp's Gemma2Model writes its own keys (no rope base: 10000) and the graph scales
    # queries by head_dim, so the HF model must use query_pre_attn_scalar = head_dim here.
    def meta(w, hf):
        w.add_block_count(hf["num_hidden_layers"])
        w.add_context_length(hf["max_position_embeddings"])
        w.add_embedding_length(hf["hidden_size"])
        w.add_feed_forward_length(hf["intermediate_size"])
        w.add_head_count(hf["num_attention_heads"])
        w.add_head_count_kv(hf["num_key_value_heads"])
        w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
        w.add_key_length(hf["head_dim"])
        w.add_value_length(hf["head_dim"])
        w.add_attn_logit_softcapping(hf["attn_logit_softcapping"])
        w.add_final_logit_softcapping(hf["final_logit_softcapping"])
        w.add_sliding_window(hf["sliding_window"])

    config = transformers.Gemma2Config(**_gemma_kwargs(
        query_pre_attn_scalar=16, attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
        rope_theta=10000.0))
    loaded, ids, expected = _gguf_parity(
        tmp_path, config, transformers.Gemma2ForCausalLM, gguf.MODEL_ARCH.GEMMA2, meta,
        base=False, norm_offset=0.0, norm_shift=1.0)
    assert loaded.config.sliding_layers == (True, False, True)
    assert _control_diff(_with(loaded, attn_logit_softcapping=None), ids, expected) > TOL


def test_phi3_fused_and_longrope_factors(tmp_path):
    short = np.random.default_rng(4).uniform(1.0, 3.0, 6).round(3).tolist()
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
            "short_factor": short, "long_factor": [f * 4 for f in short]}

    def meta(w, hf):  # Phi3MiniModel.set_gguf_parameters and generate_extra_tensors
        _base_meta(w, hf)
        w.add_rope_scaling_orig_ctx_len(hf["original_max_position_embeddings"])
        w.add_rope_dimension_count(int(0.75 * hf["hidden_size"]) // hf["num_attention_heads"])
        w.add_sliding_window(0)
        scale = hf["max_position_embeddings"] / hf["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(
            np.sqrt(1 + np.log(scale) / np.log(hf["original_max_position_embeddings"])))
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(short, np.float32))

    config = transformers.Phi3Config(**_llama_kwargs(
        rope_parameters=rope, original_max_position_embeddings=64, pad_token_id=0))
    loaded, ids, expected = _gguf_parity(
        tmp_path, config, transformers.Phi3ForCausalLM, gguf.MODEL_ARCH.PHI3, meta, base=False)
    cfg = loaded.config
    assert cfg.rotary_dim == 12 and cfg.rope.rope_type == "longrope"
    unscaled = dataclasses.replace(cfg.rope, attention_factor=1.0)
    assert _control_diff(_with(loaded, rope=unscaled), ids, expected) > TOL


def _granite_meta(w, hf):
    w.add_attention_scale(hf["attention_multiplier"])
    w.add_embedding_scale(hf["embedding_multiplier"])
    w.add_residual_scale(hf["residual_multiplier"])
    w.add_logit_scale(hf["logits_scaling"])


GRANITE = dict(rope_theta=1e4, embedding_multiplier=3.0, residual_multiplier=0.4,
               attention_multiplier=0.05, logits_scaling=2.5)


def test_granite(tmp_path):
    config = transformers.GraniteConfig(**_llama_kwargs(**GRANITE))
    loaded, ids, expected = _gguf_parity(
        tmp_path, config, transformers.GraniteForCausalLM, gguf.MODEL_ARCH.GRANITE,
        _granite_meta, permute=True)
    assert _control_diff(_with(loaded, residual_multiplier=1.0), ids, expected) > TOL


def test_granitemoe(tmp_path):
    config = transformers.GraniteMoeConfig(**_llama_kwargs(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, **GRANITE))
    loaded, ids, expected = _gguf_parity(
        tmp_path, config, transformers.GraniteMoeForCausalLM, gguf.MODEL_ARCH.GRANITE_MOE,
        _granite_meta, permute=True)
    cfg = loaded.config
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.embedding_multiplier) == (8, 32, 3.0)


def test_olmo2(tmp_path):
    config = transformers.Olmo2Config(**_llama_kwargs(rope_theta=1e4, pad_token_id=0))
    loaded, _, _ = _gguf_parity(tmp_path, config, transformers.Olmo2ForCausalLM,
                                gguf.MODEL_ARCH.OLMO2)
    assert loaded.config.post_norms and loaded.config.qk_norm_full


def test_olmo3_as_olmo2_with_sliding_window(tmp_path):
    def meta(w, hf):  # Olmo2Model.set_gguf_parameters: the window and its per-layer flags
        w.add_sliding_window(hf["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in hf["layer_types"]])

    config = transformers.Olmo3Config(**_llama_kwargs(
        num_hidden_layers=3, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                         "full_attention": {"rope_type": "yarn", "rope_theta": 1e4,
                                            "factor": 4.0, "attention_factor": 1.3,
                                            "beta_fast": 16.0,
                                            "original_max_position_embeddings": 16}},
        pad_token_id=0))
    loaded, ids, expected = _gguf_parity(tmp_path, config, transformers.Olmo3ForCausalLM,
                                         gguf.MODEL_ARCH.OLMO2, meta)
    cfg = loaded.config
    assert cfg.sliding_layers == (True, False, True) and cfg.local_rope.theta == 10.0
    assert cfg.rope.rope_type == "yarn" and cfg.local_rope.rope_type == "default"
    assert (cfg.rope.attention_factor, cfg.rope.beta_fast) == (pytest.approx(1.3), 16.0)
    assert _control_diff(_with(loaded, local_rope=None), ids, expected) > TOL


def test_qwen2_moe(tmp_path):
    def meta(w, hf):
        w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(hf["shared_expert_intermediate_size"])

    config = transformers.Qwen2MoeConfig(**_llama_kwargs(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, rope_theta=1e6))
    loaded, _, _ = _gguf_parity(tmp_path, config, transformers.Qwen2MoeForCausalLM,
                                gguf.MODEL_ARCH.QWEN2MOE, meta)
    cfg = loaded.config
    assert cfg.qkv_bias and cfg.shared_expert_intermediate_size == 48 and not cfg.norm_topk_prob


def test_exaone4(tmp_path):
    def meta(w, hf):
        w.add_vocab_size(hf["vocab_size"])
        w.add_sliding_window(hf["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in hf["layer_types"]])

    config = transformers.Exaone4Config(**_llama_kwargs(
        num_hidden_layers=3, sliding_window=WINDOW, sliding_window_pattern=3, rope_theta=1e4,
        pad_token_id=0))
    loaded, _, _ = _gguf_parity(tmp_path, config, transformers.Exaone4ForCausalLM,
                                gguf.MODEL_ARCH.EXAONE4, meta)
    assert loaded.config.rope_layers == (True, True, False)


def test_smollm3(tmp_path):
    # llama.cpp fixes SmolLM3's NoPE interval at 4 (no key): layer 3 of 4 turns nothing.
    config = transformers.SmolLM3Config(**_llama_kwargs(
        num_hidden_layers=4, rope_theta=1e4, pad_token_id=0))
    loaded, ids, expected = _gguf_parity(tmp_path, config, transformers.SmolLM3ForCausalLM,
                                         gguf.MODEL_ARCH.SMOLLM3, permute=True)
    assert loaded.config.rope_layers == (True, True, True, False)
    assert _control_diff(_with(loaded, rope_layers=()), ids, expected) > TOL


def test_seed_oss(tmp_path):
    config = transformers.SeedOssConfig(**_llama_kwargs(
        attention_bias=True, attention_out_bias=False, rope_theta=1e4))
    loaded, _, _ = _gguf_parity(tmp_path, config, transformers.SeedOssForCausalLM,
                                gguf.MODEL_ARCH.SEED_OSS)
    assert loaded.config.qkv_bias and not loaded.config.o_bias


def _deepseek2_meta(w, hf, *, mla_keys: bool = True,
                    gating: gguf.ExpertGatingFuncType = gguf.ExpertGatingFuncType.SOFTMAX):
    """DeepseekV2Model.set_gguf_parameters: the base keys with MLA as MQA (one kv head) and no
    head_dim, then the latent widths (with `mla_keys`, the newer converter's: the cache's as
    key / value_length, the heads' as *_mla; the older one's: the heads' as key / value_length),
    the MoE keys, the gating (V3's: sigmoid, with its `norm_topk_prob`) and yarn's
    mscale_all_dim x 0.1."""
    _base_meta(w, {**hf, "num_key_value_heads": 1, "head_dim": None})
    rope, latent = hf["qk_rope_head_dim"], hf["kv_lora_rank"]
    qk = hf["qk_nope_head_dim"] + rope
    w.add_leading_dense_block_count(hf["first_k_dense_replace"])
    w.add_vocab_size(hf["vocab_size"])
    if hf.get("q_lora_rank") is not None:
        w.add_q_lora_rank(hf["q_lora_rank"])
    w.add_kv_lora_rank(latent)
    if mla_keys:
        w.add_key_length(latent + rope)
        w.add_value_length(latent)
        w.add_key_length_mla(qk)
        w.add_value_length_mla(hf["v_head_dim"])
    else:
        w.add_key_length(qk)
        w.add_value_length(hf["v_head_dim"])
    w.add_expert_count(hf["n_routed_experts"])
    w.add_expert_used_count(hf["num_experts_per_tok"])
    w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    w.add_expert_shared_count(hf["n_shared_experts"])
    w.add_expert_weights_scale(hf["routed_scaling_factor"])
    if hf.get("n_group") is not None:
        w.add_expert_group_count(hf["n_group"])
        w.add_expert_group_used_count(hf["topk_group"])
    w.add_expert_gating_func(gating)
    if gating == gguf.ExpertGatingFuncType.SIGMOID:
        w.add_expert_weights_norm(hf["norm_topk_prob"])
    w.add_rope_dimension_count(rope)
    mscale_all = (hf.get("rope_parameters") or {}).get("mscale_all_dim")
    if mscale_all is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * mscale_all)


def _split_kv_b(tensors: Tensors, hf: dict) -> Tensors:
    """The newer converter's kv_b_proj: per head, the k_nope rows transposed (`attn_k_b`
    [H, C, N]) and the value rows (`attn_v_b` [H, V, C]), the whole tensor dropped."""
    nope, heads = hf["qk_nope_head_dim"], hf["num_key_value_heads"]
    out = {}
    for name, value in tensors.items():
        if not name.endswith("attn_kv_b.weight"):
            out[name] = value
            continue
        per_head = value.reshape(heads, -1, value.shape[-1])  # [H, N + V, C]
        out[name.replace("attn_kv_b", "attn_k_b")] = per_head[:, :nope].transpose(0, 2, 1)
        out[name.replace("attn_kv_b", "attn_v_b")] = per_head[:, nope:]
    return out


def test_deepseek2_kv_b_halves_yarn_and_info(tmp_path, capsys):
    # DeepSeek-V2-Lite's shape: q without a lora, a dense first layer, yarn with mscale equal
    # to mscale_all_dim (all a file can say: llama.cpp takes them equal); the newer converter's
    # file, kv_b_proj in per-head halves. Greedy tokens too, and `jengine info` on the file.
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
            "original_max_position_embeddings": 16, "mscale": 1.3, "mscale_all_dim": 1.3}
    config = _deepseek_config(rope_parameters=yarn)
    loaded, _, _ = _gguf_parity(
        tmp_path, config, transformers.DeepseekV2ForCausalLM, gguf.MODEL_ARCH.DEEPSEEK2,
        _deepseek2_meta, base=False, greedy=True, edit=_split_kv_b)
    cfg = loaded.config
    assert (cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim) == (0, 16, 16)
    assert (cfg.first_dense_layers, cfg.shared_expert_intermediate_size) == (1, 64)
    assert cfg.rope.rope_type == "yarn" and cfg.rope.attention_factor == pytest.approx(1.0)
    # mscale_all_dim read back from yarn_log_multiplier (test_deepseek.py's control shows the
    # logits move past TOL without it): HF's softmax scale, qk_head_dim ** -0.5 * mscale ** 2.
    assert cfg.sm_scale == pytest.approx(24 ** -0.5 * (0.1 * 1.3 * np.log(4.0) + 1) ** 2)
    fields = _info(capsys, str(tmp_path / "model.gguf"))
    assert (fields["format"], fields["architecture"], fields["family"]) == (
        "gguf", "deepseek_v2", "deepseek")
    assert fields["latent_attention"].startswith("kv_lora_rank 32 + rope 8")


def test_deepseek2_q_lora_whole_kv_b_older_keys(tmp_path):
    # The older converter's file: the whole attn_kv_b, the heads' widths as key / value_length;
    # q through its lora, no rope scaling, group-limited routing from the group keys.
    config = _deepseek_config(q_lora_rank=24, rope_parameters=None, n_group=4, topk_group=2,
                              topk_method="group_limited_greedy", num_experts_per_tok=3)
    loaded, _, _ = _gguf_parity(
        tmp_path, config, transformers.DeepseekV2ForCausalLM, gguf.MODEL_ARCH.DEEPSEEK2,
        lambda w, hf: _deepseek2_meta(w, hf, mla_keys=False), base=False)
    cfg = loaded.config
    assert cfg.q_lora_rank == 24 and "wq_a" in loaded.params
    assert (cfg.expert_groups, cfg.topk_groups, cfg.rope.rope_type) == (4, 2, "default")


def test_deepseek2_unknown_gating_is_refused(tmp_path):
    # (DeepSeek-V3's sigmoid gating: tests/models/test_deepseek_v3.py)
    path = tmp_path / "v3.gguf"
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_uint32(gguf.Keys.LLM.EXPERT_GATING_FUNC.format(arch="deepseek2"), 3)  # not 1 or 2
    write_gguf(w)
    with pytest.raises(Exception, match="expert gating function 3"):
        GGUFModel(path).hf_config()


def _info(capsys, model: str) -> dict[str, str]:
    from jengine.cli.main import main

    assert main(["info", model]) == 0
    return dict(line.split(None, 1) for line in capsys.readouterr().out.strip().splitlines())


def test_info_reports_family_parameters_context_and_template(tmp_path, capsys):
    # Qwen2's q/k/v biases count: the parameter count is every weight the model holds, which
    # must equal HF's own count of the same checkpoint.
    captured = []
    config = transformers.Qwen2Config(**_llama_kwargs(rope_theta=1e6))
    _build(tmp_path, config, transformers.Qwen2ForCausalLM, edit=captured.append, greedy=False)
    hf_count = sum(p.numel() for p in captured[0].parameters())
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = _convert(tmp_path, gguf.MODEL_ARCH.QWEN2, lambda w, hf: w.add_chat_template(template))
    for model, has_template in ((str(tmp_path), "False"), (str(path), "True")):
        fields = _info(capsys, model)
        assert (fields["architecture"], fields["family"]) == ("qwen2", "llama"), model
        assert fields["parameters"] == str(hf_count), model
        assert fields["context_length"] == "128", model
        assert fields["chat_template"] == has_template, model
    assert _info(capsys, str(path))["format"] == "gguf"


def test_every_gguf_arch_maps_to_a_model_type_llama_cpp_names():
    from jengine.models.registry import BY_GGUF_ARCH, BY_MODEL_TYPE, gguf_family

    known = set(gguf.MODEL_ARCH_NAMES.values())
    # `mistral` is no llama.cpp architecture (its converter writes Mistral as `llama`); other
    # writers' files carry it, and they load as Mistral.
    assert set(BY_GGUF_ARCH) - {"mistral"} <= known
    assert {gguf_family(arch)[1] for arch in BY_GGUF_ARCH} <= set(BY_MODEL_TYPE)


def test_unknown_arch_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_block_count(1)
    write_gguf(w)
    with pytest.raises(Exception, match="unsupported architecture 'bert'"):
        GGUFModel(path)


@pytest.mark.parametrize(("arch", "layers", "scalar"), [
    ("gemma2", 46, 144), ("gemma2", 26, 256), ("gemma3", 62, 168), ("gemma3", 26, 256)])
def test_gemma_27b_query_scale_follows_llama_cpp(tmp_path, arch, layers, scalar):
    # llama.cpp's rule, by layer count: 27B models scale queries by hidden / heads (Gemma 2
    # 27B: 4608 / 32, Gemma 3 27B: 5376 / 32), the others by head_dim 256. Header only.
    hidden = {"gemma2": 4608, "gemma3": 5376}[arch] if layers in (46, 62) else 2304
    path = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_head_count(32 if layers in (46, 62) else 8)
    w.add_key_length(256)
    w.add_sliding_window(4096)
    write_gguf(w)
    assert GGUFModel(path).hf_config()["query_pre_attn_scalar"] == scalar


def _gpt_oss_tensors(hf: dict, state: Tensors) -> Tensors:
    """What llama.cpp's GptOssModel writes of an HF gpt-oss checkpoint: experts out-first with
    the interleaved gate/up columns split into `ffn_gate_exps` and `ffn_up_exps` (their biases
    too), the sinks as `attn_sinks.weight`, the router as `ffn_gate_inp`."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, hf["num_hidden_layers"])
    out: Tensors = {}
    for key, value in state.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
        blk = f"blk.{m[1]}" if m else ""
        rest = m[2] if m else ""
        if rest == "self_attn.sinks":
            out[f"{blk}.attn_sinks.weight"] = value
        elif rest.startswith("mlp.router."):
            out[f"{blk}.ffn_gate_inp.{rest.split('.')[-1]}"] = value
        elif rest == "mlp.experts.gate_up_proj":  # [X, E, 2F] -> 2 x [X, F, E]
            rows = np.swapaxes(value, 1, 2)
            out[f"{blk}.ffn_gate_exps.weight"], out[f"{blk}.ffn_up_exps.weight"] = (
                rows[:, 0::2], rows[:, 1::2])
        elif rest == "mlp.experts.gate_up_proj_bias":
            out[f"{blk}.ffn_gate_exps.bias"], out[f"{blk}.ffn_up_exps.bias"] = (
                value[:, 0::2], value[:, 1::2])
        elif rest == "mlp.experts.down_proj":  # [X, F, E] -> [X, E, F]
            out[f"{blk}.ffn_down_exps.weight"] = np.swapaxes(value, 1, 2)
        elif rest == "mlp.experts.down_proj_bias":
            out[f"{blk}.ffn_down_exps.bias"] = value
        else:
            name = names.get_name(key, try_suffixes=(".weight", ".bias"))
            assert name is not None, key
            out[name] = value
    return out


def test_gpt_oss_mxfp4_experts(tmp_path):
    """llama.cpp's `gpt-oss` file with its experts in MXFP4 (gguf-py's quantizer) against HF
    holding the same dequantized experts; sliding layers and YaRN from the header."""
    import torch
    from test_gpt_oss import big_sinks, gpt_oss_config

    models: list = []
    config = gpt_oss_config(swiglu_limit=7.0, swiglu_alpha=1.702)
    _, ids, _ = _build(tmp_path, config, transformers.GptOssForCausalLM,
                       edit=lambda m: (big_sinks(m), models.append(m)), greedy=False)
    hf = json.loads((tmp_path / "config.json").read_text())
    path = tmp_path / "model.gguf"
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT_OSS])
    _base_meta(w, hf)
    w.add_sliding_window(hf["sliding_window"])
    w.add_expert_feed_forward_length(hf["intermediate_size"])
    add_tiny_vocab(w, VOCAB)
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    stored: Tensors = {}
    for name, value in _gpt_oss_tensors(hf, load_file(str(tmp_path / "model.safetensors"))).items():
        value = np.ascontiguousarray(value, np.float32)
        if re.search(r"ffn_(gate|up|down)_exps\.weight", name):
            packed = gguf.quants.quantize(value, mxfp4)
            w.add_tensor(name, packed, raw_dtype=mxfp4)
            value = gguf.quants.dequantize(packed, mxfp4)
        else:
            w.add_tensor(name, value)
        stored[name] = value
    write_gguf(w)
    model = models[0]
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            gate, up = (stored[f"blk.{i}.ffn_{kind}_exps.weight"] for kind in ("gate", "up"))
            rows = np.stack([gate, up], axis=2).reshape(gate.shape[0], -1, gate.shape[2])
            layer.mlp.experts.gate_up_proj.copy_(torch.from_numpy(np.swapaxes(rows, 1, 2)))
            layer.mlp.experts.down_proj.copy_(
                torch.from_numpy(np.swapaxes(stored[f"blk.{i}.ffn_down_exps.weight"], 1, 2)))
        expected = model(torch.tensor([ids])).logits[0].float().numpy()
    loaded = load_source(str(path), dtype="float32", progress=False)
    cfg = loaded.config
    assert loaded.kind == "gguf" and cfg.model_type == "gpt_oss"
    assert cfg.sliding_layers == (True, False) and cfg.sliding_window == WINDOW
    assert cfg.rope.rope_type == "yarn" and not cfg.rope.truncate
    assert _max_diff(loaded, ids, expected, decode_steps=0) < TOL  # decodes: test_gpt_oss.py
