"""llama.cpp's tensor layouts turned back into HF's, as pure array transforms (`gguf_file`
applies them while it reads): q/k rows permuted for interleaved rope, DeepSeek-V2's kv_b split
into per-head halves.
"""

from __future__ import annotations

import numpy as np

from converters.errors import ModelLoadError


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """DeepSeek-V2's kv_b_proj [H * (N + V), C] from llama.cpp's per-head halves: k_b
    [H, C, N] (transposed for the absorbed q) and v_b [H, V, C]."""
    heads, latent = k_b.shape[0], k_b.shape[1]
    if v_b.shape[0] != heads or v_b.shape[2] != latent:
        raise ModelLoadError(f"attn_k_b {k_b.shape} and attn_v_b {v_b.shape} do not pair")
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, latent)


def unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation (interleaved rope pairs -> HF's halves)."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )
