"""Qwen3.5 (`qwen3_5_text`, and the text model of a `qwen3_5` checkpoint): a hybrid of Gated
DeltaNet linear-attention layers and gated full-attention layers (three linear layers per
attention layer by default, `layer_types` says which).

A full-attention layer is Qwen3's (per-head q/k RMSNorm, partial rotary: the first quarter of
each head turns) with an output gate: q_proj writes, per head, the query and then a gate, and
the attention output is multiplied by sigmoid(gate) before o_proj. Its KV goes to the paged
cache like every family's.

A linear layer (`_delta_net`) projects the token to q, k, v (one causal depthwise conv over
their channels, SiLU), a gate z, and per value head a write strength beta = sigmoid(b) and a
decay g = -exp(A_log) * softplus(a + dt_bias). Per value head it keeps a state S [Dk, Dv]:

    S <- S * exp(g);  S <- S + k (beta (v - S^T k))^T;  out = S^T q

with q and k L2-normalised and q scaled by Dk^-1/2 (k heads shared by Hv / Hk value heads),
then out is RMS-normed, times silu(z), and projected back. The conv's last inputs and S are a
fixed-size state per sequence (`KVCache.conv` / `.ssm`, one slot per running sequence); a row
whose first token in the step sits at position 0 starts from zeros, any other row continues
the state its slot holds (chunked prefill, decode). The recurrence runs token by token
(`lax.scan` over the step's tokens): the same program for prefill chunks and decodes.

Norms scale by (1 + weight) (the checkpoint stores the offset from one), except the gated norm
of the linear layers. Weights stack over the layers of their kind: attention ones over the
attention layers, linear ones over the linear layers (`layer_ordinals`), norms and MLPs over
all of them; split per layer (the CPU default) every layer's dict holds its own.

Qwen3-Next (`qwen3_next.py`) runs this forward: its layers hold a router (the MLP is then the
sparse MoE of `moe.py`) and fused DeltaNet input projections (`_delta_net_inputs`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jengine.models import layers, moe
from jengine.models.attention import AttentionMetadata, KVCache, attend
from jengine.models.config import ModelConfig
from jengine.models.family import Family, ModelType, Network
from jengine.models.layers import ParamSpec, project, rms_norm, rope_inv_freq
from jengine.models.llama import _mlp
from jengine.models.weight_rules import (
    LAYER,
    Rule,
    Transform,
    heads_in,
    heads_of,
    o_heads_of,
    o_in,
    same,
    transposed,
)

# A family's layers hold the keys its specs declare: Qwen3-Next (`qwen3_next.py`) has the MoE's
# keys instead of the dense MLP's, and its fused `lin_qkvz` / `lin_ba` instead of lin_qkv..a.
_DENSE_MLP_KEYS = ("w_gate", "w_up", "w_down")
EVERY_LAYER_KEYS = ("attn_norm", "mlp_norm", *_DENSE_MLP_KEYS, *moe.LAYER_KEYS)
ATTENTION_KEYS = ("wqg", "wk", "wv", "wo", "q_norm", "k_norm")
LINEAR_KEYS = ("lin_qkv", "lin_z", "lin_b", "lin_a", "lin_qkvz", "lin_ba", "lin_conv",
               "lin_dt_bias", "lin_a_log", "lin_norm", "lin_out")
_NOT_STARTED = np.iinfo(np.int32).max


def param_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Every weight, stacked over the layers of its kind. Projections are input-first."""
    n, e, f, v = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, k, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    na, nl = cfg.num_kv_layers, cfg.num_linear_layers
    hv, dk, dv, c = cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim, cfg.linear_conv_dim
    specs = {
        "embed": ParamSpec((v, e), ("vocab", "embed"),
                           contract=(1,) if cfg.tie_word_embeddings else ()),
        "attn_norm": ParamSpec((n, e), ("layers", "embed"), "zeros"),
        "mlp_norm": ParamSpec((n, e), ("layers", "embed"), "zeros"),
        "w_gate": ParamSpec((n, e, f), ("layers", "embed", "mlp"), contract=(1,)),
        "w_up": ParamSpec((n, e, f), ("layers", "embed", "mlp"), contract=(1,)),
        "w_down": ParamSpec((n, f, e), ("layers", "mlp", "embed"), contract=(1,)),
        "final_norm": ParamSpec((e,), ("embed",), "zeros"),
        # The attention layers: per q head its query then its gate ([.., H, 2D]).
        "wqg": ParamSpec((na, e, h, 2 * d), ("layers", "embed", "q_heads", "head_dim")),
        "wk": ParamSpec((na, e, k, d), ("layers", "embed", "kv_heads", "head_dim")),
        "wv": ParamSpec((na, e, k, d), ("layers", "embed", "kv_heads", "head_dim")),
        "wo": ParamSpec((na, h, d, e), ("layers", "q_heads", "head_dim", "embed")),
        "q_norm": ParamSpec((na, d), ("layers", "head_dim"), "zeros"),
        "k_norm": ParamSpec((na, d), ("layers", "head_dim"), "zeros"),
        # The linear layers (replicated under tp: their heads are not split yet).
        "lin_qkv": ParamSpec((nl, e, c), ("layers", "embed", "linear_conv")),
        "lin_z": ParamSpec((nl, e, hv, dv), ("layers", "embed", "linear_heads", "linear_v")),
        "lin_b": ParamSpec((nl, e, hv), ("layers", "embed", "linear_heads")),
        "lin_a": ParamSpec((nl, e, hv), ("layers", "embed", "linear_heads")),
        "lin_conv": ParamSpec((nl, cfg.linear_conv_kernel, c),
                              ("layers", "linear_kernel", "linear_conv")),
        "lin_dt_bias": ParamSpec((nl, hv), ("layers", "linear_heads"), "ones"),
        "lin_a_log": ParamSpec((nl, hv), ("layers", "linear_heads"), "zeros"),
        "lin_norm": ParamSpec((nl, dv), ("layers", "linear_v"), "ones"),
        "lin_out": ParamSpec((nl, hv, dv, e), ("layers", "linear_heads", "linear_v", "embed")),
    }
    if dk <= 0:
        raise ValueError(f"{cfg.model_type} has no linear key width")
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((e, v), ("embed", "vocab"), contract=(0,))
    return specs


