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

Global layers of their own shape (26B-A4B, 31B: heads twice as wide, fewer KV heads, values
that are the raw keys, `attention_k_eq_v`) stack their own attention weights (`two_kinds`,
`layer_ordinals`); the paged cache, one [K, D] for every layer, takes the wider heads and the
more KV heads: narrower heads are zero-padded into it and fewer KV heads repeated
(`_cache_shaped`), exact at a memory cost (31B's sliding layers fill half of each row, its
global layers a quarter).

Not built (refused at config time with a one-line ValueError): per-layer input embeddings
(`hidden_size_per_layer_input` > 0) and KV shared across layers (`num_kv_shared_layers`), which
the E2B / E4B models use; global heads narrower, or global KV heads more than (or not dividing)
the sliding layers'; bidirectional attention, attention biases, and activations other than
tanh-approximated GELU. A multimodal `gemma4` checkpoint serves its text model (the vision and
audio towers are skipped).
"""

from __future__ import annotations

import dataclasses
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
    heads_in,
    o_in,
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
    if two_kinds(cfg):
        specs.update(_kind_specs(cfg))
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


ATTENTION_KEYS = ("wq", "wk", "wv", "q_norm", "k_norm", "wo")
GLOBAL_KEYS = tuple(f"{name}_g" for name in ATTENTION_KEYS)


def two_kinds(cfg: ModelConfig) -> bool:
    """Whether the global layers' attention weights differ in shape from the sliding layers'
    (wider heads, fewer KV heads, or no v_proj): then each kind stacks its own."""
    return bool(cfg.sliding_head_dim or cfg.global_kv_heads or cfg.global_values_are_keys)


def _kind_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """The attention weights of each kind of layer, stacked over that kind's layers: the
    sliding layers' at their own head width, the global ones' (`*_g`) at `head_dim`."""
    e, h = cfg.hidden_size, cfg.num_heads
    out = {}
    # Fewer global KV heads are replicated under tp (an axis the rules do not know), as KV
    # heads that do not divide tp are: each device repeats them into its cache heads.
    global_kv_axis = "global_kv_heads" if cfg.global_kv_heads else "kv_heads"
    for suffix, n, k, d, kv_axis in (
        ("", sum(cfg.sliding_layers), cfg.num_kv_heads, cfg.sliding_head_dim or cfg.head_dim,
         "kv_heads"),
        ("_g", cfg.num_layers - sum(cfg.sliding_layers), cfg.global_kv_heads or cfg.num_kv_heads,
         cfg.head_dim, global_kv_axis),
    ):
        out.update({
            f"wq{suffix}": ParamSpec((n, e, h, d), ("layers", "embed", "q_heads", "head_dim"),
                                     contract=(1,)),
            f"wk{suffix}": ParamSpec((n, e, k, d), ("layers", "embed", kv_axis, "head_dim"),
                                     contract=(1,)),
            f"wv{suffix}": ParamSpec((n, e, k, d), ("layers", "embed", kv_axis, "head_dim"),
                                     contract=(1,)),
            f"q_norm{suffix}": ParamSpec((n, d), ("layers", "head_dim"), "ones"),
            f"k_norm{suffix}": ParamSpec((n, d), ("layers", "head_dim"), "ones"),
            f"wo{suffix}": ParamSpec((n, h, d, e), ("layers", "q_heads", "head_dim", "embed"),
                                     contract=(1, 2)),
        })
    if cfg.global_values_are_keys:
        del out["wv_g"]
    return out


def layer_ordinals(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Under `two_kinds`, the layers each kind's attention weights stack."""
    if not two_kinds(cfg):
        return {}
    sliding = tuple(i for i, s in enumerate(cfg.sliding_layers) if s)
    full = tuple(i for i, s in enumerate(cfg.sliding_layers) if not s)
    return {**dict.fromkeys(ATTENTION_KEYS, sliding), **dict.fromkeys(GLOBAL_KEYS, full)}


