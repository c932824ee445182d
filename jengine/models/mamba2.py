"""The Mamba2 mixer (state-space duality) of the Mamba2 hybrids: Granite 4
(`granitemoehybrid`, models/granite4.py) and Nemotron-H (`nemotron_h`, models/nemotron_h.py).

A token's in_proj gives a gate z [I], the conv input xBC [C] and a time step dt per head [H]
(I = H * P, C = I + 2 * G * N: x, then B and C of the G groups, N = d_state). xBC goes through
a causal depthwise conv (K taps, + bias) and SiLU; dt becomes softplus(dt + dt_bias), clamped
to `mamba_dt_limit` where one is set. Per head h (its group h // (H / G)) the state
S [N, P] evolves and is read as

    S <- S * exp(dt * A) + dt * B x^T;   y = S^T C + D * x,   A = -exp(A_log)

then y * silu(z) is RMS-normed over each of the G groups of I / G channels (weight, no
offset) and out_proj'd back to [E]. This is HF's recurrent form; its chunked form (SSD, for
prefill) computes the same sums in another order, so prefill parity holds to f32 rounding.

The state lives in the same arrays as Qwen3.5's Gated DeltaNet (`KVCache.conv` [Ll, 1, N,
K-1, C] and `.ssm` [Ll, Hv, N, Dk, Dv], one slot per running sequence), the config's linear
widths read as Dk = N, Dv = P, Hv = H, Hk = G (`ModelConfig.linear_mixer`): one state layout,
so whatever saves, restores or budgets those arrays covers Mamba2 too. The scan runs token by
token over the step's tokens (`lax.scan`, Qwen3.5's rows and rules: a row at position 0
starts from zeros, others continue their slot, padding tokens change nothing), one program for
prefill chunks and decodes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jengine.models.attention import AttentionMetadata, KVCache
from jengine.models.config import ModelConfig
from jengine.models.layers import ParamSpec, project
from jengine.models.qwen3_5 import _RowStates, conv_kernel
from jengine.models.weight_rules import Rule, same, transposed

MIXER_KEYS = ("m_z", "m_xbc", "m_dt", "m_conv", "m_conv_bias", "m_dt_bias", "m_a_log", "m_d",
              "m_norm", "m_out")


def mixer_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """The Mamba2 weights, stacked over the mixer layers (replicated under tp)."""
    nl, e, h, c = cfg.num_linear_layers, cfg.hidden_size, cfg.linear_v_heads, cfg.linear_conv_dim
    inner = h * cfg.linear_v_dim
    specs = {
        # in_proj split three ways: the gate z, the conv input xBC, the time step dt.
        "m_z": ParamSpec((nl, e, inner), ("layers", "embed", "linear_inner")),
        "m_xbc": ParamSpec((nl, e, c), ("layers", "embed", "linear_conv")),
        "m_dt": ParamSpec((nl, e, h), ("layers", "embed", "linear_heads")),
        "m_conv": ParamSpec((nl, cfg.linear_conv_kernel, c),
                            ("layers", "linear_kernel", "linear_conv")),
        "m_dt_bias": ParamSpec((nl, h), ("layers", "linear_heads"), "ones"),
        "m_a_log": ParamSpec((nl, h), ("layers", "linear_heads"), "zeros"),
        "m_d": ParamSpec((nl, h), ("layers", "linear_heads"), "ones"),
        "m_norm": ParamSpec((nl, inner), ("layers", "linear_inner"), "ones"),
        "m_out": ParamSpec((nl, inner, e), ("layers", "linear_inner", "embed")),
    }
    if cfg.mamba_conv_bias:
        specs["m_conv_bias"] = ParamSpec((nl, c), ("layers", "linear_conv"), "zeros")
    return specs


def mixer_rules(prefix: str) -> tuple[Rule, ...]:
    """HF's Mamba2 weights under `prefix` (a layer pattern ending in the mixer's name)."""
    return (
        (prefix + r"in_proj\.weight", ("m_z", "m_xbc", "m_dt"), transposed),
        (prefix + r"conv1d\.weight", "m_conv", conv_kernel),
        (prefix + r"conv1d\.bias", "m_conv_bias", same),
        (prefix + r"dt_bias", "m_dt_bias", same),
        (prefix + r"A_log", "m_a_log", same),
        (prefix + r"D", "m_d", same),
        (prefix + r"norm\.weight", "m_norm", same),
        (prefix + r"out_proj\.weight", "m_out", transposed),
    )


def mamba2_fields(cfg_heads: int, head_dim: int, groups: int, state: int, kernel: int,
                  *, conv_bias: bool, proj_bias: bool, dt_limit) -> dict:
    """The ModelConfig fields of a Mamba2 mixer (the linear widths as the module docstring maps
    them).

    Raises:
      ValueError: heads not a multiple of the groups, or biased projections (no published
        Granite 4 / Nemotron-H checkpoint has them; not built).
    """
    if cfg_heads % groups:
        raise ValueError(f"Mamba2 heads {cfg_heads} are not a multiple of its groups {groups}")
    if proj_bias:
        raise ValueError("Mamba2 in_proj / out_proj biases are not supported")
    limit = tuple(_number(v) for v in dt_limit) if dt_limit is not None else None
    if limit is not None and limit[0] <= 0.0 and limit[1] == float("inf"):
        limit = None  # softplus is positive: (0, inf) clamps nothing
    return {"linear_mixer": "mamba2", "linear_conv_kernel": int(kernel),
            "linear_k_heads": int(groups), "linear_k_dim": int(state),
            "linear_v_heads": int(cfg_heads), "linear_v_dim": int(head_dim),
            "mamba_conv_bias": bool(conv_bias), "mamba_dt_limit": limit}


def _number(value) -> float:
    """A float as config.json holds it: a number, "Infinity", or transformers 5's
    {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


class States:
    """The step's rows' states of every Mamba2 layer, read once before the layers and written
    back once after them (a read and write per layer made XLA copy the whole arrays)."""

    def __init__(self, kv: KVCache, md: AttentionMetadata):
        self.rows = _RowStates.of(md, page_size=kv.k.shape[3], num_rows=md.page_table.shape[0])
        self.conv = self.rows.gather(kv.conv[:, 0])  # [Ll, S, K-1, C]
        self.ssm = self.rows.gather(kv.ssm, axis=2)  # [Ll, S, H, N, P]
        self.conv_out: list[jax.Array] = []
        self.ssm_out: list[jax.Array] = []

    def written(self, kv: KVCache) -> KVCache:
        """`kv` with every layer's new row states in their slots."""
        if not self.conv_out:
            return kv
        slots = self.rows.slots
        return dataclasses.replace(
            kv, conv=kv.conv.at[:, 0, slots].set(jnp.stack(self.conv_out)),
            ssm=kv.ssm.at[:, :, slots].set(jnp.moveaxis(jnp.stack(self.ssm_out), 1, 2)))


def mixer(h: jax.Array, p: dict[str, jax.Array], cfg: ModelConfig, states: States,
          index: int, md: AttentionMetadata, eps: float) -> jax.Array:
    """The Mamba2 mixer of linear layer `index`: [T, E] -> [T, E]; its rows' new states are
    appended to `states`."""
    mm = cfg.matmul_backend
    heads, width, groups = cfg.linear_v_heads, cfg.linear_v_dim, cfg.linear_k_heads
    z = project(h, p["m_z"], "te,ei->ti", backend=mm)  # [T, I]
    xbc = project(h, p["m_xbc"], "te,ec->tc", backend=mm).astype(jnp.float32)  # [T, C]
    dt = project(h, p["m_dt"], "te,eh->th", backend=mm).astype(jnp.float32)  # [T, H]
    dt = jax.nn.softplus(dt + p["m_dt_bias"].astype(jnp.float32))
    if cfg.mamba_dt_limit is not None:
        dt = jnp.clip(dt, *cfg.mamba_dt_limit)
    conv_w = p["m_conv"].astype(jnp.float32)  # [K, C]
    conv_b = (p["m_conv_bias"].astype(jnp.float32) if "m_conv_bias" in p
              else jnp.zeros(conv_w.shape[1:], jnp.float32))
    a = -jnp.exp(p["m_a_log"].astype(jnp.float32))  # [H]
    carry = (states.conv[index], states.ssm[index])
    (conv, ssm), y = jax.lax.scan(
        _token_step(cfg, conv_w, conv_b, a, p["m_d"].astype(jnp.float32)), carry,
        (xbc, dt, md.token_seq, states.rows.valid))  # y [T, H, P]
    states.conv_out.append(conv)
    states.ssm_out.append(ssm)
    y = y.reshape(-1, heads * width) * jax.nn.silu(z.astype(jnp.float32))
    grouped = y.reshape(y.shape[0], groups, -1)  # the gated norm, per group
    grouped = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, -1, keepdims=True) + eps)
    y = (p["m_norm"].astype(jnp.float32) * grouped.reshape(y.shape)).astype(h.dtype)
    return project(y, p["m_out"], "ti,ie->te", backend=mm)


