"""Ragged paged attention backends behind one signature.

`reference` is pure JAX (the CPU path and the oracle the kernels are tested against); the Pallas
TPU (Mosaic) and GPU (Triton) kernels plug in beside it. This package imports only jax and numpy.
"""

from jengine.pallas_kernels.reference import (
    blocked_paged_attention,
    query_blocks,
    ragged_paged_attention,
    write_kv,
)

__all__ = ["blocked_paged_attention", "query_blocks", "ragged_paged_attention", "write_kv"]
