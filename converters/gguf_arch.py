"""Per-architecture GGUF header readers: the metadata keys llama.cpp's converter writes for one
architecture, turned back into the HF config fields they came from (`ARCH_CONFIG`, applied by
`GGUFModel.hf_config` after the keys every architecture shares)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

from converters.errors import ModelLoadError
from converters.gguf_reader import TensorInfo


class GGUFHeader(Protocol):
    """What a reader here uses of `converters.gguf_file.GGUFModel`."""

    arch: str
    path: Path

    def _get(self, key: str, default: Any = None) -> Any: ...
    def _tensor(self, name: str) -> TensorInfo | None: ...
    def _dequantize(self, t: TensorInfo) -> np.ndarray: ...

_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's test for its 27B attention scale
# The model type of an architecture's files with a sliding window (llama.cpp writes OLMo 3 as
# `olmo2`).
ARCH_WITH_SLIDING_WINDOW = {"olmo2": "olmo3"}
# llama.cpp's expert gating functions (its `expert_gating_func` key).
_GATING_SOFTMAX = 1


def sliding_layers(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    """`attention.sliding_window` and its per-layer pattern (an array of flags, True where
    the window applies) as HF's `sliding_window` and `layer_types`."""
    window = gguf._get("attention.sliding_window")
    if not window:
        return
    cfg["sliding_window"] = int(window)
    pattern = gguf._get("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]


def gemma_config(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    cfg["sliding_window"] = int(gguf._get("attention.sliding_window", 4096))
    # llama.cpp scales queries by hidden / heads for the 27B models (46 layers in Gemma 2,
    # 62 in Gemma 3: their query_pre_attn_scalar), by head_dim otherwise; no key says it.
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    cfg["query_pre_attn_scalar"] = (cfg["hidden_size"] // heads
                                    if layers == _GEMMA_27B_LAYERS[gguf.arch]
                                    else cfg["head_dim"])
    if gguf.arch == "gemma3":
        cfg["rope_local_base_freq"] = 10000.0
        cfg["sliding_window_pattern"] = 6
        return
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if gguf._get(key) is not None:
            cfg[key] = float(gguf._get(key))


def phi3_config(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    """Phi-3 / Phi-4-mini: the rotary share as `rope.dimension_count`, longrope as two
    factor tensors, a sliding window when not 0."""
    rotary = gguf._get("rope.dimension_count")
    if rotary is not None:
        cfg["partial_rotary_factor"] = int(rotary) / cfg["head_dim"]
    if gguf._get("attention.sliding_window"):
        cfg["sliding_window"] = int(gguf._get("attention.sliding_window"))
    long, short = gguf._tensor("rope_factors_long.weight"), gguf._tensor(
        "rope_factors_short.weight")
    if long is not None and short is not None:
        cfg["original_max_position_embeddings"] = int(
            gguf._get("rope.scaling.original_context_length"))
        cfg["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": gguf._dequantize(long).reshape(-1).tolist(),
            "short_factor": gguf._dequantize(short).reshape(-1).tolist(),
            **({"attention_factor": float(gguf._get("rope.scaling.attn_factor"))}
               if gguf._get("rope.scaling.attn_factor") is not None else {}),
        }


def granite_config(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    for key, hf in (("attention.scale", "attention_multiplier"),
                    ("embedding_scale", "embedding_multiplier"),
                    ("residual_scale", "residual_multiplier"),
                    ("logit_scale", "logits_scaling")):
        if gguf._get(key) is not None:
            cfg[hf] = float(gguf._get(key))
    if gguf.arch == "granitemoe":  # the expert width is the feed-forward length
        cfg["num_local_experts"] = int(gguf._get("expert_count"))
        cfg["num_experts_per_tok"] = int(gguf._get("expert_used_count"))


def olmo2_config(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    sliding_layers(gguf, cfg)
    if "sliding_window" in cfg:
        cfg["model_type"] = ARCH_WITH_SLIDING_WINDOW[gguf.arch]
        if gguf._get("rope.freq_base_swa") is not None:  # a rope per layer type, as HF's
            full = {"rope_type": "default", "rope_theta": cfg["rope_theta"],
                    "max_position_embeddings": cfg["max_position_embeddings"],
                    **cfg.pop("rope_scaling", {})}
            cfg["rope_parameters"] = {
                "full_attention": full,
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": float(gguf._get("rope.freq_base_swa"))},
            }


def qwen_moe_config(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    if gguf.arch == "qwen3moe":
        # llama.cpp's qwen3moe graph renormalises the top-k weights (norm_w = true) and
        # writes no key for it; its qwen2moe graph does not.
        cfg["norm_topk_prob"] = bool(gguf._get("expert_weights_norm", True))
        return
    cfg["norm_topk_prob"] = False
    cfg["shared_expert_intermediate_size"] = int(
        gguf._get("expert_shared_feed_forward_length", 0))


def smollm3_config(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    # llama.cpp's smollm3 graph drops rope on every 4th layer (its n_no_rope_layer_step,
    # fixed in the loader; no key): HF's default no_rope_layer_interval.
    cfg["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(cfg["num_hidden_layers"])]


def seed_oss_config(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    names = {t.name for t in gguf.reader.tensors}
    cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    cfg["attention_out_bias"] = "blk.0.attn_output.bias" in names


def deepseek2_config(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    """DeepSeek-V2's latent attention and MoE keys as HF's `deepseek_v2` fields.

    llama.cpp's converter writes the cache's widths as key / value_length (kv_lora_rank +
    rope, kv_lora_rank) and the heads' as key / value_length_mla; files older than that
    have only the heads' widths, as key / value_length. Its yarn mscale_all_dim is stored
    x 0.1 as `yarn_log_multiplier`, and its graph takes `mscale` equal to it (no key).

    Raises:
      ModelLoadError: sigmoid expert gating or renormalised top-k weights (DeepSeek-V3's,
        which llama.cpp writes as `deepseek2` too).
    """
    if int(gguf._get("expert_gating_func", _GATING_SOFTMAX)) != _GATING_SOFTMAX:
        raise ModelLoadError(f"{gguf.path.name}: deepseek2 with sigmoid expert gating "
                             "(DeepSeek-V3) is not built")
    if gguf._get("expert_weights_norm"):
        raise ModelLoadError(f"{gguf.path.name}: deepseek2 with renormalised top-k expert "
                             "weights is not built (DeepSeek-V2 does not renormalise)")
    rope = int(gguf._get("rope.dimension_count"))
    mla = gguf._get("attention.key_length_mla") is not None
    heads = cfg["num_attention_heads"]
    key = int(gguf._get("attention.key_length_mla" if mla else "attention.key_length",
                        cfg["hidden_size"] // heads))
    value = int(gguf._get("attention.value_length_mla" if mla else "attention.value_length",
                          key - rope))
    cfg.pop("head_dim")  # the file's key_length: not a head width here
    moe_width = int(gguf._get("expert_feed_forward_length"))
    cfg.setdefault("intermediate_size", moe_width)
    cfg.update(
        kv_lora_rank=int(gguf._get("attention.kv_lora_rank")),
        q_lora_rank=(int(gguf._get("attention.q_lora_rank"))
                     if gguf._get("attention.q_lora_rank") else None),
        qk_rope_head_dim=rope, qk_nope_head_dim=key - rope, v_head_dim=value,
        n_routed_experts=int(gguf._get("expert_count")),
        num_experts_per_tok=int(gguf._get("expert_used_count")),
        moe_intermediate_size=moe_width,
        n_shared_experts=int(gguf._get("expert_shared_count", 0)),
        first_k_dense_replace=int(gguf._get("leading_dense_block_count", 0)),
        routed_scaling_factor=float(gguf._get("expert_weights_scale", 1.0)),
        topk_method="greedy",
    )
    groups = int(gguf._get("expert_group_count", 1))
    if groups > 1:  # HF's group-limited greedy: the best groups' experts only
        cfg.update(topk_method="group_limited_greedy", n_group=groups,
                   topk_group=int(gguf._get("expert_group_used_count")))
    log_mul = gguf._get("rope.scaling.yarn_log_multiplier")
    if "rope_scaling" in cfg and log_mul:
        mscale = float(log_mul) / 0.1
        cfg["rope_scaling"].update(mscale=mscale, mscale_all_dim=mscale)


ARCH_CONFIG = {
    "llama": sliding_layers, "mistral": sliding_layers,
    "exaone4": sliding_layers,
    "gemma2": gemma_config, "gemma3": gemma_config,
    "phi3": phi3_config,
    "granite": granite_config, "granitemoe": granite_config,
    "olmo2": olmo2_config,
    "qwen2moe": qwen_moe_config, "qwen3moe": qwen_moe_config,
    "smollm3": smollm3_config,
    "seed_oss": seed_oss_config,
    "deepseek2": deepseek2_config,
}