def layer_ordinals(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The layers each kind's weights stack: attention keys over the attention layers, linear
    keys over the linear ones."""
    linear = tuple(i for i, lin in enumerate(cfg.linear_layers) if lin)
    full = tuple(i for i, lin in enumerate(cfg.linear_layers) if not lin)
    ordinals = {**dict.fromkeys(ATTENTION_KEYS, full), **dict.fromkeys(LINEAR_KEYS, linear)}
    if any(cfg.dense_mlp_layers):  # Qwen3-Next with dense layers: MLP keys over those only
        dense = tuple(i for i, d in enumerate(cfg.dense_mlp_layers) if d)
        sparse = tuple(i for i, d in enumerate(cfg.dense_mlp_layers) if not d)
        ordinals.update({**dict.fromkeys(_DENSE_MLP_KEYS, dense),
                         **dict.fromkeys(moe.LAYER_KEYS, sparse)})
    return ordinals


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
    `all_logits`; hidden states [S, E] / [T, E] without `head`) and the updated cache (pages
    of the attention layers, recurrent states of the linear ones)."""
    x = layers.embed_tokens(params["embed"], md.token_ids, params["final_norm"].dtype)  # [T, E]
    inv_freq = rope_inv_freq(cfg.rope, cfg.rotary_dim)[None]  # [1, R/2]
    cos, sin = layers.rope_tables(md.positions, jnp.asarray(inv_freq),  # [1, T, R/2] each
                                  barrier=cfg.branches)
    rows = _RowStates.of(md, page_size=kv.k.shape[3], num_rows=md.page_table.shape[0])
    # Every linear layer's row states read once and written back once, after all layers: a
    # read and a write per layer made XLA copy the whole state array around each write.
    conv_rows = rows.gather(kv.conv[:, 0])  # [Ll, S, K-1, C]
    ssm_rows = rows.gather(kv.ssm, axis=2)  # [Ll, S, Hv, Dk, Dv]
    conv_out, ssm_out = [], []
    mm = cfg.matmul_backend
    eps = cfg.rms_norm_eps
    ordinal = {"full": 0, "linear": 0}
    for i, linear in enumerate(cfg.linear_layers):
        kind = "linear" if linear else "full"
        j = ordinal[kind]  # the layer's place among those of its kind
        ordinal[kind] += 1
        p = params["layers"][i] if "layers" in params else _layer_slices(params, cfg, i)
        h = rms_norm(x, p["attn_norm"], eps, offset=1.0, backend=mm)
        if linear:
            out, (conv, ssm) = _delta_net(h, p, cfg, (conv_rows[j], ssm_rows[j]), md, rows)
            conv_out.append(conv)
            ssm_out.append(ssm)
        else:
            out, kv = _gated_attention(h, p, cfg, kv, j, md, (cos[0], sin[0]))
        x = x + out
        h = rms_norm(x, p["mlp_norm"], eps, offset=1.0, backend=mm)
        x = x + (moe.moe_mlp(h, p, cfg) if "router" in p else _mlp(h, p, mm))
    if conv_out:
        kv = dataclasses.replace(
            kv, conv=kv.conv.at[:, 0, rows.slots].set(jnp.stack(conv_out)),  # [Ll, S, K-1, C]
            ssm=kv.ssm.at[:, :, rows.slots].set(jnp.moveaxis(jnp.stack(ssm_out), 1, 2)))
    if not all_logits:
        x = x[md.logits_indices]
    return (logits(params, cfg, x) if head else x), kv


def _layer_slices(params: dict, cfg: ModelConfig, layer: int) -> dict:
    """Layer `layer`'s weights cut from the stacks (the stacked layout): a weight that stacks
    only some layers (`layer_ordinals`) at the layer's place among them."""
    ordinals = layer_ordinals(cfg)
    out = {}
    for key in EVERY_LAYER_KEYS + ATTENTION_KEYS + LINEAR_KEYS:
        held = ordinals.get(key)
        if key in params and (held is None or layer in held):
            out[key] = params[key][layer if held is None else held.index(layer)]
    return out


def logits(params: dict[str, jax.Array], cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Hidden states [N, E] -> float32 logits [N, V]."""
    return layers.lm_head(final_norm(params, cfg, x), params, cfg.tie_word_embeddings,
                          cfg.matmul_backend)


def final_norm(params: dict[str, jax.Array], cfg: ModelConfig, x: jax.Array) -> jax.Array:
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps, offset=1.0,
                    backend=cfg.matmul_backend)


def _gated_attention(h, p, cfg: ModelConfig, kv: KVCache, index: int, md: AttentionMetadata,
                     rope: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, KVCache]:
    """Qwen3's attention with the output gate: [T, E] -> [T, E]; writes layer `index`'s
    pages."""
    mm, eps, d = cfg.matmul_backend, cfg.rms_norm_eps, cfg.head_dim
    qg = project(h, p["wqg"], "te,ehd->thd", backend=mm)  # [T, H, 2D]
    q, gate = qg[..., :d], qg[..., d:]
    k = project(h, p["wk"], "te,ehd->thd", backend=mm)
    v = project(h, p["wv"], "te,ehd->thd", backend=mm)
    q = rms_norm(q, p["q_norm"], eps, offset=1.0, backend=mm)
    k = rms_norm(k, p["k_norm"], eps, offset=1.0, backend=mm)
    q, k = layers.rotate(q, *rope), layers.rotate(k, *rope)
    attn, kv = attend(q, k, v, kv, jnp.int32(index), md, sm_scale=cfg.sm_scale,
                      sliding_window=None, soft_cap=None, kv_head_map=cfg.kv_head_map,
                      backend=cfg.attention_backend, platform=cfg.platform)
    attn = attn * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(attn.dtype)
    return layers.project_heads(attn, p["wo"], backend=mm), kv


class _RowStates:
    """Which tokens and rows of a step carry recurrent state, and where it lives.

    Padding tokens write the scratch page 0 (`slot_mapping` < page size): they are the only
    ones that leave every state as it was. A row starts from zeros when its first real token
    is at position 0 (a new or recomputed sequence), else from its slot's state."""

    def __init__(self, valid: jax.Array, fresh: jax.Array, slots: jax.Array):
        self.valid = valid  # [T] bool
        self.fresh = fresh  # [S] bool
        self.slots = slots  # [S] int32

    @classmethod
    def of(cls, md: AttentionMetadata, *, page_size: int, num_rows: int) -> _RowStates:
        valid = md.slot_mapping >= page_size
        first = jax.ops.segment_min(jnp.where(valid, md.positions, _NOT_STARTED),
                                    md.token_seq, num_segments=num_rows)
        slots = (md.state_slots if md.state_slots is not None
                 else jnp.arange(1, num_rows + 1, dtype=jnp.int32))
        return cls(valid, first == 0, slots)

    def gather(self, state: jax.Array, axis: int = 1) -> jax.Array:
        """[Ll, .., N (at `axis`), ...] slots -> [Ll, S, ...] rows (the slot axis moved to 1
        once gathered), zeros for the rows that start here."""
        rows = jnp.moveaxis(jnp.take(state, self.slots, axis=axis), axis, 1)
        fresh = self.fresh.reshape(1, -1, *(1,) * (rows.ndim - 2))
        return jnp.where(fresh, jnp.zeros_like(rows), rows)


def _delta_net(h, p, cfg: ModelConfig, states: tuple[jax.Array, jax.Array],
               md: AttentionMetadata, rows: _RowStates
               ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """A Gated DeltaNet mixer: [T, E] -> [T, E], and its rows' states ([S, K-1, C] conv,
    [S, Hv, Dk, Dv] DeltaNet) carried from `states` through the step's tokens."""
    mm = cfg.matmul_backend
    hv, dv = cfg.linear_v_heads, cfg.linear_v_dim
    qkv, z, b, a = _delta_net_inputs(h, p, cfg)
    qkv, a = qkv.astype(jnp.float32), a.astype(jnp.float32)
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(p["lin_a_log"].astype(jnp.float32)) * jax.nn.softplus(
        a + p["lin_dt_bias"].astype(jnp.float32))  # [T, Hv] log decay
    states, out = jax.lax.scan(
        _token_step(cfg, p["lin_conv"].astype(jnp.float32)), states,
        (qkv, g, beta, md.token_seq, rows.valid))  # out [T, Hv, Dv]
    out = _gated_rms_norm(out, z, p["lin_norm"], cfg.rms_norm_eps).astype(h.dtype)
    return layers.project_heads(out.reshape(-1, hv, dv), p["lin_out"], backend=mm), states


def _delta_net_inputs(h, p, cfg: ModelConfig) -> tuple[jax.Array, ...]:
    """[T, E] -> the conv's channels (q, k, v) [T, C], z [T, Hv, Dv], b and a [T, Hv]: four
    projections (Qwen3.5), or two (Qwen3-Next's `lin_qkvz`, `lin_ba`, whose columns the
    converter put in this order)."""
    mm, hv, dv = cfg.matmul_backend, cfg.linear_v_heads, cfg.linear_v_dim
    if "lin_qkvz" in p:
        c = cfg.linear_conv_dim
        qkvz = project(h, p["lin_qkvz"], "te,ec->tc", backend=mm)  # [T, C + Hv * Dv]
        ba = project(h, p["lin_ba"], "te,eh->th", backend=mm)  # [T, 2 Hv]
        return qkvz[:, :c], qkvz[:, c:].reshape(-1, hv, dv), ba[:, :hv], ba[:, hv:]
    return (project(h, p["lin_qkv"], "te,ec->tc", backend=mm),  # [T, C]
            project(h, p["lin_z"], "te,ehd->thd", backend=mm),  # [T, Hv, Dv]
            project(h, p["lin_b"], "te,eh->th", backend=mm),
            project(h, p["lin_a"], "te,eh->th", backend=mm))


def _token_step(cfg: ModelConfig, conv_w: jax.Array):
    """The scan body: one token's conv and DeltaNet update on its row's states."""
    hk, dk = cfg.linear_k_heads, cfg.linear_k_dim
    hv, dv = cfg.linear_v_heads, cfg.linear_v_dim
    key_width = hk * dk

    def step(carry, xs):
        conv, ssm = carry  # [S, K-1, C], [S, Hv, Dk, Dv]
        x, g, beta, row, valid = xs  # [C], [Hv], [Hv], [], []
        window = jnp.concatenate([conv[row], x[None]], axis=0)  # [K, C] oldest first
        y = jax.nn.silu(jnp.sum(window * conv_w, axis=0))  # [C]
        q = _l2_normed(y[:key_width].reshape(hk, dk))
        k = _l2_normed(y[key_width:2 * key_width].reshape(hk, dk))
        v = y[2 * key_width:].reshape(hv, dv)
        q = jnp.repeat(q, hv // hk, axis=0) * (dk ** -0.5)  # [Hv, Dk]
        k = jnp.repeat(k, hv // hk, axis=0)
        state = ssm[row] * jnp.exp(g)[:, None, None]  # [Hv, Dk, Dv]
        delta = (v - jnp.einsum("hkv,hk->hv", state, k)) * beta[:, None]
        state = state + k[:, :, None] * delta[:, None, :]
        out = jnp.einsum("hkv,hk->hv", state, q)
        conv = conv.at[row].set(jnp.where(valid, window[1:], conv[row]))
        ssm = ssm.at[row].set(jnp.where(valid, state, ssm[row]))
        return (conv, ssm), out

    return step


def _l2_normed(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over each head's Dv (weight, no offset), then x silu(gate): [T, Hv, Dv] f32."""
    x = x.astype(jnp.float32)
    normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return weight.astype(jnp.float32) * normed * jax.nn.silu(gate.astype(jnp.float32))


NETWORK = Network(name="qwen3_5", param_specs=param_specs, forward=forward, logits=logits,
                  layer_keys=EVERY_LAYER_KEYS + ATTENTION_KEYS + LINEAR_KEYS,
                  layer_ordinals=layer_ordinals,
                  final_norm=final_norm)

conv_kernel = Transform(  # HF Conv1d [C, 1, K] -> [K, C]
    apply=lambda w, cfg: w[:, 0, :].T,
    source_index=lambda idx, d: ((idx[1], slice(None), idx[0]), ()),
    source_shape=lambda shape, d: (shape[1], 1, shape[0]),
)


def _weight_rules(cfg: ModelConfig) -> tuple[Rule, ...]:
    lin = LAYER + r"linear_attn\."
    return (
        (r"model\.embed_tokens\.weight", "embed", same),
        (r"model\.norm\.weight", "final_norm", same),
        (r"lm_head\.weight", "lm_head", transposed),
        (LAYER + r"input_layernorm\.weight", "attn_norm", same),
        (LAYER + r"post_attention_layernorm\.weight", "mlp_norm", same),
        (LAYER + r"mlp\.gate_proj\.weight", "w_gate", transposed),
        (LAYER + r"mlp\.up_proj\.weight", "w_up", transposed),
        (LAYER + r"mlp\.down_proj\.weight", "w_down", transposed),
        (LAYER + r"self_attn\.q_proj\.weight", "wqg", heads_of(2 * cfg.head_dim)),
        (LAYER + r"self_attn\.k_proj\.weight", "wk", heads_in),
        (LAYER + r"self_attn\.v_proj\.weight", "wv", heads_in),
        (LAYER + r"self_attn\.o_proj\.weight", "wo", o_in),
        (LAYER + r"self_attn\.q_norm\.weight", "q_norm", same),
        (LAYER + r"self_attn\.k_norm\.weight", "k_norm", same),
        (lin + r"in_proj_qkv\.weight", "lin_qkv", transposed),
        (lin + r"in_proj_z\.weight", "lin_z", heads_of(cfg.linear_v_dim)),
        (lin + r"in_proj_b\.weight", "lin_b", transposed),
        (lin + r"in_proj_a\.weight", "lin_a", transposed),
        (lin + r"conv1d\.weight", "lin_conv", conv_kernel),
        (lin + r"dt_bias", "lin_dt_bias", same),
        (lin + r"A_log", "lin_a_log", same),
        (lin + r"norm\.weight", "lin_norm", same),
        (lin + r"out_proj\.weight", "lin_out", o_heads_of(cfg.linear_v_dim)),
        (r"mtp\..*", (), same),  # the multi-token-prediction head: not run
        (r"model\.visual\..*", (), same),  # a multimodal checkpoint's vision tower
    )


def _fields(hf: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """The layer kinds and the linear layers' widths.

    Raises:
      ValueError: a layer type other than linear or full attention, or value heads that are
        not a multiple of the key heads.
    """
    n = fields["num_layers"]
    interval = int(hf.get("full_attention_interval", 4))
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    unknown = set(types) - {"linear_attention", "full_attention"}
    if unknown or len(types) != n:
        raise ValueError(f"{hf['model_type']} layer_types {sorted(unknown) or len(types)} "
                         "not supported (linear_attention / full_attention, one per layer)")
    hk, hv = int(hf["linear_num_key_heads"]), int(hf["linear_num_value_heads"])
    if hv % hk:
        raise ValueError(f"linear value heads {hv} are not a multiple of the key heads {hk}")
    rope = hf.get("rope_parameters") or {}
    return {
        "linear_layers": tuple(t == "linear_attention" for t in types),
        "linear_conv_kernel": int(hf.get("linear_conv_kernel_dim", 4)),
        "linear_k_heads": hk, "linear_v_heads": hv,
        "linear_k_dim": int(hf["linear_key_head_dim"]),
        "linear_v_dim": int(hf["linear_value_head_dim"]),
        "attn_output_gate": True, "qk_norm": True,
        "partial_rotary_factor": float(rope.get("partial_rotary_factor",
                                                hf.get("partial_rotary_factor", 0.25))),
    }


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Qwen3.5 checkpoint's text model."""
    if "text_config" not in hf:
        return hf
    text = {**hf["text_config"], "model_type": "qwen3_5_text"}
    if "tie_word_embeddings" in hf:
        text.setdefault("tie_word_embeddings", hf["tie_word_embeddings"])
    return text


QWEN3_5 = Family(
    name="qwen3_5",
    network=NETWORK,
    model_types=(
        ModelType(name="qwen3_5_text", features="hybrid: Gated DeltaNet linear-attention "
                  "layers (recurrent state per sequence) with gated full-attention layers "
                  "(q/k norm, partial rotary)", parity_test="test_qwen3_5_logits_match_hf"),
        ModelType(name="qwen3_5", features="the text model of a Qwen3.5 checkpoint (as "
                  "`qwen3_5_text`)"),
    ),
    unwrap_hf=_text_config,
    hf_fields=_fields,
    hf_weights_for=_weight_rules,
)
