"""Ragged paged attention backends behind one signature, each an `AttentionBackend` record.

`reference` is pure JAX (the oracle the kernels are tested against); `pallas_tpu` (Mosaic, pages
streamed from HBM with double-buffered DMAs) and `pallas_gpu` (Triton, split-K) share its
signature, and so does `cpu`, the native C++ kernel of `jengine.cpu_kernels.attention` (its FFI
targets are registered when that package loads). `attention_fn(backend, platform)` picks one.
This package imports only jax and numpy (and the native kernels' package); the two Pallas
kernels (and Pallas itself) are imported when first named, so a CPU engine never imports them.
The KV cache's quantized rows (`kv_quant`) and the query blocks (`block_layout`) every backend
reads live here too.
"""

from __future__ import annotations

import importlib
from typing import Any

from jengine.pallas_kernels.backends import (
    ATTENTION_BACKENDS,
    BACKENDS,
    AttentionBackend,
    attention_fn,
    resolve_backend,
    shard_for_context_mesh,
    shard_over_heads,
    shard_write_for_context_mesh,
)
from jengine.pallas_kernels.block_layout import num_query_blocks
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
    "ATTENTION_BACKENDS",
    "BACKENDS",
    "AttentionBackend",
    "KV_FP8",
    "KV_INT8",
    "attention_fn",
    "blocked_paged_attention",
    "is_quantized",
    "num_query_blocks",
    "query_blocks",
    "quantize_rows",
    "ragged_paged_attention",
    "ragged_paged_attention_gpu",
    "ragged_paged_attention_tpu",
    "resolve_backend",
    "shard_for_context_mesh",
    "shard_over_heads",
    "shard_write_for_context_mesh",
    "write_kv",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jengine.pallas_kernels' has no attribute {name!r}")
