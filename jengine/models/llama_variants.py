"""The families that run the Llama network (`jengine/models/llama.py`): one `Family` record each,
saying its HF `model_type`s, the config switches and keys that make it differ from Llama, its
weight rules and its GGUF architecture.

A new Llama-shaped family is a record here (its switches, any keys of its own, any weights of
its own before `LLAMA_RULES`) plus its line in `jengine.models.registry.FAMILIES` and an HF
parity test.
"""

from __future__ import annotations

from typing import Any

from jengine.models.family import Family, GGUFHeader, ModelType
from jengine.models.llama import NETWORK
from jengine.models.weight_rules import (
    COMMON,
    EXPERT,
    LAYER,
    Rule,
    experts_fused_t,
    experts_t,
    heads_bias,
    heads_in,
    same,
    single_row,
    transposed,
)

# Qwen2-MoE's and Qwen3-MoE's experts, Qwen2-MoE's shared expert and its gate (Qwen3-Next's too).
QWEN_MOE_RULES: tuple[Rule, ...] = (
    (LAYER + r"mlp\.gate\.weight", "router", transposed),
    (LAYER + r"mlp" + EXPERT + r"gate_proj\.weight", "we_gate", transposed),
    (LAYER + r"mlp" + EXPERT + r"up_proj\.weight", "we_up", transposed),
    (LAYER + r"mlp" + EXPERT + r"down_proj\.weight", "we_down", transposed),
    (LAYER + r"mlp\.shared_expert\.gate_proj\.weight", "ws_gate", transposed),
    (LAYER + r"mlp\.shared_expert\.up_proj\.weight", "ws_up", transposed),
    (LAYER + r"mlp\.shared_expert\.down_proj\.weight", "ws_down", transposed),
    (LAYER + r"mlp\.shared_expert_gate\.weight", "ws_router", single_row),
)

# Every weight name a Llama-shaped HF or GGUF checkpoint uses for the switches llama.py has.
LLAMA_RULES: tuple[Rule, ...] = COMMON + (
    (r"lm_head\.weight", "lm_head", transposed),
    (LAYER + r"post_attention_layernorm\.weight", "mlp_norm", same),
    (LAYER + r"self_attn\.q_proj\.bias", "bq", heads_bias),
    (LAYER + r"self_attn\.k_proj\.bias", "bk", heads_bias),
    (LAYER + r"self_attn\.v_proj\.bias", "bv", heads_bias),
    (LAYER + r"self_attn\.o_proj\.bias", "bo", same),
    (LAYER + r"mlp\.gate_proj\.bias", "b_gate", same),
    (LAYER + r"mlp\.up_proj\.bias", "b_up", same),
    (LAYER + r"mlp\.down_proj\.bias", "b_down", same),
    (LAYER + r"self_attn\.q_norm\.weight", "q_norm", same),
    (LAYER + r"self_attn\.k_norm\.weight", "k_norm", same),
    # Phi-3: fused projections.
    (LAYER + r"self_attn\.qkv_proj\.weight", ("wq", "wk", "wv"), heads_in),
    (LAYER + r"mlp\.gate_up_proj\.weight", ("w_gate", "w_up"), transposed),
    # OLMo 2: norms on the sub-layer outputs.
    (LAYER + r"post_feedforward_layernorm\.weight", "post_mlp_norm", same),
    # Mixtral's sparse MLP.
    (LAYER + r"block_sparse_moe\.gate\.weight", "router", transposed),
    (LAYER + r"block_sparse_moe" + EXPERT + r"w1\.weight", "we_gate", transposed),
    (LAYER + r"block_sparse_moe" + EXPERT + r"w3\.weight", "we_up", transposed),
    (LAYER + r"block_sparse_moe" + EXPERT + r"w2\.weight", "we_down", transposed),
    # GGUF's (llama.cpp's) MoE layout: each weight of all a layer's experts in one tensor.
    (LAYER + r"mlp\.experts\.gate_proj\.weight", "we_gate", experts_t),
    (LAYER + r"mlp\.experts\.up_proj\.weight", "we_up", experts_t),
    (LAYER + r"mlp\.experts\.down_proj\.weight", "we_down", experts_t),
    # Granite-MoE's: all experts of a layer in one tensor, gate and up fused.
    (LAYER + r"block_sparse_moe\.router\.layer\.weight", "router", transposed),
    (LAYER + r"block_sparse_moe\.input_linear\.weight", ("we_gate", "we_up"), experts_fused_t),
    (LAYER + r"block_sparse_moe\.output_linear\.weight", "we_down", experts_t),
) + QWEN_MOE_RULES

