"""Building blocks shared by the model families: norms, rotary embeddings, parameter specs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jengine.models.config import RopeConfig


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One weight, declared once: shape, logical axis names and initializer.

    The NNX module, the abstract tree, the shardings and the checkpoint layout all derive from it.
    """

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str = "normal"  # normal | zeros | ones


class DeclaredModel(nnx.Module):
    """An NNX module whose parameters are exactly the given specs (flat: name -> nnx.Param)."""

    def __init__(self, specs: dict[str, ParamSpec], *, dtype, rngs: nnx.Rngs):
        for name, spec in specs.items():
            if spec.init == "zeros":
                value = jnp.zeros(spec.shape, dtype)
            elif spec.init == "ones":
                value = jnp.ones(spec.shape, dtype)
            else:
                value = 0.02 * jax.random.normal(rngs.params(), spec.shape, dtype)
            setattr(self, name, nnx.Param(value, sharding_names=spec.axes, eager_sharding=False))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, offset: float = 0.0) -> jax.Array:
    """RMSNorm in float32; Gemma scales by (1 + weight) (`offset=1`), Llama by weight."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """[D/2] inverse frequencies, with linear or llama3 scaling applied (as HF computes them)."""
    # float32 throughout, as HF computes it, so positions far out round the same way.
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv = np.float32(1.0) / (np.float32(rope.theta) ** exponent)
    if rope.rope_type == "freq_factors":
        inv = inv / np.asarray(rope.freq_factors, np.float32)
    elif rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates [T, H, D] by position, HF's rotate-half layout (first half / second half)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def project(x: jax.Array, w: jax.Array, eq: str, bias: jax.Array | None = None) -> jax.Array:
    """einsum projection with an optional bias, accumulating in float32."""
    y = jnp.einsum(eq, x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return y if bias is None else y + bias


Activation = Callable[[jax.Array], jax.Array]
