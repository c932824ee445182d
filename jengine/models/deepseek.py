"""DeepSeek-V2 (and -Lite): multi-head latent attention (MLA) over a compressed KV cache, and
DeepSeek's MoE (dense MLPs in the first layers, then routed plus shared experts, `moe.py`).

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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jengine.models import layers, moe
from jengine.models.attention import AttentionMetadata, KVCache, attend_latent
from jengine.models.config import ModelConfig
from jengine.models.layers import ParamSpec, project, rms_norm, rope_inv_freq

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
        specs.update(moe.param_specs(cfg))
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((e, v), ("embed", "vocab"), contract=(0,))
    return specs


LAYER_KEYS = (
    "attn_norm", "wq", "wq_a", "q_a_norm", "wq_b", "wkv_a", "kv_a_norm", "wkv_b", "wo",
    "mlp_norm", *DENSE_KEYS, *moe.LAYER_KEYS,
)


def layer_offsets(cfg: ModelConfig) -> dict[str, int]:
    """The first layer of each weight that stacks only some layers: the dense MLP from 0, the
    MoE from `first_dense_layers` (see `layers.unstack_layers`, `converters.tables.lookup`)."""
    if cfg.first_dense_layers in (0, cfg.num_layers):
        return {}
    offsets = dict.fromkeys(DENSE_KEYS, 0)
    offsets.update(dict.fromkeys(moe.LAYER_KEYS, cfg.first_dense_layers))
    return offsets


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
            out = moe.moe_mlp(h, p, cfg)
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
