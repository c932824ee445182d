"""Granite 4 (`granitemoehybrid`): Mamba2 layers mixed with attention layers, each followed by
an MLP: a sparse MoE (softmax over the top-k logits) plus a shared SwiGLU expert every token
runs, or the shared MLP alone where the model has no experts (the dense variants), with
Granite's multipliers (embeddings x `embedding_multiplier`, each residual branch x
`residual_multiplier`, softmax scale `attention_multiplier`, logits / `logits_scaling`).

The Mamba2 mixer and its per-sequence state are `models/mamba2.py`'s. The attention layers are
Llama's, without rope where `position_embedding_type` is not "rope" (the published Granite 4.0
checkpoints: "nope"). Attention weights stack over the attention layers, Mamba2 weights over
the Mamba2 layers (`layer_ordinals`), norms and MLPs over all.

Config spellings read: transformers 5's `layer_types` ("linear_attention" / "full_attention"),
the published checkpoints' `layer_types` ("mamba" / "attention") and the older
`layers_block_type` key.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jengine.models import layers, mamba2, moe
from jengine.models.attention import AttentionMetadata, KVCache, attend
from jengine.models.config import ModelConfig
from jengine.models.family import Family, ModelType, Network
from jengine.models.layers import ParamSpec, project, rms_norm, rope_inv_freq
from jengine.models.llama import _mlp
from jengine.models.weight_rules import (
    Rule,
    experts_fused_t,
    experts_t,
    heads_in,
    o_in,
    same,
    transposed,
)

LAYER = r"(?:model|backbone)\.layers\.(\d+)\."
ATTENTION_KEYS = ("wq", "wk", "wv", "wo")
MLP_KEYS = ("w_gate", "w_up", "w_down", "router", "we_gate", "we_up", "we_down", "ws_gate",
            "ws_up", "ws_down")
EVERY_LAYER_KEYS = ("attn_norm", "mlp_norm") + MLP_KEYS
_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}


def param_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Every weight, stacked over the layers of its kind. Projections are input-first."""
    n, e, v = cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    h, k, d, na = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_kv_layers
    specs = {
        "embed": ParamSpec((v, e), ("vocab", "embed"),
                           contract=(1,) if cfg.tie_word_embeddings else ()),
        "attn_norm": ParamSpec((n, e), ("layers", "embed"), "ones"),
        "mlp_norm": ParamSpec((n, e), ("layers", "embed"), "ones"),
        "final_norm": ParamSpec((e,), ("embed",), "ones"),
        "wq": ParamSpec((na, e, h, d), ("layers", "embed", "q_heads", "head_dim"), contract=(1,)),
        "wk": ParamSpec((na, e, k, d), ("layers", "embed", "kv_heads", "head_dim"), contract=(1,)),
        "wv": ParamSpec((na, e, k, d), ("layers", "embed", "kv_heads", "head_dim"), contract=(1,)),
        "wo": ParamSpec((na, h, d, e), ("layers", "q_heads", "head_dim", "embed"),
                        contract=(1, 2)),
        **mamba2.mixer_specs(cfg),
    }
    if cfg.num_experts:
        specs.update(moe.param_specs(cfg, gated_shared=False))
    else:
        f = cfg.intermediate_size
        specs.update({
            "w_gate": ParamSpec((n, e, f), ("layers", "embed", "mlp"), contract=(1,)),
            "w_up": ParamSpec((n, e, f), ("layers", "embed", "mlp"), contract=(1,)),
            "w_down": ParamSpec((n, f, e), ("layers", "mlp", "embed"), contract=(1,)),
        })
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((e, v), ("embed", "vocab"), contract=(0,))
    return specs


