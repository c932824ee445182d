"""The Llama network: Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3, Granite 3, SmolLM2/3,
Phi-3, OLMo 2/3, EXAONE 4, Seed-OSS, and the MoE Mixtral, Qwen2/3-MoE, Granite-MoE and GLM-4.5
(`jengine/models/moe.py`) through config switches. Each of those families' records (its names,
config keys, weight rules) is in `jengine/models/llama_variants.py` (GLM-4.5's in
`glm4_moe.py`). A MoE model whose first `first_dense_layers` layers are dense (GLM-4.5) stacks
each MLP's weights over its own layers only (`layer_offsets`), so it runs the per-layer loop.

Every layer weight is declared with a leading `layers` axis; the layers run under `jax.lax.scan`
with the stacked KV cache in the carry (each layer updates its pages in place), or, with the
weights split per layer (`layers.unstack_layers`, the CPU default), as a loop over layers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jengine.models import fused, layers, lora, matmul, moe
from jengine.models.attention import AttentionMetadata, KVCache, attend
from jengine.models.config import ModelConfig
from jengine.models.family import Network
from jengine.models.layers import ParamSpec, apply_rope, project, rms_norm, rope_inv_freq
from jengine.models.smoothing import ChannelFold, NormFold


def param_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Every weight of the model, stacked over layers. Projections are stored input-first."""
    n, e, f, v = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, k, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    specs = {
        # Tied: the lm_head too, contracting the embed axis (quantized only on request).
        "embed": ParamSpec((v, e), ("vocab", "embed"),
                           contract=(1,) if cfg.tie_word_embeddings else ()),
        "attn_norm": ParamSpec((n, e), ("layers", "embed"), "ones"),
        "wq": ParamSpec((n, e, h, d), ("layers", "embed", "q_heads", "head_dim"), contract=(1,)),
        "wk": ParamSpec((n, e, k, d), ("layers", "embed", "kv_heads", "head_dim"), contract=(1,)),
        "wv": ParamSpec((n, e, k, d), ("layers", "embed", "kv_heads", "head_dim"), contract=(1,)),
        "wo": ParamSpec((n, h, d, e), ("layers", "q_heads", "head_dim", "embed"),
                        contract=(1, 2)),
        "mlp_norm": ParamSpec((n, e), ("layers", "embed"), "ones"),
        "w_gate": ParamSpec((n, e, f), ("layers", "embed", "mlp"), contract=(1,)),
        "w_up": ParamSpec((n, e, f), ("layers", "embed", "mlp"), contract=(1,)),
        "w_down": ParamSpec((n, f, e), ("layers", "mlp", "embed"), contract=(1,)),
        "final_norm": ParamSpec((e,), ("embed",), "ones"),
    }
    if cfg.num_experts:  # dense MLPs on the first `first_dense_layers` layers only
        for name in DENSE_KEYS:
            if cfg.first_dense_layers:
                spec = specs[name]
                specs[name] = dataclasses.replace(
                    spec, shape=(cfg.first_dense_layers, *spec.shape[1:]))
            else:
                del specs[name]
        specs.update(moe.param_specs(cfg, gated_shared=cfg.shared_expert_gate))
    if cfg.post_norms:  # OLMo 2 normalises the sub-layer outputs, not their inputs
        del specs["attn_norm"], specs["mlp_norm"]
        specs["post_attn_norm"] = ParamSpec((n, e), ("layers", "embed"), "ones")
        specs["post_mlp_norm"] = ParamSpec((n, e), ("layers", "embed"), "ones")
    if cfg.qkv_bias:
        specs["bq"] = ParamSpec((n, h, d), ("layers", "q_heads", "head_dim"), "zeros")
        specs["bk"] = ParamSpec((n, k, d), ("layers", "kv_heads", "head_dim"), "zeros")
        specs["bv"] = ParamSpec((n, k, d), ("layers", "kv_heads", "head_dim"), "zeros")
    if cfg.o_bias:
        specs["bo"] = ParamSpec((n, e), ("layers", "embed"), "zeros")
    if cfg.attention_sinks:  # gpt-oss: one logit per q head in the softmax's denominator
        specs["sinks"] = ParamSpec((n, h), ("layers", "q_heads"), "zeros")
    if cfg.mlp_bias:
        specs["b_gate"] = ParamSpec((n, f), ("layers", "mlp"), "zeros")
        specs["b_up"] = ParamSpec((n, f), ("layers", "mlp"), "zeros")
        specs["b_down"] = ParamSpec((n, e), ("layers", "embed"), "zeros")
    if cfg.qk_norm:
        specs["q_norm"] = ParamSpec((n, d), ("layers", "head_dim"), "ones")
        specs["k_norm"] = ParamSpec((n, d), ("layers", "head_dim"), "ones")
    if cfg.qk_norm_full:  # one weight per (head, dim): shards and pads with the heads
        specs["q_norm"] = ParamSpec((n, h, d), ("layers", "q_heads", "head_dim"), "ones")
        specs["k_norm"] = ParamSpec((n, k, d), ("layers", "kv_heads", "head_dim"), "ones")
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((e, v), ("embed", "vocab"), contract=(0,))
    return specs


