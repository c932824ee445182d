"""DeepSeek-V2 (and -Lite) and DeepSeek-V3 (also Kimi K2's architecture): multi-head latent
attention (MLA) over a compressed KV cache, and DeepSeek's MoE (dense MLPs in the first layers,
then routed plus shared experts, `moe.py`). V3 differs only in its router (sigmoid scores and a
correction bias, `moe._route_sigmoid`) and in the multi-token-prediction layer its checkpoints
carry after the last one (skipped).

Einsum letters: t token, e hidden, h q head, n per-head "nope" dims (qk_nope_head_dim), r rope
dims (qk_rope_head_dim), c latent (kv_lora_rank), v per-head value dims, q the q latent
(q_lora_rank).

Attention, as HF computes it: q = W_q h (or W_qb norm(W_qa h)), split per head into q_nope
[n] and q_pe [r]; the token's compressed kv = W_kva h = [c_raw, k_pe]; c = norm(c_raw);
k_nope, v = W_kvb c per head; scores = q_nope . k_nope + rope(q_pe) . rope(k_pe), with k_pe
shared by every head. Here the cache keeps only the row [c, rope(k_pe)] of every token
(kv_lora_rank + qk_rope_head_dim numbers per layer: 576 at DeepSeek-V2's sizes, against
2 * 16 heads * 128 = 4096 for full keys and values of V2-Lite's 16 heads), and every step
uses the absorbed form, prefill chunks and decodes alike (one code path):
  q_latent = W_UK^T q_nope            [t, h, c]   (W_UK: the k_nope half of W_kvb)
  scores   = q_latent . c + q_pe . k_pe  = [q_latent, q_pe] . row   (exact: a reassociation)
  out      = W_UV (softmax . c)        [t, h, v]   (W_UV: the value half of W_kvb)
so attention is MQA with one kv head whose values are the row's latent columns
(`attention.attend_latent`). For a prefill chunk the absorbed form does c / n times the score
work of the expanded one (4x at 512 / 128); a separate expanded prefill path would be
faster for long prompts on accelerators, and is not built.

The rope turns adjacent pairs of the rope dims (HF's complex-number form, `_rope_pairs`), not
the first and second halves as Llama's does.

Layers: the first `first_dense_layers` have a dense SwiGLU MLP, the rest the MoE; their weights
stack only their own layers (`layer_offsets`), so the per-layer weight dicts differ, and a
model with both kinds runs the per-layer loop (the CPU default layout); a stacked layout is
accepted when all layers are of one kind.

The family's record (`DEEPSEEK_V2`: its HF config reader, weight rules, GGUF header and tensor
names) is at the end of this file.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jengine.models import layers, moe
from jengine.models.attention import AttentionMetadata, KVCache, attend_latent
from jengine.models.config import ModelConfig
from jengine.models.family import Family, GGUFHeader, ModelType, Network
from jengine.models.hf_config import eos_ids, rope_from_hf
from jengine.models.layers import ParamSpec, project, rms_norm, rope_inv_freq
from jengine.models.weight_rules import (
    LAYER,
    Rule,
    experts_t,
    heads_of,
    mtp_layers_skipped,
    o_heads_of,
    same,
    transposed,
)

DENSE_KEYS = ("w_gate", "w_up", "w_down")


def param_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Every weight; attention and norms stacked over all layers, the dense MLP over the first
    `first_dense_layers`, the MoE over the rest. Projections are stored input-first."""
    n, e, v, h = cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.num_heads
    c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    qk = cfg.qk_nope_head_dim + r
    specs = {
        "embed": ParamSpec((v, e), ("vocab", "embed"),
                           contract=(1,) if cfg.tie_word_embeddings else ()),
        "attn_norm": ParamSpec((n, e), ("layers", "embed"), "ones"),
        "wkv_a": ParamSpec((n, e, c + r), ("layers", "embed", "latent"), contract=(1,)),
        "kv_a_norm": ParamSpec((n, c), ("layers", "latent"), "ones"),
        # kv_b_proj per head: the first qk_nope columns are W_UK, the rest W_UV.
        "wkv_b": ParamSpec((n, c, h, cfg.qk_nope_head_dim + cfg.v_head_dim),
                           ("layers", "latent", "q_heads", "head_dim")),
        "wo": ParamSpec((n, h, cfg.v_head_dim, e), ("layers", "q_heads", "head_dim", "embed"),
                        contract=(1, 2)),
        "mlp_norm": ParamSpec((n, e), ("layers", "embed"), "ones"),
        "final_norm": ParamSpec((e,), ("embed",), "ones"),
    }
    if cfg.q_lora_rank:
        q = cfg.q_lora_rank
        specs["wq_a"] = ParamSpec((n, e, q), ("layers", "embed", "q_lora"), contract=(1,))
        specs["q_a_norm"] = ParamSpec((n, q), ("layers", "q_lora"), "ones")
        specs["wq_b"] = ParamSpec((n, q, h, qk), ("layers", "q_lora", "q_heads", "head_dim"),
                                  contract=(1,))
    else:
        specs["wq"] = ParamSpec((n, e, h, qk), ("layers", "embed", "q_heads", "head_dim"),
                                contract=(1,))
    dense, f = cfg.first_dense_layers, cfg.intermediate_size
    if dense:
        specs["w_gate"] = ParamSpec((dense, e, f), ("layers", "embed", "mlp"), contract=(1,))
        specs["w_up"] = ParamSpec((dense, e, f), ("layers", "embed", "mlp"), contract=(1,))
        specs["w_down"] = ParamSpec((dense, f, e), ("layers", "mlp", "embed"), contract=(1,))
    if dense < n:
        specs.update(moe.param_specs(cfg, gated_shared=False))
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((e, v), ("embed", "vocab"), contract=(0,))
    return specs


