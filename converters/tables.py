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
_o_in = Transform(  # [E, H*D] -> [H, D, E]
    apply=lambda w, cfg: w.T.reshape(-1, cfg.head_dim, w.shape[0]),
    source_index=lambda idx, d: ((idx[2], _rows(idx[0], d)), (_ALL, idx[1], _ALL)),
    source_shape=lambda shape, d: (shape[2], shape[0] * shape[1]),
)


_LAYER = r"model\.layers\.(\d+)\."

_COMMON: list[tuple[str, str, Transform]] = [
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

TABLES: dict[str, list[tuple[str, str, Transform]]] = {
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
    ],
    "gemma3": _COMMON
    + [
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


def lookup(cfg: ModelConfig, key: str) -> tuple[str, int | None, Transform] | None:
    """(param name, layer index or None, transform) for an HF key; None for ignorable keys.

    Raises:
      KeyError: the key is neither mapped nor known to be ignorable.
    """
    key = canonical_key(key)
    if _IGNORED.match(key):
        return None
    for pattern, name, transform in TABLES[cfg.family]:
        m = re.fullmatch(pattern, key)
        if m:
            return name, (int(m.group(1)) if m.groups() else None), transform
    raise KeyError(key)


def place(
    cfg: ModelConfig, specs: dict[str, ParamSpec], key: str, shape: tuple[int, ...]
) -> tuple[str, int | None, Transform] | None:
    """Where HF tensor `key` of `shape` goes: (param, layer or None, transform); None when
    jengine does not need it (ignorable keys, an lm_head tied to the embedding).

    Raises:
      ModelLoadError: the key fits no param of this config, names a layer past the last one, or
        has the wrong shape.
    """
    try:
        entry = lookup(cfg, key)
    except KeyError:
        raise ModelLoadError(
            f"unexpected weight {key!r} for architecture {cfg.model_type}"
        ) from None
    if entry is None:
        return None
    name, layer, transform = entry
    if name == "lm_head" and cfg.tie_word_embeddings:
        return None
    if name not in specs:
        raise ModelLoadError(f"weight {key!r} does not fit this {cfg.model_type} config")
    spec_shape = specs[name].shape[1:] if layer is not None else specs[name].shape
    expected = transform.source_shape(spec_shape, cfg.head_dim)
    if tuple(shape) != expected:
        raise ModelLoadError(
            f"weight {key!r} has shape {tuple(shape)}; expected {expected} for {name}"
        )
    if layer is not None and layer >= cfg.num_layers:
        raise ModelLoadError(f"weight {key!r} names layer {layer} of {cfg.num_layers}")
    return entry


def check_complete(
    cfg: ModelConfig, specs: dict[str, ParamSpec], filled: set[tuple[str, int | None]]
) -> None:
    """ModelLoadError naming every param some (param, layer) of which no HF tensor filled."""
    missing = [
        name for name, spec in specs.items()
        if any((name, i) not in filled for i in _layer_indices(spec, cfg))
    ]
    if missing:
        raise ModelLoadError(f"checkpoint is missing weights for {', '.join(sorted(missing))}")


def _layer_indices(spec: ParamSpec, cfg: ModelConfig) -> list[int | None]:
    return list(range(cfg.num_layers)) if spec.axes[0] == "layers" else [None]