# With post-norms the post_attention_layernorm normalises the attention output.
_POST_NORM_RULES: tuple[Rule, ...] = (
    (LAYER + r"post_attention_layernorm\.weight", "post_attn_norm", same),
)


# ---- GGUF header readers: llama.cpp's keys back into the HF fields they came from.

def gguf_sliding_layers(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    """`attention.sliding_window` and its per-layer pattern (an array of flags, True where
    the window applies) as HF's `sliding_window` and `layer_types`."""
    window = gguf.get("attention.sliding_window")
    if not window:
        return
    cfg["sliding_window"] = int(window)
    pattern = gguf.get("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]


def _gguf_llama(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    """llama.cpp writes Mixtral as `llama` with `llama.expert_count` set."""
    gguf_sliding_layers(gguf, cfg)
    if gguf.get("expert_count"):
        cfg["model_type"] = "mixtral"
        cfg["num_local_experts"] = int(gguf.get("expert_count"))
        cfg["num_experts_per_tok"] = int(gguf.get("expert_used_count"))
        width = gguf.get("expert_feed_forward_length")
        if width is not None:
            cfg["intermediate_size"] = int(width)


def _gguf_no_window(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    """Qwen's configs carry a window that applies only with `use_sliding_window`: llama.cpp
    runs these without one."""
    cfg["use_sliding_window"] = False


def _gguf_qwen_moe(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    if gguf.arch == "qwen3moe":
        # llama.cpp's qwen3moe graph renormalises the top-k weights (norm_w = true) and
        # writes no key for it; its qwen2moe graph does not.
        cfg["norm_topk_prob"] = bool(gguf.get("expert_weights_norm", True))
    else:
        cfg["norm_topk_prob"] = False
        cfg["shared_expert_intermediate_size"] = int(
            gguf.get("expert_shared_feed_forward_length", 0))
    cfg["use_sliding_window"] = False
    cfg["num_experts"] = int(gguf.get("expert_count"))
    cfg["num_experts_per_tok"] = int(gguf.get("expert_used_count"))
    cfg["moe_intermediate_size"] = int(gguf.get("expert_feed_forward_length"))
    cfg.setdefault("intermediate_size", cfg["moe_intermediate_size"])


def _gguf_phi3(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    """Phi-3 / Phi-4-mini: the rotary share as `rope.dimension_count`, longrope as two
    factor tensors, a sliding window when not 0."""
    rotary = gguf.get("rope.dimension_count")
    if rotary is not None:
        cfg["partial_rotary_factor"] = int(rotary) / cfg["head_dim"]
    if gguf.get("attention.sliding_window"):
        cfg["sliding_window"] = int(gguf.get("attention.sliding_window"))
    long = gguf.tensor_values("rope_factors_long.weight")
    short = gguf.tensor_values("rope_factors_short.weight")
    if long is not None and short is not None:
        cfg["original_max_position_embeddings"] = int(
            gguf.get("rope.scaling.original_context_length"))
        cfg["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": long.reshape(-1).tolist(),
            "short_factor": short.reshape(-1).tolist(),
            **({"attention_factor": float(gguf.get("rope.scaling.attn_factor"))}
               if gguf.get("rope.scaling.attn_factor") is not None else {}),
        }


def _gguf_granite(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    for key, hf in (("attention.scale", "attention_multiplier"),
                    ("embedding_scale", "embedding_multiplier"),
                    ("residual_scale", "residual_multiplier"),
                    ("logit_scale", "logits_scaling")):
        if gguf.get(key) is not None:
            cfg[hf] = float(gguf.get(key))
    if gguf.arch == "granitemoe":  # the expert width is the feed-forward length
        cfg["num_local_experts"] = int(gguf.get("expert_count"))
        cfg["num_experts_per_tok"] = int(gguf.get("expert_used_count"))


def _gguf_olmo2(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    """llama.cpp writes OLMo 3 as `olmo2` with a sliding window."""
    gguf_sliding_layers(gguf, cfg)
    if "sliding_window" in cfg:
        cfg["model_type"] = "olmo3"
        if gguf.get("rope.freq_base_swa") is not None:  # a rope per layer type, as HF's
            full = {"rope_type": "default", "rope_theta": cfg["rope_theta"],
                    "max_position_embeddings": cfg["max_position_embeddings"],
                    **cfg.pop("rope_scaling", {})}
            cfg["rope_parameters"] = {
                "full_attention": full,
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": float(gguf.get("rope.freq_base_swa"))},
            }


def _gguf_smollm3(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    # llama.cpp's smollm3 graph drops rope on every 4th layer (its n_no_rope_layer_step,
    # fixed in the loader; no key): HF's default no_rope_layer_interval.
    cfg["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(cfg["num_hidden_layers"])]
    cfg["use_sliding_window"] = False


def _gguf_seed_oss(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    cfg["attention_bias"] = gguf.has_tensor("blk.0.attn_q.bias")
    cfg["attention_out_bias"] = gguf.has_tensor("blk.0.attn_output.bias")


# ---- HF config keys of a family's own.

def _sparse_moe(hf: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Mixtral's and Granite-MoE's experts (Granite-MoE: softmax of the top-k logits, the
    same weights as the renormalised top k of the softmax)."""
    return {
        "num_experts": int(hf["num_local_experts"]),
        "num_experts_per_tok": int(hf["num_experts_per_tok"]),
        "moe_intermediate_size": int(hf["intermediate_size"]),
        "norm_topk_prob": True,
    }


def _qwen_moe(hf: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Qwen2-MoE's and Qwen3-MoE's experts.

    Raises:
      ValueError: dense MLP layers among the sparse ones (`decoder_sparse_step` > 1 or
        `mlp_only_layers`): every layer here is sparse.
    """
    num_layers = fields["num_layers"]
    dense = [i for i in range(num_layers) if i in (hf.get("mlp_only_layers") or [])
             or (i + 1) % int(hf.get("decoder_sparse_step", 1)) != 0]
    if dense:
        raise ValueError(f"MoE layers {dense} have a dense MLP; jengine runs {hf['model_type']} "
                         "only with every layer sparse (decoder_sparse_step 1, no mlp_only_layers)")
    return {
        "shared_expert_intermediate_size": int(hf.get("shared_expert_intermediate_size", 0)),
        "num_experts": int(hf.get("num_experts") or hf["num_local_experts"]),
        "num_experts_per_tok": int(hf["num_experts_per_tok"]),
        "moe_intermediate_size": int(hf["moe_intermediate_size"]),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
    }


def _qwen2_moe(hf: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Qwen2-MoE's q/k/v biases default to on (its `qkv_bias`)."""
    bias = fields["qkv_bias"] or bool(hf.get("qkv_bias", True))
    return {"qkv_bias": bias, **_qwen_moe(hf, fields)}


def _granite(hf: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Granite's multipliers: embeddings, each residual branch, softmax scale, logits."""
    return {
        "embedding_multiplier": float(hf.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(hf.get("residual_multiplier", 1.0)),
        "attention_multiplier": float(hf.get("attention_multiplier", 1.0)),
        "logits_scaling": float(hf.get("logits_scaling", 1.0)),
    }


def _granitemoe(hf: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    return {**_granite(hf, fields), **_sparse_moe(hf, fields)}


def _no_rope_flags(flags: tuple[bool, ...]) -> dict[str, Any]:
    return {"rope_layers": () if all(flags) else flags}


def _smollm3(hf: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """SmolLM3's `no_rope_layers` (1 = rope)."""
    if hf.get("no_rope_layers") is None:
        return {}
    return _no_rope_flags(tuple(bool(f) for f in hf["no_rope_layers"]))


def _exaone4(hf: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """EXAONE 4's global layers of a hybrid model go without rope."""
    sliding = fields["sliding_layers"]
    return _no_rope_flags(sliding) if any(sliding) else {}


def _exaone4_sliding(hf: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """EXAONE 4's `sliding_window_pattern` p without `layer_types`: every p-th layer global."""
    p = int(hf.get("sliding_window_pattern", 4) or 0)
    return tuple(bool(p) and (i + 1) % p != 0 for i in range(num_layers))


# ---- The records.

def _record(name: str, *types: ModelType, **fields: Any) -> Family:
    """A family on the Llama network with Llama's weights unless it names its own."""
    fields.setdefault("hf_weights", LLAMA_RULES)
    return Family(name=name, network=NETWORK, model_types=types, **fields)


_PERMUTED = {"gguf_permuted_qk": True}  # llama.cpp's LlamaModel converter and its subclasses

LLAMA = _record(
    "llama",
    ModelType(name="llama", features="GQA, llama3 / linear / dynamic NTK rope scaling, tied or "
              "separate lm_head", parity_test="test_llama31_rope_scaling"),
    ModelType(name="smollm", features="Llama architecture (as SmolLM2, tested as `llama`)"),
    gguf_archs=(("llama", "llama"),), gguf_config=_gguf_llama, **_PERMUTED)
MISTRAL = _record(
    "mistral",
    ModelType(name="mistral", features="sliding window on every layer",
              parity_test="test_mistral_sliding_window"),
    ModelType(name="ministral", features="per-layer sliding window (`layer_types`)",
              parity_test="test_ministral_per_layer_sliding_window"),
    gguf_archs=(("mistral", "mistral"),), gguf_config=gguf_sliding_layers, **_PERMUTED)
MIXTRAL = _record(
    "mixtral",
    ModelType(name="mixtral", features="MoE (top-k of softmax, renormalised)",
              parity_test="test_mixtral_moe", gguf_note="`llama` with experts"),
    hf_fields=_sparse_moe)
QWEN2 = _record(
    "qwen2",
    ModelType(name="qwen2", features="q/k/v biases", parity_test="test_qwen2_biases"),
    switches={"qkv_bias": True, "o_bias": False}, sliding_window_flag=True,
    gguf_archs=(("qwen2", "qwen2"),), gguf_config=_gguf_no_window)
QWEN3 = _record(
    "qwen3",
    ModelType(name="qwen3", features="per-head q/k RMSNorm, yarn rope",
              parity_test="test_qwen3_qk_norm"),
    switches={"qk_norm": True}, sliding_window_flag=True,
    gguf_archs=(("qwen3", "qwen3"),), gguf_config=_gguf_no_window)
QWEN3_MOE = _record(
    "qwen3_moe",
    ModelType(name="qwen3_moe", features="MoE (top-k of softmax, `norm_topk_prob`), per-head "
              "q/k norm", parity_test="test_qwen3_moe"),
    switches={"qk_norm": True}, hf_fields=_qwen_moe, sliding_window_flag=True,
    gguf_archs=(("qwen3moe", "qwen3_moe"),), gguf_config=_gguf_qwen_moe)
QWEN2_MOE = _record(
    "qwen2_moe",
    ModelType(name="qwen2_moe", features="MoE with a sigmoid-gated shared expert, q/k/v biases",
              parity_test="test_qwen2_moe_shared_expert"),
    hf_fields=_qwen2_moe, sliding_window_flag=True,
    gguf_archs=(("qwen2moe", "qwen2_moe"),), gguf_config=_gguf_qwen_moe)
GRANITE = _record(
    "granite",
    ModelType(name="granite", features="embedding / residual / attention / logit multipliers",
              parity_test="test_granite_multipliers"),
    hf_fields=_granite, gguf_archs=(("granite", "granite"),), gguf_config=_gguf_granite,
    **_PERMUTED)
GRANITEMOE = _record(
    "granitemoe",
    ModelType(name="granitemoe", features="MoE (softmax of the top-k logits), fused stacked "
              "experts, Granite's multipliers", parity_test="test_granitemoe"),
    hf_fields=_granitemoe, gguf_archs=(("granitemoe", "granitemoe"),),
    gguf_config=_gguf_granite, **_PERMUTED)
PHI3 = _record(
    "phi3",
    ModelType(name="phi3", features="fused qkv_proj / gate_up_proj, partial rotary, longrope "
              "(short and long factors, by position)",
              parity_test="test_phi3_fused_projections_and_partial_rotary"),
    gguf_archs=(("phi3", "phi3"),), gguf_config=_gguf_phi3,
    gguf_tensor_names={"ffn_up": "mlp.gate_up_proj"})  # gate and up, fused as HF's
# OLMo 2 / 3: the layer norms on the attention / MLP outputs, the q/k norm weights over every
# head ([H*D] -> [H, D]).
OLMO2 = _record(
    "olmo2",
    ModelType(name="olmo2", features="post-norms, q/k norm over the full width",
              parity_test="test_olmo2_post_norms_and_full_width_qk_norm"),
    ModelType(name="olmo3", features="OLMo 2 + sliding layers with their own rope (yarn on the "
              "global ones)", parity_test="test_olmo3_sliding_layers_with_their_own_rope",
              gguf_note="`olmo2` with a sliding window"),
    switches={"qk_norm_full": True, "post_norms": True},
    hf_weights=_POST_NORM_RULES + (
        (LAYER + r"self_attn\.q_norm\.weight", "q_norm", heads_bias),
        (LAYER + r"self_attn\.k_norm\.weight", "k_norm", heads_bias),
    ) + LLAMA_RULES,
    gguf_archs=(("olmo2", "olmo2"),), gguf_config=_gguf_olmo2)
# EXAONE 4: OLMo 2's post-norms with Qwen3's per-head q/k norms.
EXAONE4 = _record(
    "exaone4",
    ModelType(name="exaone4", features="post-norms, per-head q/k norm, sliding layers, global "
              "layers without rope",
              parity_test="test_exaone4_post_norms_per_head_qk_norm_and_global_nope"),
    switches={"qk_norm": True, "post_norms": True}, hf_fields=_exaone4,
    default_sliding=_exaone4_sliding, hf_weights=_POST_NORM_RULES + LLAMA_RULES,
    gguf_archs=(("exaone4", "exaone4"),), gguf_config=gguf_sliding_layers)
SMOLLM3 = _record(
    "smollm3",
    ModelType(name="smollm3", features="no rope on every n-th layer (`no_rope_layers`)",
              parity_test="test_smollm3_no_rope_layers"),
    hf_fields=_smollm3, sliding_window_flag=True, tied_by_default=True,
    gguf_archs=(("smollm3", "smollm3"),), gguf_config=_gguf_smollm3, **_PERMUTED)
SEED_OSS = _record(
    "seed_oss",
    ModelType(name="seed_oss", features="q/k/v biases without an o_proj bias",
              parity_test="test_seed_oss_qkv_bias_without_o_bias"),
    gguf_archs=(("seed_oss", "seed_oss"),), gguf_config=_gguf_seed_oss)
