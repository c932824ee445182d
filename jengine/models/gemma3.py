"""Gemma 3 (text): q/k norms, interleaved sliding-window and global layers with their own rope,
GeGLU MLP, scaled embeddings, and norms before and after both attention and MLP.

Gemma 2 is the same network without the q/k norms, with one rope for every layer and
soft-capped attention scores and final logits (`attn_logit_softcapping`,
`final_logit_softcapping`, which Gemma 3 leaves unset). Both records (`GEMMA3`, `GEMMA2`: names,
config keys, weight rules, GGUF header) are at the end of this file."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jengine.models import layers, lora
from jengine.models.attention import AttentionMetadata, KVCache, attend
from jengine.models.config import ModelConfig
from jengine.models.family import Family, GGUFHeader, ModelType, Network
from jengine.models.layers import ParamSpec, project, rms_norm, rope_inv_freq
from jengine.models.smoothing import ChannelFold, NormFold
from jengine.models.weight_rules import COMMON, LAYER, Rule, same, transposed


def param_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Every weight, stacked over layers. Norm weights use Gemma's (1 + w) convention."""
    n, e, f, v = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, k, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    norm = ("layers", "embed")
    specs = {
        # Tied (Gemma's default): the lm_head too, contracting the embed axis.
        "embed": ParamSpec((v, e), ("vocab", "embed"),
                           contract=(1,) if cfg.tie_word_embeddings else ()),
        "attn_norm": ParamSpec((n, e), norm, "zeros"),
        "wq": ParamSpec((n, e, h, d), ("layers", "embed", "q_heads", "head_dim"), contract=(1,)),
        "wk": ParamSpec((n, e, k, d), ("layers", "embed", "kv_heads", "head_dim"), contract=(1,)),
        "wv": ParamSpec((n, e, k, d), ("layers", "embed", "kv_heads", "head_dim"), contract=(1,)),
        "q_norm": ParamSpec((n, d), ("layers", "head_dim"), "zeros"),
        "k_norm": ParamSpec((n, d), ("layers", "head_dim"), "zeros"),
        "wo": ParamSpec((n, h, d, e), ("layers", "q_heads", "head_dim", "embed"),
                        contract=(1, 2)),
        "post_attn_norm": ParamSpec((n, e), norm, "zeros"),
        "pre_mlp_norm": ParamSpec((n, e), norm, "zeros"),
        "w_gate": ParamSpec((n, e, f), ("layers", "embed", "mlp"), contract=(1,)),
        "w_up": ParamSpec((n, e, f), ("layers", "embed", "mlp"), contract=(1,)),
        "w_down": ParamSpec((n, f, e), ("layers", "mlp", "embed"), contract=(1,)),
        "post_mlp_norm": ParamSpec((n, e), norm, "zeros"),
        "final_norm": ParamSpec((e,), ("embed",), "zeros"),
    }
    if not has_qk_norm(cfg):
        del specs["q_norm"], specs["k_norm"]
    if not cfg.tie_word_embeddings:  # HF's Gemma classes allow a separate head
        specs["lm_head"] = ParamSpec((e, v), ("embed", "vocab"), contract=(0,))
    return specs


def has_qk_norm(cfg: ModelConfig) -> bool:
    """Gemma 3 normalises every q and k head; Gemma 2 does not."""
    return cfg.model_type != "gemma2"


LAYER_KEYS = (
    "attn_norm", "wq", "wk", "wv", "q_norm", "k_norm", "wo", "post_attn_norm", "pre_mlp_norm",
    "w_gate", "w_up", "w_down", "post_mlp_norm",
    "lora",  # the step's adapter slots, when it has any (jengine.models.lora)
)


