"""The native RMSNorm on CPU (`csrc/rms_norm.cc`): `layers.rms_norm` in one call per norm, each
row's sum of squares in one fixed order whatever the batch (batch-invariant, like the native
matmuls), where XLA:CPU runs an order-fixed tree of small fusions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jengine import cpu_info
from jengine.cpu_kernels import library
from jengine.cpu_kernels.matmul import require


def supports(isa: str) -> bool:
    """Whether this CPU runs the kernel's `isa` path."""
    require()
    return bool(library.runs("rms_norm", isa))


def best_isa() -> str:
    """The instruction set `isa="auto"` runs here (of those `cpu_info.flags()` allows)."""
    require()
    return cpu_info.best_vector_isa(supports)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0, *,
             isa: str = "auto") -> jax.Array:
    """`layers.rms_norm` of x [..., E] (float32 or bfloat16) by the native kernel
    (csrc/rms_norm.cc): each row's sum of squares in one fixed order, whatever the batch, in
    one call instead of XLA's order-fixed tree of small fusions. The result's dtype is
    `layers.rms_norm`'s: x's with an `offset`, else the promotion of weight and x."""
    require()
    if x.dtype not in (jnp.float32, jnp.bfloat16) or weight.dtype not in (jnp.float32,
                                                                          jnp.bfloat16):
        raise ValueError(f"rms_norm takes float32 or bfloat16, got {x.dtype} and {weight.dtype}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm's weight must be [{x.shape[-1]}], got {weight.shape}")
    out = x.dtype if offset else jnp.result_type(weight, x)
    rows = x.reshape(-1, x.shape[-1])
    call = jax.ffi.ffi_call(library.target("jengine_rms_norm"),
                            jax.ShapeDtypeStruct(rows.shape, out))
    y = call(rows, weight, eps=np.float32(eps), offset=np.float32(offset),
             isa=np.int32(library.isa_code("rms_norm", best_isa() if isa == "auto" else isa)))
    return y.reshape(x.shape)
