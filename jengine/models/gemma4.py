"""Gemma 4 text (`gemma4_text`): Gemma 3's layer (four norms around attention and MLP, q/k
norms, GeGLU, scaled embeddings, interleaved sliding and global layers with their own rope)
with these differences, each HF's `Gemma4Text*` step for step:
- norms scale by `w` (Llama's convention), not Gemma 3's `1 + w`;
- values are RMS-normalised per head too, without a weight;
- the softmax scale is 1 (the q/k norms set the scores' size; no `query_pre_attn_scalar`);
- the global layers' rope is "proportional": the first `partial_rotary_factor` of the D/2
  frequency pairs turn, at theta ** (-2i / D) over the whole head width, the rest stay still
  (zero frequencies), so q/k keep rotate-half pairs (i, i + D/2) across the full head;
- each layer's output is multiplied by a learned scalar (`layer_scalar`);
- the MoE variant (`enable_moe_block`) runs, beside the dense MLP of every layer, a routed
  GeGLU expert MLP on the layer's residual: router RMS-normalised without weight, scaled by a
  learned vector and E ** -0.5, softmax in float32, top k renormalised, then each weight scaled
  by its expert's learned `per_expert_scale`; the two branches are normed apart and summed
  before the post-MLP norm.

Not built (refused at config time with a one-line ValueError): per-layer input embeddings
(`hidden_size_per_layer_input` > 0, the E2B / E4B models), KV shared across layers
(`num_kv_shared_layers`), keys reused as values (`attention_k_eq_v`), global layers whose head
width or KV head count differs from the sliding layers' (`global_head_dim`,
`num_global_key_value_heads`: the paged cache has one [K, D] per layer), bidirectional
attention, attention biases, and activations other than tanh-approximated GELU.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jengine.models import layers
from jengine.models.attention import AttentionMetadata, KVCache, attend
from jengine.models.config import ModelConfig
from jengine.models.family import Family, ModelType, Network
from jengine.models.layers import ParamSpec, project, rms_norm, rope_inv_freq
from jengine.models.matmul import dot
from jengine.models.weight_rules import (
    COMMON,
    LAYER,
    Rule,
    Transform,
    experts_fused_t,
    experts_t,
    same,
    transposed,
)


def param_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Every weight, stacked over layers; norms scale by `w` (initialised to ones)."""
    n, e, f, v = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, k, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    norm = ("layers", "embed")
    specs = {
        "embed": ParamSpec((v, e), ("vocab", "embed"),
                           contract=(1,) if cfg.tie_word_embeddings else ()),
        "attn_norm": ParamSpec((n, e), norm, "ones"),
        "wq": ParamSpec((n, e, h, d), ("layers", "embed", "q_heads", "head_dim"), contract=(1,)),
        "wk": ParamSpec((n, e, k, d), ("layers", "embed", "kv_heads", "head_dim"), contract=(1,)),
        "wv": ParamSpec((n, e, k, d), ("layers", "embed", "kv_heads", "head_dim"), contract=(1,)),
        "q_norm": ParamSpec((n, d), ("layers", "head_dim"), "ones"),
        "k_norm": ParamSpec((n, d), ("layers", "head_dim"), "ones"),
        "wo": ParamSpec((n, h, d, e), ("layers", "q_heads", "head_dim", "embed"),
                        contract=(1, 2)),
        "post_attn_norm": ParamSpec((n, e), norm, "ones"),
        "pre_mlp_norm": ParamSpec((n, e), norm, "ones"),
        "w_gate": ParamSpec((n, e, f), ("layers", "embed", "mlp"), contract=(1,)),
        "w_up": ParamSpec((n, e, f), ("layers", "embed", "mlp"), contract=(1,)),
        "w_down": ParamSpec((n, f, e), ("layers", "mlp", "embed"), contract=(1,)),
        "post_mlp_norm": ParamSpec((n, e), norm, "ones"),
        "layer_scalar": ParamSpec((n,), ("layers",), "ones"),
        "final_norm": ParamSpec((e,), ("embed",), "ones"),
    }
    if cfg.num_experts:
        x, fe = cfg.num_experts, cfg.moe_intermediate_size
        specs.update({
            "router": ParamSpec((n, e, x), ("layers", "embed", "experts")),
            "router_scale": ParamSpec((n, e), norm, "ones"),
            "per_expert_scale": ParamSpec((n, x), ("layers", "experts"), "ones"),
            "we_gate": ParamSpec((n, x, e, fe), ("layers", "experts", "embed", "mlp")),
            "we_up": ParamSpec((n, x, e, fe), ("layers", "experts", "embed", "mlp")),
            "we_down": ParamSpec((n, x, fe, e), ("layers", "experts", "mlp", "embed")),
            "pre_moe_norm": ParamSpec((n, e), norm, "ones"),
            "post_mlp_norm_1": ParamSpec((n, e), norm, "ones"),
            "post_moe_norm": ParamSpec((n, e), norm, "ones"),
        })
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((e, v), ("embed", "vocab"), contract=(0,))
    return specs