def smoothing_folds(cfg: ModelConfig) -> tuple[NormFold | ChannelFold, ...]:
    """Where `int8` smoothing folds its factors (`jengine.models.smoothing`), in order: each
    channel fold before the norm fold that reads the weight it rescales; the norms scale by
    (1 + w)."""
    return (
        ChannelFold("wv", "wo", heads=True),
        NormFold("attn_norm", ("wq", "wk", "wv"), offset=1.0),
        ChannelFold("w_up", "w_down"),
        NormFold("pre_mlp_norm", ("w_gate", "w_up"), offset=1.0),
    )


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
    eps = cfg.rms_norm_eps
    x = layers.embed_tokens(params["embed"], md.token_ids, params["final_norm"].dtype)
    x = x * jnp.asarray(np.sqrt(cfg.hidden_size), x.dtype)  # [T, E]
    global_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
    local_freq = rope_inv_freq(cfg.local_rope or cfg.rope, cfg.head_dim)
    sliding = np.asarray(cfg.sliding_layers, bool)
    window = cfg.sliding_window or 0
    big = np.iinfo(np.int32).max
    freq_rows, table_of_layer = layers.rope_rows(  # local and global: two rows at most
        np.where(sliding[:, None], local_freq, global_freq))
    cos_tables, sin_tables = layers.rope_tables(md.positions, jnp.asarray(freq_rows),
                                                barrier=cfg.branches)
    per_layer = (
        jnp.asarray(np.where(sliding, window, big), jnp.int32),  # [L] window per layer
        jnp.asarray(table_of_layer),  # [L] the layer's row of the tables
    )

    mm = cfg.matmul_backend

    def layer(carry, xs):
        x, kv = carry
        p, index, (layer_window, table) = xs
        h = rms_norm(x, p["attn_norm"], eps, offset=1.0, backend=mm)
        adapters, slots = p.get("lora"), md.lora_slots  # LoRA slots (a step without: None)
        q = lora.add_delta(project(h, p["wq"], "te,ehd->thd", backend=mm), h, adapters, "wq",
                           slots)
        k = lora.add_delta(project(h, p["wk"], "te,ehd->thd", backend=mm), h, adapters, "wk",
                           slots)
        if "q_norm" in p:
            q = rms_norm(q, p["q_norm"], eps, offset=1.0, backend=mm)
            k = rms_norm(k, p["k_norm"], eps, offset=1.0, backend=mm)
        v = lora.add_delta(project(h, p["wv"], "te,ehd->thd", backend=mm), h, adapters, "wv",
                           slots)
        q = layers.rotate(q, cos_tables[table], sin_tables[table])
        k = layers.rotate(k, cos_tables[table], sin_tables[table])
        attn, kv = attend(
            q, k, v, kv, index, md, sm_scale=cfg.sm_scale,
            sliding_window=layer_window if window else None, soft_cap=cfg.attn_logit_softcapping,
            kv_head_map=cfg.kv_head_map, backend=cfg.attention_backend, platform=cfg.platform,
        )
        attn = lora.add_delta(layers.project_heads(attn, p["wo"], backend=mm), attn, adapters,
                              "wo", slots)
        x = x + rms_norm(attn, p["post_attn_norm"], eps, offset=1.0, backend=mm)
        h = rms_norm(x, p["pre_mlp_norm"], eps, offset=1.0, backend=mm)
        gate = lora.add_delta(project(h, p["w_gate"], "te,ef->tf", backend=mm), h, adapters,
                              "w_gate", slots)
        up = lora.add_delta(project(h, p["w_up"], "te,ef->tf", backend=mm), h, adapters, "w_up",
                            slots)
        # In f32 and rounded once, as torch computes a bf16 tensor's gelu.
        act = jax.nn.gelu(gate.astype(jnp.float32), approximate=True).astype(gate.dtype)
        act = act * up
        mlp = lora.add_delta(project(act, p["w_down"], "tf,fe->te", backend=mm), act, adapters,
                             "w_down", slots)
        x = x + rms_norm(mlp, p["post_mlp_norm"], eps, offset=1.0, backend=mm)
        return (x, kv), None

    x, kv = layers.run_layers(layer, (x, kv), params, LAYER_KEYS, per_layer, cfg.num_layers)
    if not all_logits:
        x = x[md.logits_indices]
    return (logits(params, cfg, x) if head else x), kv


def logits(params: dict[str, jax.Array], cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Hidden states [N, E] (`forward` without `head`) -> float32 logits [N, V]."""
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, offset=1.0, backend=cfg.matmul_backend)
    out = layers.lm_head(x, params, cfg.tie_word_embeddings, cfg.matmul_backend)
    if cfg.final_logit_softcapping:
        cap = cfg.final_logit_softcapping
        out = cap * jnp.tanh(out / cap)
    return out


def final_norm(params: dict[str, jax.Array], cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Hidden states [N, E] -> the final norm's output [N, E] (what an embedding pools)."""
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps, offset=1.0,
                    backend=cfg.matmul_backend)


