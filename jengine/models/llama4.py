"""Llama 4 text (`llama4_text`, and the text model of a `llama4` checkpoint): the Llama network
(`llama.py`) with Llama 4's switches.

- Rope on three layers of four (`no_rope_layers`, 1 = rope), turning adjacent pairs of each
  head's dims (HF's complex form). The q/k weights are loaded with each head's dims reordered
  evens-then-odds, so Llama's half-split rope turns the same pairs: q . k is unchanged by a
  permutation both share, and the weightless q/k norm by any permutation at all.
- After the rope, a weightless RMSNorm on q and k of the rope layers (`use_qk_norm`); on the
  NoPE layers q grows with the position (`attn_temperature_tuning`: floor_scale, attn_scale).
- The rope layers attend within chunks of `attention_chunk_size` tokens, the NoPE layers to the
  whole context (chunks only matter past one chunk: `core.build.chunk_for_context`).
- MoE on every layer (Scout's `interleave_moe_layer_step` 1): the top k experts of the router
  logits, each run on the token scaled by sigmoid(its logit) (`moe.route_llama4`), plus an
  un-gated shared expert as wide as one expert; experts stored fused (`gate_up_proj` [X, E, 2F],
  input-first).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jengine.models.family import Family, ModelType
from jengine.models.llama import NETWORK
from jengine.models.llama_variants import LLAMA_RULES
from jengine.models.weight_rules import LAYER, Rule, heads_in, same, transposed


def _evens_then_odds(w: np.ndarray) -> np.ndarray:
    """[..., D] with each head's dims reordered 0, 2, 4, ..., 1, 3, 5, ...: rope pairs (2i,
    2i + 1) become the half-split pairs (i, i + D/2)."""
    d = w.shape[-1]
    return w[..., np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])]


_heads_in_pairs = dataclasses.replace(
    heads_in, apply=lambda w, cfg: _evens_then_odds(heads_in.apply(w, cfg)))
_experts_fused = dataclasses.replace(same, split_axis=2)  # [X, E, 2F] -> 2 x [X, E, F]

_RULES: tuple[Rule, ...] = (
    (LAYER + r"self_attn\.q_proj\.weight", "wq", _heads_in_pairs),
    (LAYER + r"self_attn\.k_proj\.weight", "wk", _heads_in_pairs),
    (LAYER + r"feed_forward\.router\.weight", "router", transposed),
    (LAYER + r"feed_forward\.experts\.gate_up_proj", ("we_gate", "we_up"), _experts_fused),
    (LAYER + r"feed_forward\.experts\.down_proj", "we_down", same),
    (LAYER + r"feed_forward\.shared_expert\.gate_proj\.weight", "ws_gate", transposed),
    (LAYER + r"feed_forward\.shared_expert\.up_proj\.weight", "ws_up", transposed),
    (LAYER + r"feed_forward\.shared_expert\.down_proj\.weight", "ws_down", transposed),
) + LLAMA_RULES


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal `llama4` checkpoint's text model."""
    if "text_config" not in hf:
        return hf
    return {**hf["text_config"], "model_type": "llama4_text"}


def _fields(hf: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Llama 4's switches from its own keys.

    Raises:
      ValueError: dense layers among the MoE ones (Maverick's `interleave_moe_layer_step` 2),
        or q/k biases (which the dim reordering would have to follow).
    """
    num_layers = fields["num_layers"]
    moe_layers = hf.get("moe_layers")
    if moe_layers is None:
        step = int(hf.get("interleave_moe_layer_step", 1))
        moe_layers = list(range(step - 1, num_layers, step))
    if sorted(moe_layers) != list(range(num_layers)):
        raise ValueError("llama4_text with dense layers among the MoE ones "
                         "(interleave_moe_layer_step > 1) is not built")
    if hf.get("attention_bias"):
        raise ValueError("llama4_text with attention biases is not built")
    rope = tuple(bool(r) for r in hf.get("no_rope_layers") or [1] * num_layers)
    width = int(hf["intermediate_size"])
    return {
        "rope_layers": () if all(rope) else rope,
        "qk_l2_norm": bool(hf.get("use_qk_norm", True)),
        "attn_temperature": ((float(hf.get("floor_scale", 8192)), float(hf.get("attn_scale", 0.1)))
                             if hf.get("attn_temperature_tuning", True) else None),
        "attention_chunk_size": (int(hf["attention_chunk_size"])
                                 if hf.get("attention_chunk_size") else None),
        "num_experts": int(hf["num_local_experts"]),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok", 1)),
        "moe_intermediate_size": width,
        "shared_expert_intermediate_size": width,
        "shared_expert_gate": False,
        "router_scoring": "llama4",
    }


LLAMA4 = Family(
    name="llama4",
    network=NETWORK,
    model_types=(
        ModelType(name="llama4_text",
                  features="rope (adjacent pairs) on 3 layers of 4, chunked attention there, "
                           "weightless q/k norm, NoPE layers' q temperature; MoE of the top-k "
                           "logits scaling each expert's input, un-gated shared expert",
                  parity_test="test_llama4_text"),
        ModelType(name="llama4", features="the text model of a Llama 4 checkpoint (as "
                                          "`llama4_text`)"),
    ),
    hf_fields=_fields,
    unwrap_hf=_text_config,
    hf_weights=_RULES,
)