def layer_ordinals(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Attention keys stack the attention layers, Mamba2 keys the Mamba2 layers."""
    linear = tuple(i for i, lin in enumerate(cfg.linear_layers) if lin)
    full = tuple(i for i, lin in enumerate(cfg.linear_layers) if not lin)
    return {**dict.fromkeys(ATTENTION_KEYS, full), **dict.fromkeys(mamba2.MIXER_KEYS, linear)}


def forward(params: dict[str, jax.Array], cfg: ModelConfig, kv: KVCache,
            md: AttentionMetadata, *, all_logits: bool = False, head: bool = True
            ) -> tuple[jax.Array, KVCache]:
    """One ragged step. Returns float32 logits [S, V] at `md.logits_indices` ([T, V] with
    `all_logits`; hidden states without `head`) and the updated cache (pages of the attention
    layers, states of the Mamba2 layers)."""
    mm, eps = cfg.matmul_backend, cfg.rms_norm_eps
    x = layers.embed_tokens(params["embed"], md.token_ids, params["final_norm"].dtype)  # [T, E]
    x = x * jnp.asarray(cfg.embedding_multiplier, x.dtype)
    rope = None
    if not cfg.rope_layers:  # rope on every attention layer, else none (Granite 4.0's nope)
        inv_freq = jnp.asarray(rope_inv_freq(cfg.rope, cfg.head_dim)[None])  # [1, D/2]
        cos, sin = layers.rope_tables(md.positions, inv_freq)
        rope = (cos[0], sin[0])
    states = mamba2.States(kv, md)
    scale = jnp.asarray(cfg.residual_multiplier, x.dtype)
    ordinal = {True: 0, False: 0}
    for i, linear in enumerate(cfg.linear_layers):
        j = ordinal[linear]  # the layer's place among those of its kind
        ordinal[linear] += 1
        p = params["layers"][i] if "layers" in params else _layer_slices(params, i, j, linear)
        h = rms_norm(x, p["attn_norm"], eps, backend=mm)
        if linear:
            out = mamba2.mixer(h, p, cfg, states, j, md, eps)
        else:
            out, kv = attention(h, p, cfg, kv, j, md, rope)
        x = x + out * scale
        h = rms_norm(x, p["mlp_norm"], eps, backend=mm)
        x = x + (moe.moe_mlp(h, p, cfg) if cfg.num_experts else _mlp(h, p, mm)) * scale
    kv = states.written(kv)
    if not all_logits:
        x = x[md.logits_indices]
    return (logits(params, cfg, x) if head else x), kv


def _layer_slices(params: dict, layer: int, ordinal: int, linear: bool) -> dict:
    """Layer `layer`'s weights cut from the stacks: its mixer's at `ordinal`."""
    mixer = mamba2.MIXER_KEYS if linear else ATTENTION_KEYS
    return {**{key: params[key][layer] for key in EVERY_LAYER_KEYS if key in params},
            **{key: params[key][ordinal] for key in mixer if key in params}}


def attention(h, p, cfg: ModelConfig, kv: KVCache, index: int, md: AttentionMetadata,
               rope) -> tuple[jax.Array, KVCache]:
    """Llama's attention without biases or norms, rope where given ((cos, sin) [T, D/2]):
    [T, E] -> [T, E]; writes attention layer `index`'s pages. Nemotron-H's too."""
    mm = cfg.matmul_backend
    q = project(h, p["wq"], "te,ehd->thd", backend=mm)
    k = project(h, p["wk"], "te,ehd->thd", backend=mm)
    v = project(h, p["wv"], "te,ehd->thd", backend=mm)
    if rope is not None:
        q, k = layers.rotate(q, *rope), layers.rotate(k, *rope)
    attn, kv = attend(q, k, v, kv, jnp.int32(index), md, sm_scale=cfg.sm_scale,
                      sliding_window=None, soft_cap=None, kv_head_map=cfg.kv_head_map,
                      backend=cfg.attention_backend)
    return layers.project_heads(attn, p["wo"], backend=mm), kv


def logits(params: dict[str, jax.Array], cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Hidden states [N, E] -> float32 logits [N, V], divided by `logits_scaling`."""
    out = layers.lm_head(final_norm(params, cfg, x), params, cfg.tie_word_embeddings,
                         cfg.matmul_backend)
    return out / cfg.logits_scaling


def final_norm(params: dict[str, jax.Array], cfg: ModelConfig, x: jax.Array) -> jax.Array:
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps, backend=cfg.matmul_backend)


NETWORK = Network(name="granite4", param_specs=param_specs, forward=forward, logits=logits,
                  layer_keys=EVERY_LAYER_KEYS + ATTENTION_KEYS + mamba2.MIXER_KEYS,
                  layer_ordinals=layer_ordinals, final_norm=final_norm)


