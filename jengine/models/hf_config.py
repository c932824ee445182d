"""An HF `config.json` dict (transformers 4.x or 5.x layout) read into a `ModelConfig`: what
each family's keys mean, the defaults HF assumes, and the configurations jengine refuses."""

from __future__ import annotations

import math
from typing import Any

from jengine.models.config import FAMILIES, ModelConfig, RopeConfig


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Builds the config from an HF `config.json` dict (transformers 4.x or 5.x layout).

    Raises:
      ValueError: an architecture, rope scaling or MoE layout jengine does not run.
    """
    model_type = hf.get("model_type")
    if model_type == "deepseek_v2":
        return _deepseek_v2_from_hf(hf)
    if model_type == "gemma3" and "text_config" in hf:
        hf = {**hf["text_config"], "model_type": "gemma3_text"}
        model_type = "gemma3_text"
    if model_type not in FAMILIES:
        archs = hf.get("architectures") or []
        raise ValueError(
            f"unsupported architecture {model_type!r} {archs}; jengine supports "
            f"{sorted(FAMILIES)}"
        )
    num_layers = int(hf["num_hidden_layers"])
    num_heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // num_heads)
    rope, local_rope = _rope_from_hf(hf)
    if FAMILIES[model_type] == "gemma3" and rope.rope_type in ("yarn", "longrope", "dynamic"):
        raise ValueError(f"rope scaling {rope.rope_type!r} is not built for {model_type}")
    sliding_window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if model_type in _USE_SLIDING_WINDOW and not hf.get("use_sliding_window", False):
        sliding_window = None
    if sliding_window is None:
        sliding_layers = (False,) * num_layers
    elif layer_types:
        sliding_layers = tuple(t == "sliding_attention" for t in layer_types)
    elif model_type == "exaone4":
        sliding_layers = _exaone4_sliding(hf.get("sliding_window_pattern", 4), num_layers)
    elif FAMILIES[model_type] == "gemma3":
        default = 2 if model_type == "gemma2" else 6  # Gemma 2 alternates from layer 0
        pattern = int(hf.get("sliding_window_pattern",
                             hf.get("_sliding_window_pattern", default)))
        sliding_layers = tuple((i + 1) % pattern != 0 for i in range(num_layers))
    else:
        sliding_layers = (True,) * num_layers
    if not any(sliding_layers):
        sliding_window = None
    is_gemma = FAMILIES[model_type] == "gemma3"
    attention_bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        max_position_embeddings=_context_length(hf, rope),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=rope,
        local_rope=local_rope,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", model_type in _TIED_BY_DEFAULT)),
        qkv_bias=(model_type == "qwen2" or attention_bias
                  or (model_type == "qwen2_moe" and bool(hf.get("qkv_bias", True)))),
        o_bias=bool(hf.get("attention_out_bias", attention_bias)) and model_type != "qwen2",
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "exaone4"),
        qk_norm_full=model_type in ("olmo2", "olmo3"),
        post_norms=model_type in ("olmo2", "olmo3", "exaone4"),
        partial_rotary_factor=_partial_rotary_factor(hf),
        rope_layers=_rope_layers(hf, model_type, sliding_layers),
        **_granite_scalars(hf) if model_type in ("granite", "granitemoe") else {},
        **_moe_from_hf(hf, model_type, num_layers),
        sliding_window=None if sliding_window is None else int(sliding_window),
        sliding_layers=sliding_layers,
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar") if is_gemma else None,
        final_logit_softcapping=hf.get("final_logit_softcapping"),
        attn_logit_softcapping=hf.get("attn_logit_softcapping"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf),
    )


# The HF config classes whose `tie_word_embeddings` defaults to True (every other family's is
# False): what a config.json that leaves the key out means. Either value loads: an untied
# checkpoint's `lm_head.weight` is every family's output head.
_TIED_BY_DEFAULT = ("gemma2", "gemma3", "gemma3_text", "smollm3")


def _eos_ids(hf: dict[str, Any]) -> tuple[int, ...]:
    """`eos_token_id` as a tuple: HF gives one id, a list of them, or none."""
    eos = hf.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


def _context_length(hf: dict[str, Any], rope: RopeConfig) -> int:
    """The positions the model serves: longrope with only its short factors stops where HF
    would switch to the long ones; dynamic NTK goes `factor` times past the trained length (as
    vLLM does: HF sets no limit)."""
    trained = int(hf.get("max_position_embeddings", 2048))
    if rope.rope_type == "longrope" and rope.long_factors is None:
        return rope.original_max_position_embeddings
    if rope.rope_type == "dynamic":
        return int(trained * max(rope.factor, 1.0))
    return trained


def _deepseek_v2_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """DeepSeek-V2 (and -Lite): multi-head latent attention and DeepSeek's MoE.

    The softmax scale is HF's: (qk_nope + qk_rope) ** -0.5, times yarn's
    mscale(factor, mscale_all_dim) ** 2 under a scaled rope; the rope's own attention factor
    (mscale / mscale_all_dim) scales the rotated q and k parts.

    Raises:
      ValueError: a routing method other than greedy / group-limited greedy.
    """
    num_layers = int(hf["num_hidden_layers"])
    rope, _ = _rope_from_hf(hf)
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    nope, rope_dim = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
    scale = float(nope + rope_dim) ** -0.5
    if rope.rope_type != "default" and params.get("mscale_all_dim"):
        m = 0.1 * float(params["mscale_all_dim"]) * math.log(rope.factor) + 1.0
        scale *= m * m if rope.factor > 1 else 1.0
    method = hf.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"deepseek_v2 routing {method!r} is not built "
                         "(greedy, group_limited_greedy)")
    grouped = method == "group_limited_greedy"
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("deepseek_v2 with attention or MLP biases is not built")
    num_experts = int(hf["n_routed_experts"])
    moe_width = int(hf["moe_intermediate_size"])
    return ModelConfig(
        model_type="deepseek_v2",
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=num_layers,
        num_heads=int(hf["num_attention_heads"]),
        num_kv_heads=1,  # every q head reads the one latent row per token (MQA over the latent)
        head_dim=int(hf["kv_lora_rank"]) + rope_dim,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=rope,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_multiplier=scale,
        kv_lora_rank=int(hf["kv_lora_rank"]),
        q_lora_rank=int(hf.get("q_lora_rank") or 0),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(hf["v_head_dim"]),
        num_experts=num_experts,
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=moe_width,
        shared_expert_intermediate_size=moe_width * int(hf.get("n_shared_experts") or 0),
        first_dense_layers=min(int(hf.get("first_k_dense_replace", 0)), num_layers),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        expert_groups=int(hf["n_group"]) if grouped else 0,
        topk_groups=int(hf["topk_group"]) if grouped else 0,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf),
    )


# Families whose sliding window applies only with `use_sliding_window` set.
_USE_SLIDING_WINDOW = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "smollm3")


def _exaone4_sliding(pattern: int | None, num_layers: int) -> tuple[bool, ...]:
    """EXAONE 4's `sliding_window_pattern` p without `layer_types`: every p-th layer global."""
    p = int(pattern or 0)
    return tuple(bool(p) and (i + 1) % p != 0 for i in range(num_layers))