DENSE_KEYS = ("w_gate", "w_up", "w_down")

LAYER_KEYS = (
    "attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down",
    "bq", "bk", "bv", "bo", "b_gate", "b_up", "b_down", "q_norm", "k_norm",
    "post_attn_norm", "post_mlp_norm", "sinks", *moe.LAYER_KEYS,
    "lora",  # the step's adapter slots, when it has any (jengine.models.lora)
)


def smoothing_folds(cfg: ModelConfig) -> tuple[NormFold | ChannelFold, ...]:
    """Where `int8` smoothing may fold its factors (`jengine.models.smoothing`), in order: v
    into wo, the attention norm into q/k/v, up into down, the MLP norm into gate/up (each
    channel fold before the norm fold that reads the weight it rescales). No norm folds with
    post-norms (OLMo 2: the projections read the raw residual), no MLP folds into MoE experts."""
    folds: list[NormFold | ChannelFold] = [
        ChannelFold("wv", "wo", bias="bv", heads=True)]
    if not cfg.post_norms:
        folds.append(NormFold("attn_norm", ("wq", "wk", "wv")))
    if not cfg.num_experts:
        folds.append(ChannelFold("w_up", "w_down", bias="b_up"))
        if not cfg.post_norms:
            folds.append(NormFold("mlp_norm", ("w_gate", "w_up")))
    return tuple(folds)