def _weight_rules(cfg: ModelConfig) -> tuple[Rule, ...]:
    moe_ = LAYER + r"block_sparse_moe\."
    shared = ("ws_gate", "ws_up", "ws_down") if cfg.num_experts else ("w_gate", "w_up", "w_down")
    return (
        (r"(?:model|backbone)\.embed_tokens\.weight", "embed", same),
        (r"(?:model|backbone)\.norm\.weight", "final_norm", same),
        (r"lm_head\.weight", "lm_head", transposed),
        (LAYER + r"input_layernorm\.weight", "attn_norm", same),
        (LAYER + r"post_attention_layernorm\.weight", "mlp_norm", same),
        (LAYER + r"self_attn\.q_proj\.weight", "wq", heads_in),
        (LAYER + r"self_attn\.k_proj\.weight", "wk", heads_in),
        (LAYER + r"self_attn\.v_proj\.weight", "wv", heads_in),
        (LAYER + r"self_attn\.o_proj\.weight", "wo", o_in),
        (LAYER + r"shared_mlp\.input_linear\.weight", shared[:2], transposed),
        (LAYER + r"shared_mlp\.output_linear\.weight", shared[2], transposed),
        (moe_ + r"router\.layer\.weight", "router", transposed),
        (moe_ + r"input_linear\.weight", ("we_gate", "we_up"), experts_fused_t),
        (moe_ + r"output_linear\.weight", "we_down", experts_t),
    ) + mamba2.mixer_rules(LAYER + r"mamba\.")


def _fields(hf: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """The layer kinds, the Mamba2 widths, the MLP and Granite's multipliers.

    Raises:
      ValueError: a layer type other than Mamba2 or attention, or a layer count that
        disagrees with them.
    """
    n = fields["num_layers"]
    types = hf.get("layer_types") or hf.get("layers_block_type") or ["linear_attention"] * n
    types = [_TYPES.get(t, t) for t in types]
    unknown = set(types) - {"linear_attention", "full_attention"}
    if unknown or len(types) != n:
        raise ValueError(f"granitemoehybrid layer types {sorted(unknown) or len(types)} not "
                         "supported (mamba / attention, one per layer)")
    hidden = int(hf["hidden_size"])
    heads = int(hf.get("mamba_n_heads", 128))
    inner = int(hf.get("mamba_expand", 2)) * hidden
    head_dim = hf.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
    experts = int(hf.get("num_local_experts") or 0)
    shared = int(hf.get("shared_intermediate_size", 1024))
    out = {
        "linear_layers": tuple(t == "linear_attention" for t in types),
        **mamba2.mamba2_fields(
            heads, head_dim, int(hf.get("mamba_n_groups", 1)), int(hf.get("mamba_d_state", 256)),
            int(hf.get("mamba_d_conv", 4)), conv_bias=hf.get("mamba_conv_bias", True),
            proj_bias=hf.get("mamba_proj_bias", False),
            dt_limit=hf.get("time_step_limit")),
        "embedding_multiplier": float(hf.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(hf.get("residual_multiplier", 1.0)),
        "attention_multiplier": float(hf.get("attention_multiplier", 1.0)),
        "logits_scaling": float(hf.get("logits_scaling", 1.0)),
        "rope_layers": () if hf.get("position_embedding_type") == "rope" else (False,) * n,
        "intermediate_size": shared,
    }
    if experts:
        out.update(num_experts=experts, num_experts_per_tok=int(hf["num_experts_per_tok"]),
                   moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True,
                   shared_expert_intermediate_size=shared, shared_expert_gate=False)
    return out


GRANITE4 = Family(
    name="granite4",
    network=NETWORK,
    model_types=(
        ModelType(name="granitemoehybrid", features="hybrid: Mamba2 layers (recurrent state "
                  "per sequence) with attention layers (rope or none); MoE + shared expert or "
                  "dense; Granite's multipliers",
                  parity_test="test_granite4_logits_match_hf"),
    ),
    hf_fields=_fields,
    hf_weights_for=_weight_rules,
)