def _rope_layers(hf: dict[str, Any], model_type: str,
                 sliding_layers: tuple[bool, ...]) -> tuple[bool, ...]:
    """Per layer, whether rope applies: SmolLM3's `no_rope_layers` (1 = rope), EXAONE 4's
    global layers of a hybrid model go without; () when every layer has rope."""
    if model_type == "smollm3" and hf.get("no_rope_layers") is not None:
        flags = tuple(bool(f) for f in hf["no_rope_layers"])
    elif model_type == "exaone4" and any(sliding_layers):
        flags = sliding_layers
    else:
        return ()
    return () if all(flags) else flags


def _partial_rotary_factor(hf: dict[str, Any]) -> float:
    """transformers 5 keeps it in `rope_parameters`, 4.x at the top level."""
    params = hf.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))


def _moe_from_hf(hf: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """The MoE fields of a Mixtral, Qwen2-MoE or Qwen3-MoE config ({} for dense families).

    Raises:
      ValueError: a Qwen2/3-MoE config with dense MLP layers among the sparse ones
        (`decoder_sparse_step` > 1 or `mlp_only_layers`): every layer here is sparse.
    """
    if model_type in ("mixtral", "granitemoe"):  # Granite-MoE: softmax of the top-k logits
        return {
            "num_experts": int(hf["num_local_experts"]),
            "num_experts_per_tok": int(hf["num_experts_per_tok"]),
            "moe_intermediate_size": int(hf["intermediate_size"]),
            "norm_topk_prob": True,
        }
    if model_type not in ("qwen2_moe", "qwen3_moe"):
        return {}
    dense = [i for i in range(num_layers) if i in (hf.get("mlp_only_layers") or [])
             or (i + 1) % int(hf.get("decoder_sparse_step", 1)) != 0]
    if dense:
        raise ValueError(f"MoE layers {dense} have a dense MLP; jengine runs {model_type} "
                         "only with every layer sparse (decoder_sparse_step 1, no mlp_only_layers)")
    return {
        "shared_expert_intermediate_size": int(hf.get("shared_expert_intermediate_size", 0)),
        "num_experts": int(hf.get("num_experts") or hf["num_local_experts"]),
        "num_experts_per_tok": int(hf["num_experts_per_tok"]),
        "moe_intermediate_size": int(hf["moe_intermediate_size"]),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
    }


def _granite_scalars(hf: dict[str, Any]) -> dict[str, float]:
    return {
        "embedding_multiplier": float(hf.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(hf.get("residual_multiplier", 1.0)),
        "attention_multiplier": float(hf.get("attention_multiplier", 1.0)),
        "logits_scaling": float(hf.get("logits_scaling", 1.0)),
    }


def _rope_from_hf(hf: dict[str, Any]) -> tuple[RopeConfig, RopeConfig | None]:
    """Rope settings from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters")
    if params and "full_attention" in params:  # per layer type (Gemma 3 in transformers 5)
        full = RopeConfig.from_hf(params["full_attention"])
        local = params.get("sliding_attention")
        return full, RopeConfig.from_hf(local) if local else None
    # Longrope's factors depend on these two top-level fields (Phi-3 keeps them there).
    positions = {key: hf[key] for key in ("original_max_position_embeddings",
                                          "max_position_embeddings") if key in hf}
    if params:
        return RopeConfig.from_hf({**positions, **params}, hf.get("rope_theta")), None
    scaling = hf.get("rope_scaling")
    scaling = {**positions, **scaling} if scaling else None
    rope = RopeConfig.from_hf(scaling, hf.get("rope_theta", 10000.0))
    local = None
    if "rope_local_base_freq" in hf:
        local = RopeConfig(theta=float(hf["rope_local_base_freq"]))
    return rope, local