def forward(
    params: dict[str, jax.Array],
    cfg: ModelConfig,
    kv: KVCache,
    md: AttentionMetadata,
    *,
    all_logits: bool = False,
    head: bool = True,
) -> tuple[jax.Array, KVCache]:
    """One ragged step. Returns float32 logits [S, V] at `md.logits_indices` ([T, V] with
    `all_logits`) and the updated cache; without `head`, the hidden states [S, E] (or [T, E])
    that `logits` turns into them, so a caller can take the logits of fewer rows."""
    if "layers" not in params and layer_offsets(cfg):
        raise ValueError(f"{cfg.model_type} with dense and MoE layers runs with per-layer "
                         "weights (layer_layout 'unstacked', the CPU default)")
    router = moe.router_of(cfg)
    x = layers.embed_tokens(params["embed"], md.token_ids, params["final_norm"].dtype)  # [T, E]
    if cfg.embedding_multiplier != 1.0:
        x = x * jnp.asarray(cfg.embedding_multiplier, x.dtype)
    x = layers.splice_embeds(x, md.embeds, md.embeds_at)
    scaled = _scaled_by(cfg.residual_multiplier)
    window = cfg.sliding_window
    inv_freq = _layer_inv_freq(cfg)  # [L, R/2]
    freq_rows, table_of_layer = layers.rope_rows(inv_freq)
    per_layer = (
        jnp.asarray(  # [L] window per layer
            [window if (window and s) else jnp.iinfo(jnp.int32).max for s in cfg.sliding_layers],
            jnp.int32,
        ),
        jnp.asarray(inv_freq),
        jnp.asarray(table_of_layer),  # [L] the layer's row of freq_rows
    )
    # The rope's cos/sin scale (longrope's, yarn's attention factor): a constant when every
    # layer shares it, else per layer (OLMo 3's yarn on its global layers only).
    scales = _layer_rope_scale(cfg)
    uniform = float(scales[0]) if (scales == scales[0]).all() else None
    if uniform is None:
        per_layer = per_layer + (jnp.asarray(scales),)
    # Frequencies by position (dynamic NTK, longrope's long factors): [T, R/2] for this step,
    # added on the layers that use the global rope (their rows of the table above are zero).
    by_position = cfg.rope.by_position
    if by_position:
        token_freq = layers.rope_token_inv_freq(cfg.rope, cfg.rotary_dim, md.positions)
        per_layer = per_layer + (jnp.asarray(_layer_uses_global_rope(cfg)),)
    elif md.mrope_positions is not None:  # Qwen2.5-VL: three positions per token
        axis = layers.mrope_axes(cfg.rope.mrope_section, cfg.rope.mrope_interleaved,
                                 freq_rows.shape[1])
        cos_tables, sin_tables = layers.mrope_tables(md.mrope_positions, jnp.asarray(freq_rows),
                                                     axis)
    else:  # [U, T, R/2] each, for the U distinct rows of frequencies
        cos_tables, sin_tables = layers.rope_tables(md.positions, jnp.asarray(freq_rows),
                                                    barrier=cfg.branches)
    # Llama 4: chunked attention on the rope layers, q/k norm there, q's temperature elsewhere.
    chunked = cfg.attention_chunk_size is not None
    if chunked:
        per_layer = per_layer + (jnp.asarray(
            [cfg.attention_chunk_size if r else jnp.iinfo(jnp.int32).max
             for r in cfg.rope_layers or (True,) * cfg.num_layers], jnp.int32),)
    l4_flags = cfg.qk_l2_norm or cfg.attn_temperature is not None
    if l4_flags:
        per_layer = per_layer + (jnp.asarray(cfg.rope_layers or (True,) * cfg.num_layers),)
        temperature = _nope_temperature(cfg, md.positions)  # [T, 1, 1] or None

    mm = cfg.matmul_backend

    def layer(carry, xs):
        x, kv = carry
        p, index, (layer_window, inv_freq, table, *rest) = xs
        if l4_flags:
            *rest, turns = rest  # [] bool: this layer has rope
        if chunked:
            *rest, layer_chunk = rest
        if by_position:
            *rest, global_rope = rest
            inv_freq = inv_freq[None, :] + global_rope * token_freq  # [T, R/2]
        rope_scale = uniform if uniform is not None else rest[0]

        def turn(x):
            if by_position:
                return apply_rope(x, md.positions, inv_freq, rope_scale)
            return layers.rotate(x, cos_tables[table], sin_tables[table], rope_scale)

        h = x if cfg.post_norms else rms_norm(x, p["attn_norm"], cfg.rms_norm_eps, backend=mm)
        adapters, slots = p.get("lora"), md.lora_slots  # LoRA slots (a step without: None)
        if "w_qkv" in p:  # one GEMM (jengine.models.fused)
            q, k, v = fused.split_qkv(project(h, p["w_qkv"], "te,esgd->tsgd", backend=mm),
                                      cfg.num_heads, cfg.num_kv_heads)
        else:
            q = project(h, p["wq"], "te,ehd->thd", p.get("bq"), backend=mm)
            k = project(h, p["wk"], "te,ehd->thd", p.get("bk"), backend=mm)
            v = project(h, p["wv"], "te,ehd->thd", p.get("bv"), backend=mm)
        if adapters is not None:
            q = lora.add_delta(q, h, adapters, "wq", slots)
            k = lora.add_delta(k, h, adapters, "wk", slots)
            v = lora.add_delta(v, h, adapters, "wv", slots)
        if cfg.qk_norm:  # per head, before rope
            q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps, backend=mm)
            k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps, backend=mm)
        if cfg.qk_norm_full:
            q = _rms_norm_heads(q, p["q_norm"], cfg.rms_norm_eps, cfg.num_heads - cfg.padded_heads)
            k = _rms_norm_heads(k, p["k_norm"], cfg.rms_norm_eps, cfg.num_kv_heads)
        q, k = turn(q), turn(k)
        if l4_flags:
            q, k = _llama4_qk(q, k, turns, temperature, cfg)
        attn, kv = attend(
            q, k, v, kv, index, md, sm_scale=cfg.sm_scale,
            sliding_window=layer_window if window else None, soft_cap=cfg.attn_logit_softcapping,
            kv_head_map=cfg.kv_head_map, backend=cfg.attention_backend, platform=cfg.platform,
            chunk=layer_chunk if chunked else None, sinks=p.get("sinks"),
        )
        attn = lora.add_delta(layers.project_heads(attn, p["wo"], p.get("bo"), backend=mm),
                              attn, adapters, "wo", slots)
        if cfg.post_norms:
            attn = rms_norm(attn, p["post_attn_norm"], cfg.rms_norm_eps, backend=mm)
        x = x + scaled(attn)
        h = x if cfg.post_norms else rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps, backend=mm)
        out = moe.moe_mlp(h, p, cfg, router=router) if "router" in p else _mlp(h, p, mm, slots)
        if cfg.post_norms:
            out = rms_norm(out, p["post_mlp_norm"], cfg.rms_norm_eps, backend=mm)
        x = x + scaled(out)
        x = layers.add_deepstack(x, md.deepstack, md.embeds_at, index)  # Qwen3-VL's images
        return (x, kv), None

    x, kv = layers.run_layers(layer, (x, kv), params, LAYER_KEYS, per_layer, cfg.num_layers)
    if not all_logits:
        x = x[md.logits_indices]
    return (logits(params, cfg, x) if head else x), kv