LAYER_KEYS = (
    "attn_norm", "wq", "wk", "wv", "q_norm", "k_norm", "wo", "post_attn_norm", "pre_mlp_norm",
    "w_gate", "w_up", "w_down", "post_mlp_norm", "layer_scalar",
    "router", "router_scale", "per_expert_scale", "we_gate", "we_up", "we_down",
    "pre_moe_norm", "post_mlp_norm_1", "post_moe_norm",
)


def _unit_norm(x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm without a weight (HF's `with_scale=False`: the values, the router's input)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(layers.row_sum(x32 * x32) / x.shape[-1] + eps)).astype(x.dtype)


def _gelu(x: jax.Array) -> jax.Array:
    """In f32 and rounded once, as torch computes a bf16 tensor's gelu."""
    return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)


def global_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """[D/2] the global layers' proportional rope: the first `partial_rotary_factor` of the
    frequencies as a full-width rope's, the others zero (those dims do not turn)."""
    inv = rope_inv_freq(cfg.rope, cfg.head_dim)
    turning = int(cfg.partial_rotary_factor * cfg.head_dim // 2)
    inv[turning:] = 0.0
    return inv


def route(h: jax.Array, p: dict[str, jax.Array], cfg: ModelConfig):
    """The residual [T, E] -> (chosen experts [T, k] int32, their weights [T, k] float32)."""
    x = _unit_norm(h, cfg.rms_norm_eps) * p["router_scale"] * jnp.asarray(
        cfg.hidden_size ** -0.5, h.dtype)
    logits = dot("te,ex->tx", x, p["router"]).astype(h.dtype)  # a Linear in the model dtype
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts, weights * p["per_expert_scale"][experts].astype(jnp.float32)


def experts_mlp(h: jax.Array, p: dict[str, jax.Array], experts: jax.Array, weights: jax.Array,
                num_experts: int) -> jax.Array:
    """[T, E] -> [T, E]: the chosen experts' GeGLU MLPs, weighted and summed; gathered per
    (token, expert) pair while that reads fewer experts than all (`jengine.models.moe`'s
    measured rule), else every expert densely with a combine matrix zero off the chosen."""
    num_tokens, k = experts.shape
    if num_tokens * k <= num_experts:
        gate = dot("te,tkef->tkf", h, p["we_gate"][experts]).astype(h.dtype)  # [T, k, F]
        up = dot("te,tkef->tkf", h, p["we_up"][experts]).astype(h.dtype)
        out = dot("tkf,tkfe->tke", _gelu(gate) * up, p["we_down"][experts])  # [T, k, E]
        return jnp.einsum("tke,tk->te", out, weights).astype(h.dtype)
    gate = dot("te,xef->txf", h, p["we_gate"]).astype(h.dtype)  # [T, X, F]
    up = dot("te,xef->txf", h, p["we_up"]).astype(h.dtype)
    combine = jnp.einsum("tk,tkx->tx", weights,
                         jax.nn.one_hot(experts, num_experts, dtype=jnp.float32))
    act = _gelu(gate) * up * combine[:, :, None].astype(h.dtype)
    return dot("txf,xfe->te", act, p["we_down"]).astype(h.dtype)


def forward(
    params: dict[str, jax.Array],
    cfg: ModelConfig,
    kv: KVCache,
    md: AttentionMetadata,
    *,
    all_logits: bool = False,
    head: bool = True,
) -> tuple[jax.Array, KVCache]:
    """One ragged step; same contract as `llama.forward`."""
    eps, mm = cfg.rms_norm_eps, cfg.matmul_backend
    x = layers.embed_tokens(params["embed"], md.token_ids, params["final_norm"].dtype)
    x = x * jnp.asarray(np.sqrt(cfg.hidden_size), x.dtype)  # [T, E]
    local_freq = rope_inv_freq(cfg.local_rope or cfg.rope, cfg.head_dim)
    sliding = np.asarray(cfg.sliding_layers, bool)
    window = cfg.sliding_window or 0
    big = np.iinfo(np.int32).max
    freq_rows, table_of_layer = layers.rope_rows(
        np.where(sliding[:, None], local_freq, global_inv_freq(cfg)))
    cos_tables, sin_tables = layers.rope_tables(md.positions, jnp.asarray(freq_rows),
                                                barrier=cfg.branches)
    per_layer = (
        jnp.asarray(np.where(sliding, window, big), jnp.int32),  # [L] window per layer
        jnp.asarray(table_of_layer),  # [L] the layer's row of the tables
    )

    def norm(v, w):
        return rms_norm(v, w, eps, backend=mm)

    def layer(carry, xs):
        x, kv = carry
        p, index, (layer_window, table) = xs
        h = norm(x, p["attn_norm"])
        q = norm(project(h, p["wq"], "te,ehd->thd", backend=mm), p["q_norm"])
        k = norm(project(h, p["wk"], "te,ehd->thd", backend=mm), p["k_norm"])
        v = _unit_norm(project(h, p["wv"], "te,ehd->thd", backend=mm), eps)
        q = layers.rotate(q, cos_tables[table], sin_tables[table])
        k = layers.rotate(k, cos_tables[table], sin_tables[table])
        attn, kv = attend(
            q, k, v, kv, index, md, sm_scale=1.0,
            sliding_window=layer_window if window else None, soft_cap=None,
            kv_head_map=cfg.kv_head_map, backend=cfg.attention_backend, platform=cfg.platform,
        )
        x = x + norm(layers.project_heads(attn, p["wo"], backend=mm), p["post_attn_norm"])
        h = norm(x, p["pre_mlp_norm"])
        gate = project(h, p["w_gate"], "te,ef->tf", backend=mm)
        up = project(h, p["w_up"], "te,ef->tf", backend=mm)
        mlp = project(_gelu(gate) * up, p["w_down"], "tf,fe->te", backend=mm)
        if "router" in p:
            experts, weights = route(x, p, cfg)
            routed = experts_mlp(norm(x, p["pre_moe_norm"]), p, experts, weights,
                                 cfg.num_experts)
            mlp = norm(mlp, p["post_mlp_norm_1"]) + norm(routed, p["post_moe_norm"])
        x = (x + norm(mlp, p["post_mlp_norm"])) * p["layer_scalar"].astype(x.dtype)
        return (x, kv), None

    x, kv = layers.run_layers(layer, (x, kv), params, LAYER_KEYS, per_layer, cfg.num_layers)
    if not all_logits:
        x = x[md.logits_indices]
    return (logits(params, cfg, x) if head else x), kv


def logits(params: dict[str, jax.Array], cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Hidden states [N, E] (`forward` without `head`) -> float32 logits [N, V]."""
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, backend=cfg.matmul_backend)
    out = layers.lm_head(x, params, cfg.tie_word_embeddings, cfg.matmul_backend)
    if cfg.final_logit_softcapping:
        cap = cfg.final_logit_softcapping
        out = cap * jnp.tanh(out / cap)
    return out


NETWORK = Network(name="gemma4", param_specs=param_specs, forward=forward, logits=logits,
                  layer_keys=LAYER_KEYS)

_scalar = Transform(  # HF's per-layer `layer_scalar` [1] -> one value per layer
    apply=lambda w, cfg: np.asarray(w).reshape(()),
    source_index=lambda idx, d: ((slice(None),), ()),
    source_shape=lambda shape, d: (1,),
)
_RULES: tuple[Rule, ...] = (
    (r"lm_head\.weight", "lm_head", transposed),
    (LAYER + r"self_attn\.q_norm\.weight", "q_norm", same),
    (LAYER + r"self_attn\.k_norm\.weight", "k_norm", same),
    (LAYER + r"post_attention_layernorm\.weight", "post_attn_norm", same),
    (LAYER + r"pre_feedforward_layernorm\.weight", "pre_mlp_norm", same),
    (LAYER + r"post_feedforward_layernorm\.weight", "post_mlp_norm", same),
    (LAYER + r"layer_scalar", "layer_scalar", _scalar),
    (LAYER + r"router\.proj\.weight", "router", transposed),
    (LAYER + r"router\.scale", "router_scale", same),
    (LAYER + r"router\.per_expert_scale", "per_expert_scale", same),
    (LAYER + r"experts\.gate_up_proj", ("we_gate", "we_up"), experts_fused_t),
    (LAYER + r"experts\.down_proj", "we_down", experts_t),
    (LAYER + r"pre_feedforward_layernorm_2\.weight", "pre_moe_norm", same),
    (LAYER + r"post_feedforward_layernorm_1\.weight", "post_mlp_norm_1", same),
    (LAYER + r"post_feedforward_layernorm_2\.weight", "post_moe_norm", same),
) + COMMON


def _refuse_unbuilt(hf: dict[str, Any]) -> None:
    """One line for each Gemma 4 feature this network does not run (module docstring)."""
    num_layers = int(hf["num_hidden_layers"])
    layer_types = hf.get("layer_types") or ["full_attention" if full else "sliding_attention"
                                            for full in _global_layers(num_layers)]
    head_dim = hf.get("head_dim", 256)
    kv_heads = hf.get("num_key_value_heads", 4)
    # HF makes the last layer global, so there always is one.
    full = next((str(i) for i, t in enumerate(layer_types[:-1]) if t == "full_attention"),
                str(num_layers - 1))
    if "per_layer_config" in hf:  # HF's own reading: present (even empty), it decides alone
        per_layer = hf["per_layer_config"] or {}
        overrides = per_layer.get(full) or per_layer.get(int(full)) or {}
    else:
        overrides = {"head_dim": hf.get("global_head_dim", 512)}
        if hf.get("attention_k_eq_v") and hf.get("num_global_key_value_heads") is not None:
            overrides["num_key_value_heads"] = hf["num_global_key_value_heads"]
    unbuilt = {
        "per-layer input embeddings (hidden_size_per_layer_input)":
            hf.get("hidden_size_per_layer_input", 256),
        "KV shared across layers (num_kv_shared_layers)": hf.get("num_kv_shared_layers", 0),
        "keys reused as values (attention_k_eq_v)": hf.get("attention_k_eq_v", False),
        "bidirectional attention (use_bidirectional_attention)":
            hf.get("use_bidirectional_attention"),
        "attention biases (attention_bias)": hf.get("attention_bias", False),
        "global layers with their own head width (global_head_dim)":
            overrides.get("head_dim", head_dim) != head_dim,
        "global layers with their own KV heads (num_global_key_value_heads)":
            overrides.get("num_key_value_heads", kv_heads) != kv_heads,
        "an activation other than gelu_pytorch_tanh":
            hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh",
    }
    for what, present in unbuilt.items():
        if present:
            raise ValueError(f"gemma4_text: {what} is not built")


def _unwrap(hf: dict[str, Any]) -> dict[str, Any]:
    """Refuses what is not built; rewrites the global layers' proportional rope as the plain
    (or linearly scaled) rope it starts from, keeping its turning fraction apart, and makes the
    last layer global as HF's config does."""
    _refuse_unbuilt(hf)
    hf = {"sliding_window": 512, "max_position_embeddings": 131_072, "head_dim": 256,
          "num_key_value_heads": 4, **hf}  # HF's Gemma4TextConfig defaults
    if hf.get("layer_types"):
        hf["layer_types"] = [*hf["layer_types"][:-1], "full_attention"]
    ropes = dict(hf.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1_000_000.0}})
    full = dict(ropes["full_attention"])
    if full.get("rope_type") == "proportional":
        hf["_proportional_rotary_factor"] = float(full.pop("partial_rotary_factor", 1.0))
        full["rope_type"] = "linear" if float(full.get("factor", 1.0)) != 1.0 else "default"
    ropes["full_attention"] = full
    hf["rope_parameters"] = ropes
    return hf


