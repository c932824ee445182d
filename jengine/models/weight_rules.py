"""Weight rules: how an HF checkpoint key becomes a jengine param, as plain data the
converters apply (`converters.tables`). A family's record (`jengine.models.family.Family`)
lists its rules; the transforms and the rules every Llama-shaped checkpoint shares are here.

HF stores projections as torch Linear weights `[out, in]`; jengine stores them input-first with
heads split out (`wq: [L, E, H, D]`), stacked over layers. Every transform also says which HF
slice a slice of its result needs, so that sharded loading reads only that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jengine.models.config import ModelConfig

Index = tuple[slice, ...]


@dataclasses.dataclass(frozen=True)
class Transform:
    """HF tensor -> jengine layout, and which HF slice a slice of the result comes from.

    `apply` takes the whole HF tensor or any slice of it cut by `source_index` (its reshapes
    count heads from the data, never from the config), so a sharded loader can read and
    transform one device's slice alone: `apply(read(src), cfg)[post] == apply(whole, cfg)[index]`
    for `src, post = source_index(index, cfg.head_dim)`.
    """

    apply: Callable[[np.ndarray, ModelConfig], np.ndarray]
    # jengine index (one slice per per-layer dim) -> (HF index to read, index into the result)
    source_index: Callable[[Index, int], tuple[Index, Index]]
    # jengine per-layer shape -> the HF shape it must come from
    source_shape: Callable[[tuple[int, ...], int], tuple[int, ...]]
    # The HF axis along which a fused tensor stacks the params it feeds (Phi-3's qkv_proj: 0,
    # its output rows; Granite-MoE's input_linear [X, 2F, E]: 1).
    split_axis: int = 0

    def __call__(self, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
        return self.apply(w, cfg)


_ALL = slice(None)


def _rows(heads: slice, head_dim: int) -> slice:
    """Heads h0:h1 -> rows h0*D:h1*D of an HF [H*D, ...] projection."""
    start = None if heads.start is None else heads.start * head_dim
    stop = None if heads.stop is None else heads.stop * head_dim
    return slice(start, stop)


same = Transform(
    apply=lambda w, cfg: w,
    source_index=lambda idx, d: (idx, ()),
    source_shape=lambda shape, d: shape,
)
transposed = Transform(  # [out, in] -> [in, out]
    apply=lambda w, cfg: w.T,
    source_index=lambda idx, d: ((idx[1], idx[0]), ()),
    source_shape=lambda shape, d: (shape[1], shape[0]),
)
heads_in = Transform(  # q/k/v [H*D, E] -> [E, H, D]
    apply=lambda w, cfg: w.T.reshape(w.shape[1], -1, cfg.head_dim),
    source_index=lambda idx, d: ((_rows(idx[1], d), idx[0]), (_ALL, _ALL, idx[2])),
    source_shape=lambda shape, d: (shape[1] * shape[2], shape[0]),
)
heads_bias = Transform(  # [H*D] -> [H, D]
    apply=lambda w, cfg: w.reshape(-1, cfg.head_dim),
    source_index=lambda idx, d: ((_rows(idx[0], d),), (_ALL, idx[1])),
    source_shape=lambda shape, d: (shape[0] * shape[1],),
)
experts_t = Transform(  # all experts of a layer in one tensor: [X, out, in] -> [X, in, out]
    apply=lambda w, cfg: np.swapaxes(w, 1, 2),
    source_index=lambda idx, d: ((idx[0], idx[2], idx[1]), ()),
    source_shape=lambda shape, d: (shape[0], shape[2], shape[1]),
)
experts_fused_t = dataclasses.replace(experts_t, split_axis=1)  # [X, 2F, E] -> 2 x [X, E, F]
single_row = Transform(  # [1, E] -> [E] (a Linear with one output)
    apply=lambda w, cfg: w[0],
    source_index=lambda idx, d: ((_ALL, idx[0]), ()),
    source_shape=lambda shape, d: (1, shape[0]),
)
o_in = Transform(  # [E, H*D] -> [H, D, E]
    apply=lambda w, cfg: w.T.reshape(-1, cfg.head_dim, w.shape[0]),
    source_index=lambda idx, d: ((idx[2], _rows(idx[0], d)), (_ALL, idx[1], _ALL)),
    source_shape=lambda shape, d: (shape[2], shape[0] * shape[1]),
)


LAYER = r"model\.layers\.(\d+)\."
EXPERT = r"\.experts\.(\d+)\."  # the second group: an expert index (layer, expert)

# (HF key pattern, param name(s), transform). Groups in the pattern index the param's leading
# axes: the layer, then (MoE) the expert. Several names split one HF tensor along the
# transform's `split_axis` (its output axis) into consecutive blocks, one per param, each as
# wide as that param's spec needs (Phi-3's qkv_proj -> wq, wk, wv); the whole tensor's shape
# is asserted.
Rule = tuple[str, str | tuple[str, ...], Transform]

COMMON: tuple[Rule, ...] = (
    (r"model\.embed_tokens\.weight", "embed", same),
    (r"model\.norm\.weight", "final_norm", same),
    (LAYER + r"input_layernorm\.weight", "attn_norm", same),
    (LAYER + r"self_attn\.q_proj\.weight", "wq", heads_in),
    (LAYER + r"self_attn\.k_proj\.weight", "wk", heads_in),
    (LAYER + r"self_attn\.v_proj\.weight", "wv", heads_in),
    (LAYER + r"self_attn\.o_proj\.weight", "wo", o_in),
    (LAYER + r"mlp\.gate_proj\.weight", "w_gate", transposed),
    (LAYER + r"mlp\.up_proj\.weight", "w_up", transposed),
    (LAYER + r"mlp\.down_proj\.weight", "w_down", transposed),
)


def heads_of(width: int) -> Transform:
    """[H*W, In] -> [In, H, W] for heads of a fixed width W other than the config's head_dim
    (DeepSeek's q heads are qk_nope + qk_rope wide, its kv_b_proj heads qk_nope + v)."""
    return Transform(
        apply=lambda w, cfg: w.T.reshape(w.shape[1], -1, width),
        source_index=lambda idx, d: ((_rows(idx[1], width), idx[0]), (_ALL, _ALL, idx[2])),
        source_shape=lambda shape, d: (shape[1] * shape[2], shape[0]),
    )


def o_heads_of(width: int) -> Transform:
    """o_proj [E, H*W] -> [H, W, E] for value heads W wide (DeepSeek's v_head_dim)."""
    return Transform(
        apply=lambda w, cfg: w.T.reshape(-1, width, w.shape[0]),
        source_index=lambda idx, d: ((idx[2], _rows(idx[0], width)), (_ALL, idx[1], _ALL)),
        source_shape=lambda shape, d: (shape[2], shape[0] * shape[1]),
    )


def mtp_layers_skipped(cfg) -> tuple[Rule, ...]:
    """Rules that skip the multi-token-prediction layers DeepSeek-V3 and GLM-4.5 checkpoints
    carry after their last layer (`num_nextn_predict_layers`): jengine does not run them (a
    speculative draft they could be), and a rule naming no param skips a weight."""
    return tuple((rf"model\.layers\.{cfg.num_layers + i}\..*", (), same)
                 for i in range(cfg.mtp_layers))
