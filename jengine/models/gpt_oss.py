"""gpt-oss (`gpt_oss`): the Llama network (`llama.py`) with gpt-oss's switches.

- Attention: q/k/v/o biases; a learned sink logit per q head that joins every softmax's
  denominator and weighs no value (`ModelConfig.attention_sinks`, taken by the `reference` and
  `cpu` attention backends, refused by the Pallas ones at start: `core.build.check_sinks`);
  sliding-window layers alternating with full ones (sliding first, HF's default when the config
  names no `layer_types`); YaRN rope, untruncated, over half-split head dims (Llama's pairs).
- MoE on every layer: the router's logits with its bias, the top k of them softmaxed
  (`moe.route_gpt_oss`); experts with biases and the clamped SwiGLU (`moe.clamped_swiglu`),
  their gate/up weight kept fused with the columns interleaved as HF stores it ([X, E, 2F],
  input-first), so a tensor-parallel split of the 2F axis keeps each (gate, up) pair together
  and matches the split of `down_proj`'s F rows.
- The published checkpoints store the experts as MXFP4 (`*_blocks` / `*_scales`):
  `converters.mxfp4` dequantizes them at load.
- llama.cpp's `gpt-oss` GGUF files split the experts' gate and up (each [X, F, E], out-first,
  their MXFP4 blocks dequantized by the GGUF reader) and store the sinks as `attn_sinks.weight`;
  the reader joins gate and up back into HF's interleaved rows (`Family.gguf_interleaved`).
  Its converter writes no SwiGLU keys (llama.cpp takes HF's defaults, 1.702 and 7.0), no layer
  types (sliding on even layers, as HF's default) and an untruncated YaRN.
"""

from __future__ import annotations

from typing import Any

from jengine.models.family import Family, GGUFHeader, ModelType
from jengine.models.llama import NETWORK
from jengine.models.llama_variants import LLAMA_RULES
from jengine.models.weight_rules import LAYER, Rule, experts_t, same, transposed

_RULES: tuple[Rule, ...] = (
    (LAYER + r"self_attn\.sinks", "sinks", same),
    (LAYER + r"mlp\.router\.weight", "router", transposed),
    (LAYER + r"mlp\.router\.bias", "router_bias", same),
    (LAYER + r"mlp\.experts\.gate_up_proj", "we_gate_up", same),
    (LAYER + r"mlp\.experts\.gate_up_proj_bias", "be_gate_up", same),
    (LAYER + r"mlp\.experts\.down_proj", "we_down", same),
    (LAYER + r"mlp\.experts\.down_proj_bias", "be_down", same),
    # The names GGUF files read as (`gguf_tensor_names`, `gguf_interleaved`): out-first.
    (LAYER + r"self_attn\.sinks\.weight", "sinks", same),
    (LAYER + r"mlp\.experts\.gate_up_proj\.weight", "we_gate_up", experts_t),
    (LAYER + r"mlp\.experts\.gate_up_proj\.bias", "be_gate_up", same),
    (LAYER + r"mlp\.experts\.down_proj\.weight", "we_down", experts_t),
    (LAYER + r"mlp\.experts\.down_proj\.bias", "be_down", same),
) + LLAMA_RULES


def _default_sliding(hf: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """HF's default without `layer_types`: sliding on even layers, full on odd ones."""
    return tuple(i % 2 == 0 for i in range(num_layers))


def _fields(hf: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's attention sinks and MoE from its own keys (HF's defaults where absent)."""
    return {
        "attention_sinks": True,
        "num_experts": int(hf.get("num_local_experts", hf.get("num_experts", 128))),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok", 4)),
        "moe_intermediate_size": int(hf["intermediate_size"]),
        "shared_expert_intermediate_size": 0,
        "router_scoring": "gpt_oss",
        "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
        "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
        "qkv_bias": bool(hf.get("attention_bias", True)),
        "o_bias": bool(hf.get("attention_bias", True)),
    }


def _gguf_config(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    """llama.cpp's `gpt-oss` keys as HF's."""
    cfg.update(
        num_local_experts=int(gguf.get("expert_count")),
        num_experts_per_tok=int(gguf.get("expert_used_count")),
        intermediate_size=int(gguf.get("expert_feed_forward_length")),
        sliding_window=int(gguf.get("attention.sliding_window")),
        attention_bias=True,
    )
    if (cfg.get("rope_scaling") or {}).get("rope_type") == "yarn":
        cfg["rope_scaling"]["truncate"] = False


GPT_OSS = Family(
    name="gpt_oss",
    network=NETWORK,
    model_types=(ModelType(
        name="gpt_oss",
        features="attention sinks, q/k/v/o biases, sliding layers alternating with full ones, "
                 "YaRN rope; MoE of the top-k biased router logits (softmaxed) over experts "
                 "with biases and the clamped SwiGLU; MXFP4 experts dequantized at load",
        parity_test="test_gpt_oss"),),
    hf_fields=_fields,
    default_sliding=_default_sliding,
    hf_weights=_RULES,
    gguf_archs=(("gpt-oss", "gpt_oss"),),
    gguf_config=_gguf_config,
    gguf_tensor_names={"attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.router",
                       "ffn_down_exps": "mlp.experts.down_proj"},
    gguf_interleaved={"ffn_gate_exps": ("ffn_up_exps", "mlp.experts.gate_up_proj")},
)
