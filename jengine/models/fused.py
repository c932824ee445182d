"""Fused projections: each layer's q, k and v weights as one `w_qkv`, its gate and up weights
as one `w_gate_up`, so a decode step runs one GEMM where it ran three (or two).

At 8-256 rows a GEMM is bound by reading its weight and by launching it; on a GPU three
launches over narrow weights (Llama-3-8B: q 4096 wide, k and v 1,024 each) use the memory
system worse than one over their concatenation. XLA:CPU's small dots run side by side on the
host's cores instead (`jengine.models.matmul`), so the CPU keeps its separate weights.

Sharding-aware: the fused weight keeps a shard axis, `w_qkv [E, tp, G, D]` (G = one shard's q
heads, then its k heads, then its v heads) and `w_gate_up [E, tp, 2, F / tp]`, split over `tp`
(1 without a mesh). Each device so holds exactly the q, k, v (gate, up) columns it held before,
the split after the GEMM is local, the activations come out sharded as the separate
projections' did, and the forward reads tp from the weight's shape.

Only per-layer (`unstacked`) float weights without biases, adapters or replicated kv heads are
fused (`can_fuse`); anything else keeps its separate weights, which the forward reads as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jengine.models.config import ModelConfig
from jengine.models.family import Network

QKV = ("wq", "wk", "wv")
GATE_UP = ("w_gate", "w_up")
BIASES = ("bq", "bk", "bv", "b_gate", "b_up")
_FLOAT = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def can_fuse(params: dict, cfg: ModelConfig, network: Network) -> bool:
    """Whether `fuse_projections` applies: a forward that reads fused weights, per-layer
    weights, plain float arrays, no bias on the fused projections, kv heads split (not
    replicated) over tp, no MoE layers. (LoRA adapters, added to the layers at step time, are
    the caller's to rule out.)"""
    layers = params.get("layers")
    if (not network.fused_projections or not layers or cfg.kv_head_map is not None
            or cfg.num_experts):
        return False
    for p in layers:
        if any(name in p for name in BIASES) or "lora" in p:
            return False
        for name in QKV + GATE_UP:
            w = p.get(name)
            if not isinstance(w, jax.Array) or w.dtype not in _FLOAT:
                return False
    return True


def fuse_projections(params: dict, cfg: ModelConfig) -> dict:
    """`params` with each layer's q/k/v and gate/up weights replaced by their fused forms,
    placed on the separate weights' mesh (one device: no sharding). The separate arrays are
    freed as each layer is fused, so loading peaks at one layer's extra copy."""
    layers = []
    for p in params["layers"]:
        p = dict(p)
        tp = _tp(p["wq"])
        p["w_qkv"] = _fused_qkv(tp)(p["wq"], p["wk"], p["wv"])
        p["w_gate_up"] = _fused_gate_up(tp)(p["w_gate"], p["w_up"])
        for name in QKV + GATE_UP:
            p.pop(name).delete()
        layers.append(p)
    return {**params, "layers": tuple(layers)}


def _split_axis(w: jax.Array) -> str | None:
    """The mesh axis a separate weight's output axis (its second, after the embedding) is
    split over, or None."""
    sharding = w.sharding
    if not isinstance(sharding, NamedSharding) or len(sharding.spec) < 2:
        return None
    return sharding.spec[1]


def _tp(w: jax.Array) -> int:
    axis = _split_axis(w)
    return 1 if axis is None else w.sharding.mesh.shape[axis]


def _out_sharding(like: jax.Array) -> NamedSharding | None:
    """The fused weight's sharding: its shard axis (1) split as `like`'s output axis was."""
    axis = _split_axis(like)
    return None if axis is None else NamedSharding(like.sharding.mesh, PartitionSpec(None, axis))


def _fused_qkv(tp: int):
    def fuse(wq, wk, wv):  # [E, H, D], [E, K, D], [E, K, D] -> [E, tp, (H + 2K) / tp, D]
        e, d = wq.shape[0], wq.shape[-1]
        parts = [w.reshape(e, tp, w.shape[1] // tp, d) for w in (wq, wk, wv)]
        return jnp.concatenate(parts, axis=2)

    def run(wq, wk, wv):
        return jax.jit(fuse, out_shardings=_out_sharding(wq))(wq, wk, wv)
    return run


def _fused_gate_up(tp: int):
    def fuse(gate, up):  # [E, F], [E, F] -> [E, tp, 2, F / tp]
        e, f = gate.shape
        return jnp.stack([w.reshape(e, tp, f // tp) for w in (gate, up)], axis=2)

    def run(gate, up):
        return jax.jit(fuse, out_shardings=_out_sharding(gate))(gate, up)
    return run


def split_qkv(y: jax.Array, num_heads: int,
              num_kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[T, tp, G, D] fused projections -> q [T, H, D], k [T, K, D], v [T, K, D] (each
    shard's own heads, in the separate projections' order)."""
    t, tp, _, d = y.shape
    h, k = num_heads // tp, num_kv_heads // tp
    q, kk, v = y[:, :, :h], y[:, :, h:h + k], y[:, :, h + k:]
    return q.reshape(t, -1, d), kk.reshape(t, -1, d), v.reshape(t, -1, d)


def split_gate_up(y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[T, tp, 2, F / tp] fused gate/up products -> gate [T, F], up [T, F]."""
    t = y.shape[0]
    return y[:, :, 0].reshape(t, -1), y[:, :, 1].reshape(t, -1)
