"""GLM-4.5 / GLM-4.6 (`glm4_moe`): the Llama network (`llama.py`) with DeepSeek-V3's MoE.

Attention is Llama's with q/k/v biases (`attention_bias`, no o_proj bias), a partial rotary
(`partial_rotary_factor`, 0.5 by default: the first half of each head turns, halves rotated as
Llama's) and, with `use_qk_norm`, a per-head q/k RMSNorm as Qwen3's. The MLP is dense on the
first `first_k_dense_replace` layers, then DeepSeek-V3's MoE: sigmoid router scores with a
per-expert correction bias choosing groups and experts (`moe._route_sigmoid`), renormalised
top-k weights (`norm_topk_prob`) x `routed_scaling_factor`, plus un-gated shared experts. Its
checkpoints carry multi-token-prediction layers after the last one (skipped), and so do
llama.cpp's `glm4moe` files (counted in their block count, their own tensors under `nextn.`).
"""

from __future__ import annotations

from typing import Any

from jengine.models.config import ModelConfig
from jengine.models.family import Family, GGUFHeader, ModelType
from jengine.models.llama import NETWORK
from jengine.models.llama_variants import LLAMA_RULES
from jengine.models.weight_rules import LAYER, Rule, mtp_layers_skipped, same, transposed

_GLM_RULES: tuple[Rule, ...] = (
    (LAYER + r"mlp\.gate\.e_score_correction[._]bias", "router_bias", same),  # HF's, GGUF's
    (LAYER + r"mlp\.shared_experts\.gate_proj\.weight", "ws_gate", transposed),
    (LAYER + r"mlp\.shared_experts\.up_proj\.weight", "ws_up", transposed),
    (LAYER + r"mlp\.shared_experts\.down_proj\.weight", "ws_down", transposed),
)


def _fields(hf: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5's MoE and attention switches from its own keys."""
    groups = int(hf.get("n_group") or 1)
    moe_width = int(hf["moe_intermediate_size"])
    return {
        "o_bias": False,
        "qk_norm": bool(hf.get("use_qk_norm", False)),
        "partial_rotary_factor": float((hf.get("rope_parameters") or {}).get(
            "partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))),
        "num_experts": int(hf["n_routed_experts"]),
        "num_experts_per_tok": int(hf["num_experts_per_tok"]),
        "moe_intermediate_size": moe_width,
        "shared_expert_intermediate_size": moe_width * int(hf.get("n_shared_experts") or 0),
        "shared_expert_gate": False,
        "first_dense_layers": min(int(hf.get("first_k_dense_replace", 1)),
                                  fields["num_layers"]),
        "router_scoring": "sigmoid",
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "expert_groups": groups if groups > 1 else 0,
        "topk_groups": int(hf.get("topk_group") or 1) if groups > 1 else 0,
        "mtp_layers": int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0),
    }


def _gguf_config(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    """llama.cpp's `glm4moe` keys as HF's. Its block count includes the multi-token-prediction
    layers (`nextn_predict_layers`), whose tensors it writes after the last layer."""
    nextn = int(gguf.get("nextn_predict_layers", 0))
    rope = gguf.get("rope.dimension_count")
    cfg.update(
        num_hidden_layers=cfg["num_hidden_layers"] - nextn,
        num_nextn_predict_layers=nextn,
        n_routed_experts=int(gguf.get("expert_count")),
        num_experts_per_tok=int(gguf.get("expert_used_count")),
        n_shared_experts=int(gguf.get("expert_shared_count", 0)),
        moe_intermediate_size=int(gguf.get("expert_feed_forward_length")),
        first_k_dense_replace=int(gguf.get("leading_dense_block_count", 0)),
        routed_scaling_factor=float(gguf.get("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(gguf.get("expert_weights_norm", True)),
        n_group=int(gguf.get("expert_group_count", 1)),
        topk_group=int(gguf.get("expert_group_used_count", 1)),
        attention_bias=gguf.has_tensor("blk.0.attn_q.bias"),
        use_qk_norm=gguf.has_tensor("blk.0.attn_q_norm.weight"),
        partial_rotary_factor=1.0 if rope is None else int(rope) / cfg["head_dim"],
    )


def _weight_rules(cfg: ModelConfig) -> tuple[Rule, ...]:
    return (*mtp_layers_skipped(cfg), *_GLM_RULES, *LLAMA_RULES)


GLM4_MOE = Family(
    name="glm4_moe",
    network=NETWORK,
    model_types=(ModelType(
        name="glm4_moe",
        features="q/k/v biases, partial rotary, optional per-head q/k norm; dense first layers "
                 "then DeepSeek-V3's MoE (sigmoid routing with the correction bias, groups, "
                 "un-gated shared experts); multi-token-prediction layers skipped",
        parity_test="test_glm4_moe"),),
    hf_fields=_fields,
    hf_weights_for=_weight_rules,
    gguf_archs=(("glm4moe", "glm4_moe"),),
    gguf_config=_gguf_config,
    gguf_tensor_names={
        "exp_probs_b": "mlp.gate.e_score_correction",  # `.bias`: the correction bias
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
    },
)