NETWORK = Network(name="gemma3", param_specs=param_specs, forward=forward, logits=logits,
                  layer_keys=LAYER_KEYS, smoothing_folds=smoothing_folds, final_norm=final_norm)

_RULES: tuple[Rule, ...] = COMMON + (
    (r"lm_head\.weight", "lm_head", transposed),  # untied heads (`tie_word_embeddings: false`)
    (LAYER + r"self_attn\.q_norm\.weight", "q_norm", same),
    (LAYER + r"self_attn\.k_norm\.weight", "k_norm", same),
    (LAYER + r"post_attention_layernorm\.weight", "post_attn_norm", same),
    (LAYER + r"pre_feedforward_layernorm\.weight", "pre_mlp_norm", same),
    (LAYER + r"post_feedforward_layernorm\.weight", "post_mlp_norm", same),
)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's test for its 27B attention scale


def _hf_fields(hf: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Gemma's softmax scale (`query_pre_attn_scalar`); the rope scalings not built for it.

    Raises:
      ValueError: yarn, longrope or dynamic rope scaling.
    """
    if fields["rope"].rope_type in ("yarn", "longrope", "dynamic"):
        raise ValueError(f"rope scaling {fields['rope'].rope_type!r} is not built for "
                         f"{hf['model_type']}")
    return {"query_pre_attn_scalar": hf.get("query_pre_attn_scalar")}


def _sliding_every(default: int):
    """Every `sliding_window_pattern`-th layer global, the others sliding (Gemma 2 alternates
    from layer 0, Gemma 3 has five sliding layers per global one)."""
    def layers_of(hf: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
        pattern = int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", default)))
        return tuple((i + 1) % pattern != 0 for i in range(num_layers))
    return layers_of


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Gemma 3 checkpoint's text model."""
    if "text_config" not in hf:
        return hf
    return {**hf["text_config"], "model_type": "gemma3_text"}


def _gguf_config(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    cfg["sliding_window"] = int(gguf.get("attention.sliding_window", 4096))
    # llama.cpp scales queries by hidden / heads for the 27B models (46 layers in Gemma 2,
    # 62 in Gemma 3: their query_pre_attn_scalar), by head_dim otherwise; no key says it.
    layers_, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    cfg["query_pre_attn_scalar"] = (cfg["hidden_size"] // heads
                                    if layers_ == _GEMMA_27B_LAYERS[gguf.arch]
                                    else cfg["head_dim"])
    if gguf.arch == "gemma3":
        cfg["rope_local_base_freq"] = 10000.0
        cfg["sliding_window_pattern"] = 6
        return
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if gguf.get(key) is not None:
            cfg[key] = float(gguf.get(key))


# What Gemma 2 and 3 share: llama.cpp stores their norms as (1 + w) and names the MLP's
# pre-norm `ffn_norm`.
_SHARED = dict(network=NETWORK, hf_fields=_hf_fields, tied_by_default=True, hf_weights=_RULES,
               gguf_config=_gguf_config, gguf_norm_offset=1.0,
               gguf_tensor_names={"ffn_norm": "pre_feedforward_layernorm"})

GEMMA3 = Family(
    name="gemma3",
    model_types=(
        ModelType(name="gemma3_text", features="q/k norms, interleaved sliding / global layers "
                  "with two ropes, GeGLU", parity_test="test_gemma3_text"),
        ModelType(name="gemma3", features="the text model of a multimodal Gemma 3 checkpoint "
                  "(as `gemma3_text`)"),
    ),
    unwrap_hf=_text_config, default_sliding=_sliding_every(6),
    gguf_archs=(("gemma3", "gemma3_text"),), **_SHARED)
GEMMA2 = Family(
    name="gemma2",
    model_types=(ModelType(name="gemma2", features="attention and final logit soft-capping, "
                           "alternating sliding window", parity_test="test_gemma2_soft_capping"),),
    default_sliding=_sliding_every(2), gguf_archs=(("gemma2", "gemma2"),), **_SHARED)
