"""LoRA adapters inside the step: which projections take one, and the batched low-rank update.

Adapters sit in fixed device slots: per layer and projection, `a` [I, N, R] and `b` [N, R, O]
(I, O: the projection's input and output, flattened; N = max_loras slots, or the W a narrow step
gathers (`jengine.runtime.lora_slots`); R = max_lora_rank; a
smaller rank is zero-padded, and b holds the adapter's scale, alpha / r or rsLoRA's
alpha / sqrt(r), folded in on the host). Each token carries its slot
(`AttentionMetadata.lora_slots`, -1: no adapter). The update is two plain 2-D dots over all
slots, [T, I] x [I, N*R] and [T, N*R] x [N*R, O], with a one-hot of the token's slot between
them, as tpu-inference and sglang-jax do it: fixed shapes, no gather of per-token weights, no
custom kernel. Every reshape is free (row-major), so XLA runs two GEMMs, no transposes. The
base projection keeps its own kernel; the delta is its own small dot beside it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jengine.models.layers import ParamSpec

# The projections an adapter may target (jengine's names): attention and the dense MLP.
TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def target_shapes(specs: dict[str, ParamSpec]) -> dict[str, tuple[tuple[int, ...],
                                                                   tuple[int, ...]]]:
    """(input dims, output dims) per layer of every target projection the model has, read from
    its declared weights: the dims a projection contracts are its input (`ParamSpec.contract`,
    counted with the leading layer axis)."""
    shapes = {}
    for name in TARGETS:
        spec = specs.get(name)
        if spec is None:
            continue
        ins = tuple(spec.shape[i] for i in spec.contract)
        outs = tuple(n for i, n in enumerate(spec.shape) if i and i not in spec.contract)
        shapes[name] = (ins, outs)
    return shapes


def slot_axes(specs: dict[str, ParamSpec], name: str) -> tuple[tuple, tuple]:
    """Logical axes of a target's `a` [I, N, R] and `b` [N, R, O] (for tp sharding: `a`
    splits like the base weight's input, `b` like its output; a flattened heads x head_dim
    axis splits by heads, its leading part)."""
    spec = specs[name]
    ins = [spec.axes[i] for i in spec.contract]
    outs = [ax for i, ax in enumerate(spec.axes) if i and i not in spec.contract]
    return (ins[0], None, None), (None, None, outs[0])


def add_delta(y: jax.Array, x: jax.Array, lora: dict | None, name: str,
              slots: jax.Array | None) -> jax.Array:
    """`y` (the base projection of `x`) plus each token's adapter update.

    Args:
      y: [T, *out] the base projection's output.
      x: [T, *in] its input.
      lora: this layer's slots, {target: {"a": [I, N, R], "b": [N, R, O]}}, or None in a
        step without adapters (then `y` is returned as it is).
      name: the target (`TARGETS`).
      slots: [T] int32 each token's slot, -1 for none (its one-hot row is all zeros).
    """
    if lora is None or name not in lora or slots is None:
        return y
    a, b = lora[name]["a"], lora[name]["b"]
    (i, n, r), t = a.shape, x.shape[0]
    with jax.named_scope("lora"):
        pick = jax.nn.one_hot(slots, n, dtype=a.dtype)  # [T, N]
        xa = jnp.dot(x.reshape(t, i).astype(a.dtype), a.reshape(i, n * r),
                     preferred_element_type=jnp.float32).astype(a.dtype)  # [T, N*R]
        xa = (xa.reshape(t, n, r) * pick[:, :, None]).reshape(t, n * r)
        delta = jnp.dot(xa, b.reshape(n * r, -1), preferred_element_type=jnp.float32)
    return y + delta.reshape(y.shape).astype(y.dtype)