LAYER_KEYS = (
    "attn_norm", "wq", "wq_a", "q_a_norm", "wq_b", "wkv_a", "kv_a_norm", "wkv_b", "wo",
    "mlp_norm", *DENSE_KEYS, *moe.LAYER_KEYS,
)


def layer_offsets(cfg: ModelConfig) -> dict[str, int]:
    """The dense MLP's weights stack from layer 0, the MoE's from `first_dense_layers`."""
    return moe.layer_offsets(cfg, DENSE_KEYS)


def smoothing_folds(cfg: ModelConfig) -> tuple:
    """No `int8` smoothing folds are declared for MLA (its projections are plain dots)."""
    return ()


def forward(
    params: dict[str, jax.Array],
    cfg: ModelConfig,
    kv: KVCache,
    md: AttentionMetadata,
    *,
    all_logits: bool = False,
    head: bool = True,
) -> tuple[jax.Array, KVCache]:
    """One ragged step; same contract as `llama.forward`.

    Raises:
      ValueError: stacked weights of a model with both dense and MoE layers.
    """
    if "layers" not in params and layer_offsets(cfg):
        raise ValueError("deepseek_v2 with dense and MoE layers runs with per-layer weights "
                         "(layer_layout 'unstacked', the CPU default)")
    x = layers.embed_tokens(params["embed"], md.token_ids, params["final_norm"].dtype)  # [T, E]
    inv_freq = jnp.asarray(rope_inv_freq(cfg.rope, cfg.qk_rope_head_dim))  # [R/2]
    mm = cfg.matmul_backend

    def layer(carry, xs):
        x, kv = carry
        p, index, _ = xs
        h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps, backend=mm)
        attn, kv = _latent_attention(h, p, kv, index, md, cfg, inv_freq)
        x = x + layers.project_heads(attn, p["wo"], backend=mm)
        h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps, backend=mm)
        if "router" in p:
            out = moe.moe_mlp(h, p, cfg, router=moe.route_deepseek)
        else:
            gate = project(h, p["w_gate"], "te,ef->tf", backend=mm)
            up = project(h, p["w_up"], "te,ef->tf", backend=mm)
            out = project(jax.nn.silu(gate) * up, p["w_down"], "tf,fe->te", backend=mm)
        return (x + out, kv), None

    x, kv = layers.run_layers(layer, (x, kv), params, LAYER_KEYS, (), cfg.num_layers)
    if not all_logits:
        x = x[md.logits_indices]
    return (logits(params, cfg, x) if head else x), kv