LAYER_KEYS = ATTENTION_KEYS + GLOBAL_KEYS + (
    "attn_norm", "post_attn_norm", "pre_mlp_norm",
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
    """One ragged step; same contract as `llama.forward`. Layers of one shape run as
    `layers.run_layers` runs them; under `two_kinds` a Python loop picks each layer's weights
    (per-layer dicts, or slices of each kind's stacks) and its kind's rope table."""
    x = layers.embed_tokens(params["embed"], md.token_ids, params["final_norm"].dtype)
    x = x * jnp.asarray(np.sqrt(cfg.hidden_size), x.dtype)  # [T, E]
    sliding = np.asarray(cfg.sliding_layers, bool)
    window = cfg.sliding_window or 0
    big = np.iinfo(np.int32).max
    local_freq = rope_inv_freq(cfg.local_rope or cfg.rope, cfg.sliding_head_dim or cfg.head_dim)
    if two_kinds(cfg):
        tables = {kind: layers.rope_tables(md.positions, jnp.asarray(freq)[None],
                                           barrier=cfg.branches)
                  for kind, freq in ((True, local_freq), (False, global_inv_freq(cfg)))}
        for i in range(cfg.num_layers):
            p = params["layers"][i] if "layers" in params else _layer_slice(params, cfg, i)
            cos, sin = tables[bool(sliding[i])]
            x, kv = _layer(x, kv, p, jnp.int32(i), jnp.int32(window if sliding[i] else big),
                           cos[0], sin[0], cfg, md)
    else:
        freq_rows, table_of_layer = layers.rope_rows(
            np.where(sliding[:, None], local_freq, global_inv_freq(cfg)))
        cos_tables, sin_tables = layers.rope_tables(md.positions, jnp.asarray(freq_rows),
                                                    barrier=cfg.branches)
        per_layer = (
            jnp.asarray(np.where(sliding, window, big), jnp.int32),  # [L] window per layer
            jnp.asarray(table_of_layer),  # [L] the layer's row of the tables
        )

        def layer(carry, xs):
            p, index, (layer_window, table) = xs
            return _layer(*carry, p, index, layer_window, cos_tables[table], sin_tables[table],
                          cfg, md), None

        x, kv = layers.run_layers(layer, (x, kv), params, LAYER_KEYS, per_layer,
                                  cfg.num_layers)
    if not all_logits:
        x = x[md.logits_indices]
    return (logits(params, cfg, x) if head else x), kv


def _layer_slice(params: dict[str, jax.Array], cfg: ModelConfig, i: int) -> dict:
    """Layer `i`'s weights cut from the stacks (the stacked layout under `two_kinds`)."""
    held = layer_ordinals(cfg)
    out = {}
    for key in LAYER_KEYS:
        if key not in params:
            continue
        if key not in held:
            out[key] = params[key][i]
        elif i in held[key]:
            out[key] = params[key][held[key].index(i)]
    return out


def _cache_shaped(x: jax.Array, cfg: ModelConfig, heads: int) -> jax.Array:
    """[T, h, d] -> [T, heads, head_dim]: narrower heads zero-padded (zeros add nothing to
    q . k, and give output columns that are cut off), fewer KV heads each repeated (KV head j
    of h serves the same q heads as the repeated copies j * r .. j * r + r - 1 of `heads`)."""
    if x.shape[1] != heads:
        x = jnp.repeat(x, heads // x.shape[1], axis=1)
    if x.shape[2] != cfg.head_dim:
        x = jnp.pad(x, ((0, 0), (0, 0), (0, cfg.head_dim - x.shape[2])))
    return x


def _layer(x, kv, p, index, layer_window, cos, sin, cfg: ModelConfig, md: AttentionMetadata):
    """One decoder layer: [T, E] -> [T, E], the cache updated at `index`."""
    eps, mm = cfg.rms_norm_eps, cfg.matmul_backend

    def norm(v, w):
        return rms_norm(v, w, eps, backend=mm)

    g = "_g" if "wq_g" in p else ""  # a global layer's own weights (`two_kinds`)
    width = p[f"wq{g}"].shape[-1]
    h = norm(x, p["attn_norm"])
    q = norm(project(h, p[f"wq{g}"], "te,ehd->thd", backend=mm), p[f"q_norm{g}"])
    k_raw = project(h, p[f"wk{g}"], "te,ehd->thd", backend=mm)
    k = norm(k_raw, p[f"k_norm{g}"])
    v_raw = project(h, p[f"wv{g}"], "te,ehd->thd", backend=mm) if f"wv{g}" in p else k_raw
    v = _cache_shaped(_unit_norm(v_raw, eps), cfg, cfg.num_kv_heads)
    q = _cache_shaped(layers.rotate(q, cos, sin), cfg, q.shape[1])
    k = _cache_shaped(layers.rotate(k, cos, sin), cfg, cfg.num_kv_heads)
    attn, kv = attend(
        q, k, v, kv, index, md, sm_scale=1.0,
        sliding_window=layer_window if cfg.sliding_window else None, soft_cap=None,
        kv_head_map=cfg.kv_head_map, backend=cfg.attention_backend, platform=cfg.platform,
    )
    attn = attn[..., :width]
    x = x + norm(layers.project_heads(attn, p[f"wo{g}"], backend=mm), p["post_attn_norm"])
    h = norm(x, p["pre_mlp_norm"])
    gate = project(h, p["w_gate"], "te,ef->tf", backend=mm)
    up = project(h, p["w_up"], "te,ef->tf", backend=mm)
    mlp = project(_gelu(gate) * up, p["w_down"], "tf,fe->te", backend=mm)
    if "router" in p:
        experts, weights = route(x, p, cfg)
        routed = experts_mlp(norm(x, p["pre_moe_norm"]), p, experts, weights, cfg.num_experts)
        mlp = norm(mlp, p["post_mlp_norm_1"]) + norm(routed, p["post_moe_norm"])
    x = (x + norm(mlp, p["post_mlp_norm"])) * p["layer_scalar"].astype(x.dtype)
    return x, kv


def logits(params: dict[str, jax.Array], cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Hidden states [N, E] (`forward` without `head`) -> float32 logits [N, V]."""
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, backend=cfg.matmul_backend)
    out = layers.lm_head(x, params, cfg.tie_word_embeddings, cfg.matmul_backend)
    if cfg.final_logit_softcapping:
        cap = cfg.final_logit_softcapping
        out = cap * jnp.tanh(out / cap)
    return out


NETWORK = Network(name="gemma4", param_specs=param_specs, forward=forward, logits=logits,
                  layer_keys=LAYER_KEYS, layer_ordinals=layer_ordinals)

_scalar = Transform(  # HF's per-layer `layer_scalar` [1] -> one value per layer
    apply=lambda w, cfg: np.asarray(w).reshape(()),
    source_index=lambda idx, d: ((slice(None),), ()),
    source_shape=lambda shape, d: (1,),
)
_RULES: tuple[Rule, ...] = (
    # A multimodal checkpoint's audio tower and the towers' projections into the text model.
    (r"model\.(?:audio_tower|embed_vision|embed_audio)\..*", (), same),
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


def _heads_in(d: int) -> Transform:
    """q/k/v [H*d, E] -> [E, H, d] for a kind whose head width `d` is not `head_dim`."""
    return dataclasses.replace(
        heads_in, apply=lambda w, cfg: w.T.reshape(w.shape[1], -1, d),
        source_index=lambda idx, _: heads_in.source_index(idx, d))


def _o_in(d: int) -> Transform:
    """o [E, H*d] -> [H, d, E] for a kind whose head width `d` is not `head_dim`."""
    return dataclasses.replace(
        o_in, apply=lambda w, cfg: w.T.reshape(-1, d, w.shape[0]),
        source_index=lambda idx, _: o_in.source_index(idx, d))


def _weight_rules(cfg: ModelConfig) -> tuple[Rule, ...]:
    """Under `two_kinds` the global layers' attention keys go to their own stacks (`*_g`),
    the sliding layers' are read at their own head width; `_RULES` otherwise."""
    if not two_kinds(cfg):
        return _RULES
    full = "|".join(str(i) for i, s in enumerate(cfg.sliding_layers) if not s)
    at_full = rf"model\.layers\.({full})\.self_attn\."
    d = cfg.sliding_head_dim or cfg.head_dim
    return (
        (at_full + r"q_proj\.weight", "wq_g", heads_in),
        (at_full + r"k_proj\.weight", "wk_g", heads_in),
        (at_full + r"v_proj\.weight", "wv_g", heads_in),
        (at_full + r"o_proj\.weight", "wo_g", o_in),
        (at_full + r"q_norm\.weight", "q_norm_g", same),
        (at_full + r"k_norm\.weight", "k_norm_g", same),
        (LAYER + r"self_attn\.q_proj\.weight", "wq", _heads_in(d)),
        (LAYER + r"self_attn\.k_proj\.weight", "wk", _heads_in(d)),
        (LAYER + r"self_attn\.v_proj\.weight", "wv", _heads_in(d)),
        (LAYER + r"self_attn\.o_proj\.weight", "wo", _o_in(d)),
    ) + _RULES


def _global_shape(hf: dict[str, Any]) -> tuple[int, int]:
    """The global layers' (head width, KV heads), as HF's config reads them: from
    `per_layer_config` where the file has one (even empty), else `global_head_dim` (default
    512) and, with `attention_k_eq_v`, `num_global_key_value_heads`."""
    num_layers = int(hf["num_hidden_layers"])
    layer_types = hf.get("layer_types") or ["full_attention" if full else "sliding_attention"
                                            for full in _global_layers(num_layers)]
    head_dim, kv_heads = hf.get("head_dim", 256), hf.get("num_key_value_heads", 4)
    # HF makes the last layer global, so there always is one.
    full = next((str(i) for i, t in enumerate(layer_types[:-1]) if t == "full_attention"),
                str(num_layers - 1))
    if "per_layer_config" in hf:
        per_layer = hf["per_layer_config"] or {}
        overrides = per_layer.get(full) or per_layer.get(int(full)) or {}
    else:
        overrides = {"head_dim": hf.get("global_head_dim", 512)}
        if hf.get("attention_k_eq_v") and hf.get("num_global_key_value_heads") is not None:
            overrides["num_key_value_heads"] = hf["num_global_key_value_heads"]
    return (int(overrides.get("head_dim", head_dim)),
            int(overrides.get("num_key_value_heads", kv_heads)))


def _refuse_unbuilt(hf: dict[str, Any], global_dim: int, global_kv: int) -> None:
    """One line for each Gemma 4 feature this network does not run (module docstring)."""
    head_dim, kv_heads = hf.get("head_dim", 256), hf.get("num_key_value_heads", 4)
    unbuilt = {
        "per-layer input embeddings (hidden_size_per_layer_input)":
            hf.get("hidden_size_per_layer_input", 256),
        "KV shared across layers (num_kv_shared_layers)": hf.get("num_kv_shared_layers", 0),
        "bidirectional attention (use_bidirectional_attention)":
            hf.get("use_bidirectional_attention"),
        "attention biases (attention_bias)": hf.get("attention_bias", False),
        "global layers with narrower heads than the sliding ones (global_head_dim)":
            global_dim < head_dim,
        "global layers with more KV heads than the sliding ones, or not dividing them":
            global_kv > kv_heads or kv_heads % global_kv,
        "an activation other than gelu_pytorch_tanh":
            hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh",
    }
    for what, present in unbuilt.items():
        if present:
            raise ValueError(f"gemma4_text: {what} is not built")


def _unwrap(hf: dict[str, Any]) -> dict[str, Any]:
    """Takes a multimodal checkpoint's text model; refuses what is not built; rewrites the
    global layers' proportional rope as the plain (or linearly scaled) rope it starts from,
    keeping its turning fraction apart; makes the last layer global as HF's config does."""
    if "text_config" in hf:  # a multimodal `gemma4` checkpoint: its text model
        hf = {**hf["text_config"], "model_type": "gemma4_text"}
    global_dim, global_kv = _global_shape(hf)
    _refuse_unbuilt(hf, global_dim, global_kv)
    hf = {"sliding_window": 512, "max_position_embeddings": 131_072, "head_dim": 256,
          "num_key_value_heads": 4, **hf}  # HF's Gemma4TextConfig defaults
    hf["_global_shape"] = (global_dim, global_kv)
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
    """The turning fraction of the global rope, the global layers' own shape (`two_kinds`) and
    the MoE block's widths."""
    out: dict[str, Any] = {
        "partial_rotary_factor": hf.get("_proportional_rotary_factor", 1.0)}
    global_dim, global_kv = hf["_global_shape"]
    if global_dim != fields["head_dim"]:  # the cache takes the wider heads
        out.update(head_dim=global_dim, sliding_head_dim=fields["head_dim"])
    if global_kv != fields["num_kv_heads"]:
        out["global_kv_heads"] = global_kv
    out["global_values_are_keys"] = bool(hf.get("attention_k_eq_v", False))
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
        "layer scalars, MoE block beside the dense MLP, global layers with wider heads, fewer "
        "KV heads and k = v (padded into the cache); no per-layer embeddings or shared KV",
        parity_test="test_gemma4_text_moe"),
        ModelType(name="gemma4", features="the text model of a multimodal Gemma 4 checkpoint "
                  "(as `gemma4_text`; vision and audio towers skipped)",
                  parity_test="test_gemma4_multimodal_checkpoint_serves_its_text_model"),
    ),
    network=NETWORK, unwrap_hf=_unwrap, hf_fields=_hf_fields, hf_weights_for=_weight_rules,
    default_sliding=_sliding_but_last, tied_by_default=True)