def _hf_fields(hf: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """The turning fraction of the global rope and the MoE block's widths."""
    out: dict[str, Any] = {
        "partial_rotary_factor": hf.get("_proportional_rotary_factor", 1.0)}
    if hf.get("enable_moe_block"):
        out.update(num_experts=int(hf["num_experts"]),
                   num_experts_per_tok=int(hf["top_k_experts"]),
                   moe_intermediate_size=int(hf["moe_intermediate_size"]), norm_topk_prob=True)
    return out


def _global_layers(num_layers: int) -> list[bool]:
    """HF's default `layer_types`: five sliding layers per global one, the last one global."""
    return [(i + 1) % 6 == 0 or i == num_layers - 1 for i in range(num_layers)]


def _sliding_but_last(hf: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    return tuple(not full for full in _global_layers(num_layers))


GEMMA4 = Family(
    name="gemma4",
    model_types=(ModelType(
        name="gemma4_text", features="unit-weight value norms, proportional global rope, "
        "layer scalars, MoE block beside the dense MLP; no per-layer embeddings or shared KV",
        parity_test="test_gemma4_text_moe"),),
    network=NETWORK, unwrap_hf=_unwrap, hf_fields=_hf_fields, hf_weights=_RULES,
    default_sliding=_sliding_but_last, tied_by_default=True)