def logits(params: dict[str, jax.Array], cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Hidden states [N, E] (`forward` without `head`) -> float32 logits [N, V]."""
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, backend=cfg.matmul_backend)
    return layers.lm_head(x, params, cfg.tie_word_embeddings, cfg.matmul_backend)


def _latent_attention(h, p, kv, index, md, cfg: ModelConfig, inv_freq):
    """[T, E] -> ([T, H, V] attention output before o_proj, the cache with this layer's rows)."""
    mm, eps = cfg.matmul_backend, cfg.rms_norm_eps
    nope, c = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    if "wq" in p:
        q = project(h, p["wq"], "te,ehd->thd", backend=mm)  # [T, H, N + R]
    else:
        q_low = rms_norm(project(h, p["wq_a"], "te,eq->tq", backend=mm), p["q_a_norm"], eps,
                         backend=mm)
        q = project(q_low, p["wq_b"], "tq,qhd->thd", backend=mm)
    compressed = project(h, p["wkv_a"], "te,ec->tc", backend=mm)  # [T, C + R]
    latent = rms_norm(compressed[:, :c], p["kv_a_norm"], eps, backend=mm)  # [T, C]
    scale = cfg.rope.attention_factor
    k_pe = _rope_pairs(compressed[:, None, c:], md.positions, inv_freq, scale)  # [T, 1, R]
    q_pe = _rope_pairs(q[..., nope:], md.positions, inv_freq, scale)  # [T, H, R]
    w_uk, w_uv = p["wkv_b"][..., :nope], p["wkv_b"][..., nope:]  # [C, H, N], [C, H, V]
    q_latent = jnp.einsum("thn,chn->thc", q[..., :nope], w_uk,
                          preferred_element_type=jnp.float32).astype(q.dtype)
    rows = jnp.concatenate([latent[:, None, :], k_pe], axis=-1)  # [T, 1, C + R]
    out, kv = attend_latent(
        jnp.concatenate([q_latent, q_pe], axis=-1), rows, kv, index, md, value_dim=c,
        sm_scale=cfg.sm_scale, kv_head_map=cfg.kv_head_map, backend=cfg.attention_backend,
    )  # [T, H, C]
    attn = jnp.einsum("thc,chv->thv", out, w_uv, preferred_element_type=jnp.float32)
    return attn.astype(h.dtype), kv


def _rope_pairs(x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
                scale: float) -> jax.Array:
    """Rotates [T, H, R] by position, pairs (x[2i], x[2i+1]) turning at frequency i (HF's
    DeepSeek-V2 multiplies them as complex numbers); cos and sin scaled by `scale`."""
    with jax.named_scope("rope"):
        angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, R/2]
        cos = (jnp.cos(angles) * scale)[:, None, :]
        sin = (jnp.sin(angles) * scale)[:, None, :]
        pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
        re, im = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1)
        return out.reshape(x.shape).astype(x.dtype)


NETWORK = Network(name="deepseek", param_specs=param_specs, forward=forward, logits=logits,
                  layer_keys=LAYER_KEYS, smoothing_folds=smoothing_folds,
                  layer_offsets=layer_offsets)


def _read_hf(hf: dict[str, Any]) -> ModelConfig:
    """DeepSeek-V2 (and -Lite) and DeepSeek-V3 (Kimi K2's architecture): multi-head latent
    attention and DeepSeek's MoE.

    The softmax scale is HF's: (qk_nope + qk_rope) ** -0.5, times yarn's
    mscale(factor, mscale_all_dim) ** 2 under a scaled rope; the rope's own attention factor
    (mscale / mscale_all_dim) scales the rotated q and k parts. V3 routes by sigmoid scores
    (`noaux_tc`, whatever its `topk_method` says, as HF does) and renormalises with
    `norm_topk_prob`; V2 ignores `norm_topk_prob`, as HF does.

    Raises:
      ValueError: a V2 routing method other than greedy / group-limited greedy; V3 with its
        rope dims in halves (`rope_interleave: false`).
    """
    num_layers = int(hf["num_hidden_layers"])
    rope, _ = rope_from_hf(hf)
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    nope, rope_dim = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
    scale = float(nope + rope_dim) ** -0.5
    if rope.rope_type != "default" and params.get("mscale_all_dim"):
        m = 0.1 * float(params["mscale_all_dim"]) * math.log(rope.factor) + 1.0
        scale *= m * m if rope.factor > 1 else 1.0
    model_type = hf.get("model_type") or "deepseek_v2"
    v3 = model_type == "deepseek_v3"
    method = "noaux_tc" if v3 else hf.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"deepseek_v2 routing {method!r} is not built "
                         "(greedy, group_limited_greedy)")
    if v3 and hf.get("rope_interleave") is False:
        raise ValueError("deepseek_v3 with rope_interleave false (rope dims in halves) is not "
                         "built")
    grouped = method == "group_limited_greedy" or v3 and int(hf.get("n_group") or 1) > 1
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError(f"{model_type} with attention or MLP biases is not built")
    num_experts = int(hf["n_routed_experts"])
    moe_width = int(hf["moe_intermediate_size"])
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=num_layers,
        num_heads=int(hf["num_attention_heads"]),
        num_kv_heads=1,  # every q head reads the one latent row per token (MQA over the latent)
        head_dim=int(hf["kv_lora_rank"]) + rope_dim,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=rope,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_multiplier=scale,
        kv_lora_rank=int(hf["kv_lora_rank"]),
        q_lora_rank=int(hf.get("q_lora_rank") or 0),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(hf["v_head_dim"]),
        num_experts=num_experts,
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=moe_width,
        shared_expert_intermediate_size=moe_width * int(hf.get("n_shared_experts") or 0),
        first_dense_layers=min(int(hf.get("first_k_dense_replace", 0)), num_layers),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        expert_groups=int(hf["n_group"]) if grouped else 0,
        topk_groups=int(hf["topk_group"]) if grouped else 0,
        router_scoring="sigmoid" if v3 else "softmax",
        norm_topk_prob=v3 and bool(hf.get("norm_topk_prob", True)),
        mtp_layers=int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0)
        if v3 else 0,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids(hf),
    )