def logits(params: dict[str, jax.Array], cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Hidden states [N, E] (`forward` without `head`) -> float32 logits [N, V]."""
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, backend=cfg.matmul_backend)
    out = layers.lm_head(x, params, cfg.tie_word_embeddings, cfg.matmul_backend)
    if cfg.logits_scaling != 1.0:
        out = out / cfg.logits_scaling
    return out


def _layer_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """[L, R/2] rope frequencies per layer: the sliding layers' own rope where the config has
    one (OLMo 3), zeros where no rope applies (SmolLM3's and EXAONE 4's NoPE layers: a zero
    angle turns nothing, exactly)."""
    full = rope_inv_freq(cfg.rope, cfg.rotary_dim)
    if cfg.rope.by_position:  # computed per token in the step instead
        full = np.zeros_like(full)
    local = rope_inv_freq(cfg.local_rope, cfg.rotary_dim) if cfg.local_rope else full
    sliding = cfg.sliding_layers or (False,) * cfg.num_layers
    rope = cfg.rope_layers or (True,) * cfg.num_layers
    return np.stack([(local if s else full) * r for s, r in zip(sliding, rope, strict=True)])


def _layer_uses_global_rope(cfg: ModelConfig) -> np.ndarray:
    """[L] 1.0 where a layer turns q and k with `cfg.rope` (not a NoPE layer, not a sliding
    layer with its own rope), else 0.0."""
    sliding = cfg.sliding_layers or (False,) * cfg.num_layers
    rope = cfg.rope_layers or (True,) * cfg.num_layers
    return np.asarray([float(r and not (s and cfg.local_rope)) for s, r in zip(sliding, rope)],
                      np.float32)


def _layer_rope_scale(cfg: ModelConfig) -> np.ndarray:
    """[L] the attention factor of the rope each layer uses (see `_layer_inv_freq`)."""
    local = cfg.local_rope or cfg.rope
    sliding = cfg.sliding_layers or (False,) * cfg.num_layers
    return np.asarray([(local if s else cfg.rope).attention_factor for s in sliding],
                      np.float32)


def _nope_temperature(cfg: ModelConfig, positions: jax.Array) -> jax.Array | None:
    """Llama 4's q scale on its NoPE layers, [T, 1, 1]: log1p(floor((pos + 1) / floor_scale)) *
    attn_scale + 1, growing with the position past `floor_scale`."""
    if cfg.attn_temperature is None:
        return None
    floor_scale, attn_scale = cfg.attn_temperature
    pos = positions.astype(jnp.float32)
    return (jnp.log1p(jnp.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0)[:, None, None]


def _llama4_qk(q, k, turns, temperature, cfg: ModelConfig):
    """After the rope: on Llama 4's rope layers q and k by a weightless RMSNorm (with
    `qk_l2_norm`), on its NoPE layers q by the position's temperature."""
    if cfg.qk_l2_norm:
        def norm(x):
            xf = x.astype(jnp.float32)
            normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + cfg.rms_norm_eps)
            return jnp.where(turns, normed.astype(x.dtype), x)
        q, k = norm(q), norm(k)
    if temperature is not None:
        q = jnp.where(turns, q, (q * temperature.astype(q.dtype)).astype(q.dtype))
    return q, k