def _token_step(cfg: ModelConfig, conv_w, conv_b, a, d):
    """The scan body: one token's conv and state update on its row's states."""
    heads, width = cfg.linear_v_heads, cfg.linear_v_dim
    groups, n = cfg.linear_k_heads, cfg.linear_k_dim
    inner = heads * width

    def step(carry, xs):
        conv, ssm = carry  # [S, K-1, C], [S, H, N, P]
        xbc, dt, row, valid = xs  # [C], [H], [], []
        window = jnp.concatenate([conv[row], xbc[None]], axis=0)  # [K, C] oldest first
        y = jax.nn.silu(jnp.sum(window * conv_w, axis=0) + conv_b)  # [C]
        x = y[:inner].reshape(heads, width)
        b = jnp.repeat(y[inner:inner + groups * n].reshape(groups, n), heads // groups, axis=0)
        c = jnp.repeat(y[inner + groups * n:].reshape(groups, n), heads // groups, axis=0)
        state = (ssm[row] * jnp.exp(dt * a)[:, None, None]
                 + (dt[:, None] * b)[:, :, None] * x[:, None, :])  # [H, N, P]
        out = jnp.einsum("hnp,hn->hp", state, c) + d[:, None] * x
        conv = conv.at[row].set(jnp.where(valid, window[1:], conv[row]))
        ssm = ssm.at[row].set(jnp.where(valid, state, ssm[row]))
        return (conv, ssm), out

    return step