def _weight_rules(cfg: ModelConfig) -> tuple[Rule, ...]:
    """DeepSeek-V2's table (its head widths differ from the cache's `head_dim`, so the
    transforms are built for the config). The MoE weights' layer index counts from the first
    MoE layer (`layer_offsets`, applied by `converters.tables.lookup`)."""
    qk = heads_of(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    attn = LAYER + r"self_attn\."
    mlp = LAYER + r"mlp\."
    return (
        *mtp_layers_skipped(cfg),
        (r"model\.embed_tokens\.weight", "embed", same),
        (r"model\.norm\.weight", "final_norm", same),
        (r"lm_head\.weight", "lm_head", transposed),
        (LAYER + r"input_layernorm\.weight", "attn_norm", same),
        (LAYER + r"post_attention_layernorm\.weight", "mlp_norm", same),
        (attn + r"q_proj\.weight", "wq", qk),
        (attn + r"q_a_proj\.weight", "wq_a", transposed),
        (attn + r"q_a_layernorm\.weight", "q_a_norm", same),
        (attn + r"q_b_proj\.weight", "wq_b", qk),
        (attn + r"kv_a_proj_with_mqa\.weight", "wkv_a", transposed),
        (attn + r"kv_a_layernorm\.weight", "kv_a_norm", same),
        (attn + r"kv_b_proj\.weight", "wkv_b", heads_of(cfg.qk_nope_head_dim + cfg.v_head_dim)),
        (attn + r"o_proj\.weight", "wo", o_heads_of(cfg.v_head_dim)),
        (mlp + r"gate_proj\.weight", "w_gate", transposed),
        (mlp + r"up_proj\.weight", "w_up", transposed),
        (mlp + r"down_proj\.weight", "w_down", transposed),
        (mlp + r"gate\.weight", "router", transposed),
        (mlp + r"gate\.e_score_correction[._]bias", "router_bias", same),  # HF's, GGUF's
        (mlp + r"experts\.(\d+)\.gate_proj\.weight", "we_gate", transposed),
        (mlp + r"experts\.(\d+)\.up_proj\.weight", "we_up", transposed),
        (mlp + r"experts\.(\d+)\.down_proj\.weight", "we_down", transposed),
        # GGUF's: all a layer's experts in one tensor [X, out, in].
        (mlp + r"experts\.gate_proj\.weight", "we_gate", experts_t),
        (mlp + r"experts\.up_proj\.weight", "we_up", experts_t),
        (mlp + r"experts\.down_proj\.weight", "we_down", experts_t),
        (mlp + r"shared_experts\.gate_proj\.weight", "ws_gate", transposed),
        (mlp + r"shared_experts\.up_proj\.weight", "ws_up", transposed),
        (mlp + r"shared_experts\.down_proj\.weight", "ws_down", transposed),
    )


_GATING_SOFTMAX, _GATING_SIGMOID = 1, 2  # llama.cpp's `expert_gating_func` values


def _gguf_config(gguf: GGUFHeader, cfg: dict[str, Any]) -> None:
    """DeepSeek-V2's latent attention and MoE keys as HF's `deepseek_v2` fields.

    llama.cpp's converter writes the cache's widths as key / value_length (kv_lora_rank +
    rope, kv_lora_rank) and the heads' as key / value_length_mla; files older than that
    have only the heads' widths, as key / value_length. Its yarn mscale_all_dim is stored
    x 0.1 as `yarn_log_multiplier`, and its graph takes `mscale` equal to it (no key).

    DeepSeek-V3 files are `deepseek2` too: sigmoid gating makes them `deepseek_v3` (its
    correction bias is the `exp_probs_b` tensor; llama.cpp drops the MTP layers).

    Raises:
      ValueError: an expert gating function other than softmax and sigmoid, or renormalised
        softmax weights (which neither DeepSeek does).
    """
    gating = int(gguf.get("expert_gating_func", _GATING_SOFTMAX))
    if gating not in (_GATING_SOFTMAX, _GATING_SIGMOID):
        raise ValueError(f"{gguf.path.name}: deepseek2 with expert gating function {gating} "
                         "is not built (softmax, sigmoid)")
    v3 = gating == _GATING_SIGMOID
    if gguf.get("expert_weights_norm") and not v3:
        raise ValueError(f"{gguf.path.name}: deepseek2 with renormalised softmax expert "
                         "weights is not built (DeepSeek-V2 does not renormalise)")
    rope = int(gguf.get("rope.dimension_count"))
    mla = gguf.get("attention.key_length_mla") is not None
    heads = cfg["num_attention_heads"]
    key = int(gguf.get("attention.key_length_mla" if mla else "attention.key_length",
                       cfg["hidden_size"] // heads))
    value = int(gguf.get("attention.value_length_mla" if mla else "attention.value_length",
                         key - rope))
    cfg.pop("head_dim")  # the file's key_length: not a head width here
    moe_width = int(gguf.get("expert_feed_forward_length"))
    cfg.setdefault("intermediate_size", moe_width)
    cfg.update(
        kv_lora_rank=int(gguf.get("attention.kv_lora_rank")),
        q_lora_rank=(int(gguf.get("attention.q_lora_rank"))
                     if gguf.get("attention.q_lora_rank") else None),
        qk_rope_head_dim=rope, qk_nope_head_dim=key - rope, v_head_dim=value,
        n_routed_experts=int(gguf.get("expert_count")),
        num_experts_per_tok=int(gguf.get("expert_used_count")),
        moe_intermediate_size=moe_width,
        n_shared_experts=int(gguf.get("expert_shared_count", 0)),
        first_k_dense_replace=int(gguf.get("leading_dense_block_count", 0)),
        routed_scaling_factor=float(gguf.get("expert_weights_scale", 1.0)),
        topk_method="greedy",
    )
    groups = int(gguf.get("expert_group_count", 1))
    if groups > 1:  # HF's group-limited greedy: the best groups' experts only
        cfg.update(topk_method="group_limited_greedy", n_group=groups,
                   topk_group=int(gguf.get("expert_group_used_count")))
    if v3:
        cfg.update(model_type="deepseek_v3", topk_method="noaux_tc",
                   norm_topk_prob=bool(gguf.get("expert_weights_norm")),
                   num_nextn_predict_layers=0)
    log_mul = gguf.get("rope.scaling.yarn_log_multiplier")
    if "rope_scaling" in cfg and log_mul:
        mscale = float(log_mul) / 0.1
        cfg["rope_scaling"].update(mscale=mscale, mscale_all_dim=mscale)


DEEPSEEK_V2 = Family(
    name="deepseek_v2",
    network=NETWORK,
    model_types=(ModelType(
        name="deepseek_v2",
        features="MLA: compressed KV cache (latent + rope key per token), absorbed projections, "
                 "interleaved rope, yarn mscale; MoE (greedy / group-limited routing, routed "
                 "scaling, shared experts, dense first layers); tests/models/test_deepseek.py",
        parity_test="test_mla_parity_q_projection"),
        ModelType(
            name="deepseek_v3",
            features="DeepSeek-V2's MLA and MoE with sigmoid routing (`noaux_tc`: "
                     "`e_score_correction_bias` picks experts and groups, top-2 group scores, "
                     "`norm_topk_prob`); multi-token-prediction layers skipped; "
                     "tests/models/test_deepseek_v3.py",
            parity_test="test_deepseek_v3_sigmoid_routing"),
    ),
    read_hf=_read_hf,
    hf_weights_for=_weight_rules,
    gguf_archs=(("deepseek2", "deepseek_v2"),),  # or deepseek_v3, by its gating (below)
    gguf_config=_gguf_config,
    # Its latent attention projections and its shared experts (HF's `shared_experts`,
    # un-gated). `attn_k_b` is read with `attn_v_b` as the whole kv_b_proj
    # (`converters.gguf_file`).
    gguf_tensor_names={
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",
        "attn_k_b": "self_attn.kv_b_proj",
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
        "exp_probs_b": "mlp.gate.e_score_correction",  # `.bias`: V3's correction bias
    },
)
