"""Ragged paged attention backends behind one signature.

`reference` is pure JAX (the oracle the kernels are tested against); `cpu` is a native C++
kernel through `jax.ffi` (its FFI targets are registered when this package is imported);
`pallas_tpu` (Mosaic, pages streamed from HBM with double-buffered DMAs) and `pallas_gpu`
(Triton, split-K) share its signature. `attention_fn(backend, platform)` picks one. This package
imports only jax and numpy (and loads the native library with ctypes); the two Pallas kernels
(and Pallas itself) are imported when first named, so a CPU engine never imports them.
"""

from __future__ import annotations

import importlib
from typing import Any

from jengine.pallas_kernels.backends import (
    BACKENDS,
    attention_fn,
    resolve_backend,
    shard_for_context_mesh,
    shard_over_heads,
    shard_write_for_context_mesh,
)
from jengine.pallas_kernels.block_layout import num_query_blocks
from jengine.pallas_kernels.cpu import ragged_paged_attention_cpu, untouched_zeros, write_kv_cpu
from jengine.pallas_kernels.cpu_matmul import small_matmul
from jengine.pallas_kernels.kv_quant import KV_FP8, KV_INT8, is_quantized, quantize_rows
from jengine.pallas_kernels.reference import (
    blocked_paged_attention,
    query_blocks,
    ragged_paged_attention,
    write_kv,
)

_LAZY = {
    "ragged_paged_attention_gpu": "jengine.pallas_kernels.gpu",
    "ragged_paged_attention_tpu": "jengine.pallas_kernels.tpu",
}

__all__ = [
    "BACKENDS",
    "KV_FP8",
    "KV_INT8",
    "attention_fn",
    "blocked_paged_attention",
    "is_quantized",
    "num_query_blocks",
    "query_blocks",
    "quantize_rows",
    "ragged_paged_attention",
    "ragged_paged_attention_cpu",
    "ragged_paged_attention_gpu",
    "ragged_paged_attention_tpu",
    "resolve_backend",
    "shard_for_context_mesh",
    "small_matmul",
    "shard_over_heads",
    "shard_write_for_context_mesh",
    "untouched_zeros",
    "write_kv",
    "write_kv_cpu",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jengine.pallas_kernels' has no attribute {name!r}")
