"""Qwen3-Next (`qwen3_next`): Qwen3.5's hybrid network (`qwen3_5.py`: Gated DeltaNet linear
layers, gated full-attention layers, per-sequence recurrent state) with Qwen2-MoE's sparse MLP
(`moe.py`: softmax top-k routing, renormalised with `norm_topk_prob`, plus a shared expert
scaled by sigmoid(h . gate)) in place of the dense one.

What differs from Qwen3.5 besides the MLP is only the checkpoint layout of a linear layer's
input projections: two fused tensors, `in_proj_qkvz` and `in_proj_ba`, whose rows are grouped
per key head ([q (Dk), k (Dk), v (Hv/Hk x Dv), z (Hv/Hk x Dv)] for each of the Hk key heads;
[b (Hv/Hk), a (Hv/Hk)] likewise). The converter regroups them by kind (all q, all k, all v,
all z; all b, all a) into `lin_qkvz` [E, C + Hv * Dv] and `lin_ba` [E, 2 Hv], so one matmul
each yields Qwen3.5's conv channels, z, b and a (`qwen3_5._delta_net_inputs`).

HF places the MoE on layer i when i is not in `mlp_only_layers` and (i + 1) is a multiple of
`decoder_sparse_step`, and Qwen3.5's dense MLP (`intermediate_size` wide) on the others
(`ModelConfig.dense_mlp_layers`); the published checkpoints make every layer sparse. Each kind's
weights stack over its own layers (`qwen3_5.layer_ordinals`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jengine.models import moe, qwen3_5
from jengine.models.config import ModelConfig
from jengine.models.family import Family, ModelType, Network
from jengine.models.layers import ParamSpec
from jengine.models.llama_variants import QWEN_MOE_RULES
from jengine.models.weight_rules import LAYER, Rule, Transform

_DENSE_MLP = ("w_gate", "w_up", "w_down")
_DENSE_INPUTS = (*_DENSE_MLP, "lin_qkv", "lin_z", "lin_b", "lin_a")


def param_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Qwen3.5's weights with the two fused input projections, and the MoE's on the sparse
    layers (the dense MLP's stack only the others, `qwen3_5.layer_ordinals`)."""
    specs = {k: v for k, v in qwen3_5.param_specs(cfg).items() if k not in _DENSE_INPUTS}
    nl, e, hv = cfg.num_linear_layers, cfg.hidden_size, cfg.linear_v_heads
    width = cfg.linear_conv_dim + hv * cfg.linear_v_dim
    specs["lin_qkvz"] = ParamSpec((nl, e, width), ("layers", "embed", "linear_conv"))
    specs["lin_ba"] = ParamSpec((nl, e, 2 * hv), ("layers", "embed", "linear_heads"))
    num_dense = sum(cfg.dense_mlp_layers) if cfg.num_experts else cfg.num_layers
    if num_dense:
        mlp = qwen3_5.param_specs(cfg)
        specs.update({k: dataclasses.replace(mlp[k], shape=(num_dense, *mlp[k].shape[1:]))
                      for k in _DENSE_MLP})
    if cfg.num_experts:
        specs.update({k: dataclasses.replace(v, shape=(cfg.num_layers - num_dense,
                                                       *v.shape[1:]))
                      for k, v in moe.param_specs(cfg, gated_shared=True).items()})
    return specs


NETWORK = Network(name="qwen3_next", param_specs=param_specs, forward=qwen3_5.forward,
                  logits=qwen3_5.logits, layer_keys=qwen3_5.NETWORK.layer_keys,
                  layer_ordinals=qwen3_5.layer_ordinals, final_norm=qwen3_5.final_norm)


def _grouped_by_kind(widths: tuple[str, ...]) -> Transform:
    """A projection [Hk * W, E] whose rows are grouped per key head (each head's parts, W rows
    in all) -> [E, Hk * W] with the rows grouped by kind: every head's first part, then every
    head's second, ... `widths` names the parts (`_part_widths` keys). The whole tensor is read (the
    linear layers are replicated under tp)."""

    def apply(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
        sizes = [_part_widths(cfg)[name] for name in widths]
        grouped = w.reshape(cfg.linear_k_heads, sum(sizes), w.shape[-1])  # [Hk, parts, E]
        cuts = np.cumsum([0, *sizes])
        parts = [grouped[:, a:b].reshape(-1, w.shape[-1]) for a, b in zip(cuts[:-1], cuts[1:])]
        return np.concatenate(parts, axis=0).T

    return Transform(apply=apply, source_index=lambda idx, d: ((slice(None),) * 2, idx),
                     source_shape=lambda shape, d: (shape[1], shape[0]))


def _part_widths(cfg: ModelConfig) -> dict[str, int]:
    """Each part's width within one key head's group of rows."""
    per_k = cfg.linear_v_heads // cfg.linear_k_heads  # value heads per key head
    return {"q": cfg.linear_k_dim, "k": cfg.linear_k_dim, "v": per_k * cfg.linear_v_dim,
            "z": per_k * cfg.linear_v_dim, "b": per_k, "a": per_k}


_QKVZ = _grouped_by_kind(("q", "k", "v", "z"))
_BA = _grouped_by_kind(("b", "a"))


def _weight_rules(cfg: ModelConfig) -> tuple[Rule, ...]:
    lin = LAYER + r"linear_attn\."
    return ((lin + r"in_proj_qkvz\.weight", "lin_qkvz", _QKVZ),
            (lin + r"in_proj_ba\.weight", "lin_ba", _BA),
            *QWEN_MOE_RULES, *qwen3_5._weight_rules(cfg))


def _fields(hf: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's layer kinds and widths (`layer_types`, or `full_attention_interval` as the
    published configs spell it), Qwen2-MoE's experts, and which layers HF gives a dense MLP
    instead: those in `mlp_only_layers` or whose (index + 1) is no multiple of
    `decoder_sparse_step` (every layer when there are no experts)."""
    n = fields["num_layers"]
    step = int(hf.get("decoder_sparse_step") or 1)
    only = set(hf.get("mlp_only_layers") or ())
    dense = tuple(i in only or (i + 1) % step != 0 for i in range(n))
    out = {**qwen3_5._fields(hf, fields),
           "dense_mlp_layers": dense if any(dense) and not all(dense) else ()}
    if not hf.get("num_experts") or all(dense):
        return out  # Qwen3.5's dense MLP on every layer
    return {
        **out,
        "num_experts": int(hf["num_experts"]),
        "num_experts_per_tok": int(hf["num_experts_per_tok"]),
        "moe_intermediate_size": int(hf["moe_intermediate_size"]),
        "shared_expert_intermediate_size": int(hf.get("shared_expert_intermediate_size") or 0),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),  # Qwen3NextConfig's default
    }


QWEN3_NEXT = Family(
    name="qwen3_next",
    network=NETWORK,
    model_types=(ModelType(
        name="qwen3_next",
        features="Qwen3.5's hybrid (Gated DeltaNet + gated full attention, recurrent state "
                 "per sequence) with a sparse MoE (softmax top-k, shared expert with a sigmoid "
                 "gate) as its MLP",
        parity_test="test_qwen3_next_logits_match_hf"),),
    hf_fields=_fields,
    hf_weights_for=_weight_rules,
)
