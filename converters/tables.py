"""HF checkpoint key -> jengine param, one table per family, with the transform each needs.

HF stores projections as torch Linear weights `[out, in]`; jengine stores them input-first with
heads split out (`wq: [L, E, H, D]`), stacked over layers. Every tensor's shape is asserted
against the model's `ParamSpec` before it is placed (`place`), and every transform also says
which HF slice a slice of its result needs, so that sharded loading reads only that.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

from converters.errors import ModelLoadError
from jengine.models import layer_offsets
from jengine.models.config import ModelConfig
from jengine.models.layers import ParamSpec

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


_same = Transform(
    apply=lambda w, cfg: w,
    source_index=lambda idx, d: (idx, ()),
    source_shape=lambda shape, d: shape,
)
_t = Transform(  # [out, in] -> [in, out]
    apply=lambda w, cfg: w.T,
    source_index=lambda idx, d: ((idx[1], idx[0]), ()),
    source_shape=lambda shape, d: (shape[1], shape[0]),
)
_heads_in = Transform(  # q/k/v [H*D, E] -> [E, H, D]
    apply=lambda w, cfg: w.T.reshape(w.shape[1], -1, cfg.head_dim),
    source_index=lambda idx, d: ((_rows(idx[1], d), idx[0]), (_ALL, _ALL, idx[2])),
    source_shape=lambda shape, d: (shape[1] * shape[2], shape[0]),
)
_heads_bias = Transform(  # [H*D] -> [H, D]
    apply=lambda w, cfg: w.reshape(-1, cfg.head_dim),
    source_index=lambda idx, d: ((_rows(idx[0], d),), (_ALL, idx[1])),
    source_shape=lambda shape, d: (shape[0] * shape[1],),
)
_experts_t = Transform(  # all experts of a layer in one tensor: [X, out, in] -> [X, in, out]
    apply=lambda w, cfg: np.swapaxes(w, 1, 2),
    source_index=lambda idx, d: ((idx[0], idx[2], idx[1]), ()),
    source_shape=lambda shape, d: (shape[0], shape[2], shape[1]),
)
_experts_fused_t = dataclasses.replace(_experts_t, split_axis=1)  # [X, 2F, E] -> 2 x [X, E, F]
_single_row = Transform(  # [1, E] -> [E] (a Linear with one output)
    apply=lambda w, cfg: w[0],
    source_index=lambda idx, d: ((_ALL, idx[0]), ()),
    source_shape=lambda shape, d: (1, shape[0]),
)
_o_in = Transform(  # [E, H*D] -> [H, D, E]
    apply=lambda w, cfg: w.T.reshape(-1, cfg.head_dim, w.shape[0]),
    source_index=lambda idx, d: ((idx[2], _rows(idx[0], d)), (_ALL, idx[1], _ALL)),
    source_shape=lambda shape, d: (shape[2], shape[0] * shape[1]),
)


_LAYER = r"model\.layers\.(\d+)\."
_EXPERT = r"\.experts\.(\d+)\."  # the second group: an expert index (layer, expert)

# (HF key pattern, param name(s), transform). Groups in the pattern index the param's leading
# axes: the layer, then (MoE) the expert. Several names split one HF tensor along the
# transform's `split_axis` (its output axis) into consecutive blocks, one per param, each as
# wide as that param's spec needs (Phi-3's qkv_proj -> wq, wk, wv); the whole tensor's shape
# is asserted.
Rule = tuple[str, str | tuple[str, ...], Transform]

_COMMON: list[Rule] = [
    (r"model\.embed_tokens\.weight", "embed", _same),
    (r"model\.norm\.weight", "final_norm", _same),
    (_LAYER + r"input_layernorm\.weight", "attn_norm", _same),
    (_LAYER + r"self_attn\.q_proj\.weight", "wq", _heads_in),
    (_LAYER + r"self_attn\.k_proj\.weight", "wk", _heads_in),
    (_LAYER + r"self_attn\.v_proj\.weight", "wv", _heads_in),
    (_LAYER + r"self_attn\.o_proj\.weight", "wo", _o_in),
    (_LAYER + r"mlp\.gate_proj\.weight", "w_gate", _t),
    (_LAYER + r"mlp\.up_proj\.weight", "w_up", _t),
    (_LAYER + r"mlp\.down_proj\.weight", "w_down", _t),
]

_POST_NORMS: list[Rule] = [
    (_LAYER + r"post_attention_layernorm\.weight", "post_attn_norm", _same),
]
_OLMO2: list[Rule] = _POST_NORMS + [
    (_LAYER + r"self_attn\.q_norm\.weight", "q_norm", _heads_bias),
    (_LAYER + r"self_attn\.k_norm\.weight", "k_norm", _heads_bias),
]

TABLES: dict[str, list[Rule]] = {
    "llama": _COMMON
    + [
        (r"lm_head\.weight", "lm_head", _t),
        (_LAYER + r"post_attention_layernorm\.weight", "mlp_norm", _same),
        (_LAYER + r"self_attn\.q_proj\.bias", "bq", _heads_bias),
        (_LAYER + r"self_attn\.k_proj\.bias", "bk", _heads_bias),
        (_LAYER + r"self_attn\.v_proj\.bias", "bv", _heads_bias),
        (_LAYER + r"self_attn\.o_proj\.bias", "bo", _same),
        (_LAYER + r"mlp\.gate_proj\.bias", "b_gate", _same),
        (_LAYER + r"mlp\.up_proj\.bias", "b_up", _same),
        (_LAYER + r"mlp\.down_proj\.bias", "b_down", _same),
        (_LAYER + r"self_attn\.q_norm\.weight", "q_norm", _same),
        (_LAYER + r"self_attn\.k_norm\.weight", "k_norm", _same),
        # Phi-3: fused projections.
        (_LAYER + r"self_attn\.qkv_proj\.weight", ("wq", "wk", "wv"), _heads_in),
        (_LAYER + r"mlp\.gate_up_proj\.weight", ("w_gate", "w_up"), _t),
        # OLMo 2: norms on the sub-layer outputs.
        (_LAYER + r"post_feedforward_layernorm\.weight", "post_mlp_norm", _same),
        # Mixtral's sparse MLP.
        (_LAYER + r"block_sparse_moe\.gate\.weight", "router", _t),
        (_LAYER + r"block_sparse_moe" + _EXPERT + r"w1\.weight", "we_gate", _t),
        (_LAYER + r"block_sparse_moe" + _EXPERT + r"w3\.weight", "we_up", _t),
        (_LAYER + r"block_sparse_moe" + _EXPERT + r"w2\.weight", "we_down", _t),
        # Qwen2-MoE's and Qwen3-MoE's.
        (_LAYER + r"mlp\.gate\.weight", "router", _t),
        (_LAYER + r"mlp" + _EXPERT + r"gate_proj\.weight", "we_gate", _t),
        (_LAYER + r"mlp" + _EXPERT + r"up_proj\.weight", "we_up", _t),
        (_LAYER + r"mlp" + _EXPERT + r"down_proj\.weight", "we_down", _t),
        # GGUF's (llama.cpp's) MoE layout: each weight of all a layer's experts in one tensor.
        (_LAYER + r"mlp\.experts\.gate_proj\.weight", "we_gate", _experts_t),
        (_LAYER + r"mlp\.experts\.up_proj\.weight", "we_up", _experts_t),
        (_LAYER + r"mlp\.experts\.down_proj\.weight", "we_down", _experts_t),
        # Granite-MoE's: all experts of a layer in one tensor, gate and up fused.
        (_LAYER + r"block_sparse_moe\.router\.layer\.weight", "router", _t),
        (_LAYER + r"block_sparse_moe\.input_linear\.weight", ("we_gate", "we_up"),
         _experts_fused_t),
        (_LAYER + r"block_sparse_moe\.output_linear\.weight", "we_down", _experts_t),
        # Qwen2-MoE's shared expert and its gate.
        (_LAYER + r"mlp\.shared_expert\.gate_proj\.weight", "ws_gate", _t),
        (_LAYER + r"mlp\.shared_expert\.up_proj\.weight", "ws_up", _t),
        (_LAYER + r"mlp\.shared_expert\.down_proj\.weight", "ws_down", _t),
        (_LAYER + r"mlp\.shared_expert_gate\.weight", "ws_router", _single_row),
    ],
    # OLMo 2 / 3 (by model type): the post_attention_layernorm normalises the attention
    # output, and the q/k norm weights span every head ([H*D] -> [H, D]). EXAONE 4 has the
    # post-norms with Qwen3's per-head q/k norms.
    "olmo2": _OLMO2,
    "olmo3": _OLMO2,
    "exaone4": _POST_NORMS,
    "gemma3": _COMMON
    + [
        (r"lm_head\.weight", "lm_head", _t),  # untied heads (`tie_word_embeddings: false`)
        (_LAYER + r"self_attn\.q_norm\.weight", "q_norm", _same),
        (_LAYER + r"self_attn\.k_norm\.weight", "k_norm", _same),
        (_LAYER + r"post_attention_layernorm\.weight", "post_attn_norm", _same),
        (_LAYER + r"pre_feedforward_layernorm\.weight", "pre_mlp_norm", _same),
        (_LAYER + r"post_feedforward_layernorm\.weight", "post_mlp_norm", _same),
    ],
}

# Wrappers some checkpoints put around the text model's keys.
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")
# Keys that carry nothing jengine needs (rotary caches, vision towers of multimodal checkpoints).
_IGNORED = re.compile(r".*(rotary_emb\.inv_freq|vision_tower|multi_modal_projector|vision_model).*")


def canonical_key(key: str) -> str:
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            rest = key[len(prefix):]
            return rest if rest.startswith("lm_head") else "model." + rest
    return key


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one HF tensor, or one block of it, goes in a jengine param."""

    name: str
    index: tuple[int, ...]  # leading indices into the param: (), (layer,) or (layer, expert)
    transform: Transform
    # The block this param takes of a fused tensor, along `transform.split_axis`.
    block: slice | None = None

    def convert(self, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
        """The whole HF tensor -> this param's value at `index`."""
        if self.block is not None:
            w = w[(_ALL,) * self.transform.split_axis + (self.block,)]
        return self.transform(w, cfg)

    def source_index(self, index: Index, head_dim: int) -> tuple[Index, Index]:
        """`Transform.source_index`, with the block's offset added on the split axis."""
        src, post = self.transform.source_index(index, head_dim)
        if self.block is None:
            return src, post
        axis = self.transform.split_axis
        cut = src[axis]
        start = self.block.start + (cut.start or 0)
        stop = self.block.stop if cut.stop is None else self.block.start + cut.stop
        return src[:axis] + (slice(start, stop),) + tuple(src[axis + 1:]), post


def _heads_of(width: int) -> Transform:
    """[H*W, In] -> [In, H, W] for heads of a fixed width W other than the config's head_dim
    (DeepSeek's q heads are qk_nope + qk_rope wide, its kv_b_proj heads qk_nope + v)."""
    return Transform(
        apply=lambda w, cfg: w.T.reshape(w.shape[1], -1, width),
        source_index=lambda idx, d: ((_rows(idx[1], width), idx[0]), (_ALL, _ALL, idx[2])),
        source_shape=lambda shape, d: (shape[1] * shape[2], shape[0]),
    )


def _o_heads_of(width: int) -> Transform:
    """o_proj [E, H*W] -> [H, W, E] for value heads W wide (DeepSeek's v_head_dim)."""
    return Transform(
        apply=lambda w, cfg: w.T.reshape(-1, width, w.shape[0]),
        source_index=lambda idx, d: ((idx[2], _rows(idx[0], width)), (_ALL, idx[1], _ALL)),
        source_shape=lambda shape, d: (shape[2], shape[0] * shape[1]),
    )


def _latent_attention_rules(cfg: ModelConfig) -> list[Rule]:
    """DeepSeek-V2's table (its head widths differ from the cache's `head_dim`, so the
    transforms are built for the config). The MoE weights' layer index counts from the first
    MoE layer (`jengine.models.layer_offsets`, applied by `lookup`)."""
    qk = _heads_of(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    attn = _LAYER + r"self_attn\."
    mlp = _LAYER + r"mlp\."
    return [
        (r"model\.embed_tokens\.weight", "embed", _same),
        (r"model\.norm\.weight", "final_norm", _same),
        (r"lm_head\.weight", "lm_head", _t),
        (_LAYER + r"input_layernorm\.weight", "attn_norm", _same),
        (_LAYER + r"post_attention_layernorm\.weight", "mlp_norm", _same),
        (attn + r"q_proj\.weight", "wq", qk),
        (attn + r"q_a_proj\.weight", "wq_a", _t),
        (attn + r"q_a_layernorm\.weight", "q_a_norm", _same),
        (attn + r"q_b_proj\.weight", "wq_b", qk),
        (attn + r"kv_a_proj_with_mqa\.weight", "wkv_a", _t),
        (attn + r"kv_a_layernorm\.weight", "kv_a_norm", _same),
        (attn + r"kv_b_proj\.weight", "wkv_b", _heads_of(cfg.qk_nope_head_dim + cfg.v_head_dim)),
        (attn + r"o_proj\.weight", "wo", _o_heads_of(cfg.v_head_dim)),
        (mlp + r"gate_proj\.weight", "w_gate", _t),
        (mlp + r"up_proj\.weight", "w_up", _t),
        (mlp + r"down_proj\.weight", "w_down", _t),
        (mlp + r"gate\.weight", "router", _t),
        (mlp + r"experts\.(\d+)\.gate_proj\.weight", "we_gate", _t),
        (mlp + r"experts\.(\d+)\.up_proj\.weight", "we_up", _t),
        (mlp + r"experts\.(\d+)\.down_proj\.weight", "we_down", _t),
        # GGUF's: all a layer's experts in one tensor [X, out, in].
        (mlp + r"experts\.gate_proj\.weight", "we_gate", _experts_t),
        (mlp + r"experts\.up_proj\.weight", "we_up", _experts_t),
        (mlp + r"experts\.down_proj\.weight", "we_down", _experts_t),
        (mlp + r"shared_experts\.gate_proj\.weight", "ws_gate", _t),
        (mlp + r"shared_experts\.up_proj\.weight", "ws_up", _t),
        (mlp + r"shared_experts\.down_proj\.weight", "ws_down", _t),
    ]


def _table(cfg: ModelConfig) -> list[Rule]:
    """The family's rules, after any of the model type's own (the first match wins)."""
    if cfg.latent_attention:
        return _latent_attention_rules(cfg)
    return TABLES.get(cfg.model_type, []) + TABLES[cfg.family]


def lookup(cfg: ModelConfig, key: str) -> tuple[tuple[str, ...], tuple[int, ...], Transform] | None:
    """(param names, leading indices, transform) for an HF key; None for ignorable keys.

    Raises:
      KeyError: the key is neither mapped nor known to be ignorable.
    """
    key = canonical_key(key)
    if _IGNORED.match(key):
        return None
    for pattern, names, transform in _table(cfg):
        m = re.fullmatch(pattern, key)
        if m:
            names = (names,) if isinstance(names, str) else names
            index = [int(g) for g in m.groups()]
            if index:  # a weight stacking only the layers from its first one on (DeepSeek's MoE)
                index[0] -= layer_offsets(cfg).get(names[0], 0)
            return names, tuple(index), transform
    raise KeyError(key)


def place(
    cfg: ModelConfig, specs: dict[str, ParamSpec], key: str, shape: tuple[int, ...]
) -> list[Placement]:
    """Where HF tensor `key` of `shape` goes: one `Placement` per param it fills (several for
    a fused tensor); [] when jengine does not need it (ignorable keys, an lm_head tied to the
    embedding).

    Raises:
      ModelLoadError: the key fits no param of this config, names a layer or expert past the
        last one, or has the wrong shape.
    """
    try:
        entry = lookup(cfg, key)
    except KeyError:
        raise ModelLoadError(
            f"unexpected weight {key!r} for architecture {cfg.model_type}"
        ) from None
    if entry is None:
        return []
    names, index, transform = entry
    if names == ("lm_head",) and cfg.tie_word_embeddings:
        return []
    for name in names:
        if name not in specs:
            raise ModelLoadError(f"weight {key!r} does not fit this {cfg.model_type} config")
        bounds = specs[name].shape[:len(index)]
        if any(not 0 <= i < n for i, n in zip(index, bounds)):
            raise ModelLoadError(
                f"weight {key!r} names index {index} past {specs[name].axes[:len(index)]} "
                f"of size {bounds}"
            )
    parts = [transform.source_shape(specs[n].shape[len(index):], cfg.head_dim) for n in names]
    axis = transform.split_axis
    sizes = [p[axis] for p in parts]
    expected = parts[0][:axis] + (sum(sizes),) + parts[0][axis + 1:]
    others = {p[:axis] + p[axis + 1:] for p in parts}
    if tuple(shape) != expected or len(others) != 1:
        raise ModelLoadError(
            f"weight {key!r} has shape {tuple(shape)}; expected {expected} for {'+'.join(names)}"
        )
    if len(names) == 1:
        return [Placement(names[0], index, transform)]
    starts = np.cumsum([0] + sizes)
    return [Placement(name, index, transform, slice(int(a), int(b)))
            for name, a, b in zip(names, starts[:-1], starts[1:])]


def check_complete(
    cfg: ModelConfig, specs: dict[str, ParamSpec], filled: set[tuple[str, tuple[int, ...]]]
) -> None:
    """ModelLoadError naming every param some (param, leading index) of which no HF tensor
    filled."""
    missing = [
        name for name, spec in specs.items()
        if any((name, i) not in filled for i in leading_indices(spec))
    ]
    if missing:
        raise ModelLoadError(f"checkpoint is missing weights for {', '.join(sorted(missing))}")


def covered(spec: ParamSpec, index: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The leading indices a tensor placed at `index` fills: itself, or every expert of a
    layer when one tensor holds them all (`index` = (layer,) of a [L, X, ...] param)."""
    return [i for i in leading_indices(spec) if i[:len(index)] == index]


def leading_indices(spec: ParamSpec) -> list[tuple[int, ...]]:
    """Every index an HF tensor fills of this param: (layer,), (layer, expert), or ()."""
    lead = leading_axes(spec)
    return [tuple(int(i) for i in ix) for ix in np.ndindex(*spec.shape[:lead])]


def leading_axes(spec: ParamSpec) -> int:
    """How many leading axes of the param index separate HF tensors (layers, experts)."""
    if spec.axes[:2] == ("layers", "experts"):
        return 2
    return 1 if spec.axes[0] == "layers" else 0
