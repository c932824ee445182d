"""GLM-4.5 / GLM-4.6 (`glm4_moe`): the Llama network (`llama.py`) with DeepSeek-V3's MoE.

Attention is Llama's with q/k/v biases (`attention_bias`, no o_proj bias), a partial rotary
(`partial_rotary_factor`, 0.5 by default: the first half of each head turns, halves rotated as
Llama's) and, with `use_qk_norm`, a per-head q/k RMSNorm as Qwen3's. The MLP is dense on the
first `first_k_dense_replace` layers, then DeepSeek-V3's MoE: sigmoid router scores with a
per-expert correction bias choosing groups and experts (`moe._route_sigmoid`), renormalised
top-k weights (`norm_topk_prob`) x `routed_scaling_factor`, plus un-gated shared experts. Its
checkpoints carry multi-token-prediction layers after the last one (skipped).
"""

from __future__ import annotations

from typing import Any

from jengine.models.config import ModelConfig
from jengine.models.family import Family, ModelType
from jengine.models.llama import NETWORK
from jengine.models.llama_variants import LLAMA_RULES
from jengine.models.weight_rules import LAYER, Rule, mtp_layers_skipped, same, transposed

_GLM_RULES: tuple[Rule, ...] = (
    (LAYER + r"mlp\.gate\.e_score_correction_bias", "router_bias", same),
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
)
