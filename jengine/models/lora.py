"""LoRA adapters inside the step: which projections take one, and the batched low-rank update.

Adapters sit in fixed device slots: per layer and projection, `a` [N, *in, R] and `b`
[N, R, *out] (N = max_loras slots, R = max_lora_rank; a smaller rank is zero-padded, and b
holds the adapter's scale, alpha / r or rsLoRA's alpha / sqrt(r), folded in on the host). Each
token carries its slot (`AttentionMetadata.lora_slots`, -1: no adapter). The update is two
einsums over all slots with a one-hot of the token's slot between them, as tpu-inference and
sglang-jax do it: fixed shapes, no gather of per-token weights, no custom kernel. The base
projection keeps its own kernel; the delta is its own small dot beside it.
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


def slot_axes(specs: dict[str, ParamSpec], name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Logical axes of a target's `a` [N, *in, R] and `b` [N, R, *out] (for tp sharding: `a`
    splits like the base weight's input, `b` like its output)."""
    spec = specs[name]
    ins = tuple(spec.axes[i] for i in spec.contract)
    outs = tuple(ax for i, ax in enumerate(spec.axes) if i and i not in spec.contract)
    return (None, *ins, None), (None, None, *outs)


def add_delta(y: jax.Array, x: jax.Array, lora: dict | None, name: str,
              slots: jax.Array | None) -> jax.Array:
    """`y` (the base projection of `x`) plus each token's adapter update.

    Args:
      y: [T, *out] the base projection's output.
      x: [T, *in] its input.
      lora: this layer's slots, {target: {"a": [N, *in, R], "b": [N, R, *out]}}, or None
        in a step without adapters (then `y` is returned as it is).
      name: the target (`TARGETS`).
      slots: [T] int32 each token's slot, -1 for none (its one-hot row is all zeros).
    """
    if lora is None or name not in lora or slots is None:
        return y
    a, b = lora[name]["a"], lora[name]["b"]
    ins = "ijk"[: x.ndim - 1]
    outs = "xyz"[: y.ndim - 1]
    with jax.named_scope("lora"):
        pick = jax.nn.one_hot(slots, a.shape[0], dtype=a.dtype)  # [T, N]
        xa = jnp.einsum(f"t{ins},n{ins}r->tnr", x.astype(a.dtype), a)  # [T, N, R]
        delta = jnp.einsum(f"tnr,nr{outs}->t{outs}", xa * pick[:, :, None], b)  # [T, *out]
    return y + delta.astype(y.dtype)