def _mlp(h: jax.Array, p: dict[str, jax.Array], mm: str,
         slots: jax.Array | None = None) -> jax.Array:
    """The dense SwiGLU MLP [T, E] -> [T, E] (`mm`: the matmul backend). With LoRA slots in
    `p["lora"]` (`slots` [T]) each projection adds its adapter update, so the gate and up
    products are made apart (`matmul.swiglu`'s own order where it is not fused)."""
    adapters = p.get("lora")
    if "b_gate" in p or "b_up" in p or adapters is not None:
        gate = project(h, p["w_gate"], "te,ef->tf", p.get("b_gate"), backend=mm)
        up = project(h, p["w_up"], "te,ef->tf", p.get("b_up"), backend=mm)
        gate = lora.add_delta(gate, h, adapters, "w_gate", slots)
        up = lora.add_delta(up, h, adapters, "w_up", slots)
        act = jax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype) * up
    elif "w_gate_up" in p:  # one GEMM (jengine.models.fused), swiglu's rounding
        gate, up = fused.split_gate_up(project(h, p["w_gate_up"], "te,esgf->tsgf", backend=mm))
        act = jax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype) * up
    else:  # the activation in f32 and rounded once, as torch does for a bf16 tensor
        with jax.named_scope("proj"):
            act = matmul.swiglu(h, p["w_gate"], p["w_up"], mm)
    down = project(act, p["w_down"], "tf,fe->te", p.get("b_down"), backend=mm)
    return lora.add_delta(down, act, adapters, "w_down", slots)


def _rms_norm_heads(x: jax.Array, weight: jax.Array, eps: float, real_heads: int) -> jax.Array:
    """OLMo 2's RMSNorm over all heads of a token at once ([T, H, D], weight [H, D]).

    The mean of squares divides by the real heads' width: q heads zero-padded for tp
    (`ModelConfig.padded_heads`) add nothing to the sum and must not count in the mean."""
    with jax.named_scope("norm"):
        x32 = x.astype(jnp.float32)
        squares = (x32 * x32).reshape(x.shape[0], 1, -1)  # [T, 1, H*D]
        mean_sq = layers.row_sum(squares) / (real_heads * x.shape[-1])  # [T, 1, 1]
        return weight * (x32 * jax.lax.rsqrt(mean_sq + eps)).astype(x.dtype)


def _scaled_by(multiplier: float):
    """x -> x * multiplier (Granite's residual branches); the identity when it is 1."""
    if multiplier == 1.0:
        return lambda x: x
    return lambda x: x * jnp.asarray(multiplier, x.dtype)


# The network every Llama-shaped family runs (their records: `jengine/models/llama_variants.py`).
def layer_offsets(cfg: ModelConfig) -> dict[str, int]:
    """GLM-4.5's dense first layers: their MLP stacks from layer 0, the MoE after them."""
    return moe.layer_offsets(cfg, DENSE_KEYS) if cfg.num_experts else {}


NETWORK = Network(name="llama", param_specs=param_specs, forward=forward, logits=logits,
                  layer_keys=LAYER_KEYS, smoothing_folds=smoothing_folds,
                  layer_offsets=layer_offsets, fused_projections=True)
