"""HF checkpoint key -> jengine param: the family's weight rules applied.

Each family's record lists its rules (HF key pattern -> param, transform; plain data in
`jengine.models.weight_rules` and the family's file); here they are matched against a
checkpoint's keys, every tensor's shape is asserted against the model's `ParamSpec` before it
is placed (`place`), and a fused tensor is split into the params it feeds.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from converters.errors import ModelLoadError
from jengine.models.config import ModelConfig
from jengine.models.layers import ParamSpec
from jengine.models.registry import family_of, stacked_index
from jengine.models.weight_rules import Index, Transform

_ALL = slice(None)

# Wrappers some checkpoints put around the text model's keys.
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.",
             "model.text_model.")
# Keys that carry nothing jengine needs (rotary caches, vision towers of multimodal checkpoints).
_IGNORED = re.compile(
    r".*(rotary_emb\.inv_freq|vision_tower|multi_modal_projector|vision_model|connector\.).*")


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


def lookup(cfg: ModelConfig, key: str) -> tuple[tuple[str, ...], tuple[int, ...], Transform] | None:
    """(param names, leading indices, transform) for an HF key; None for ignorable keys (the
    shared ones, and those a family's rule maps to no param).

    Raises:
      KeyError: the key is neither mapped nor known to be ignorable.
    """
    key = canonical_key(key)
    if _IGNORED.match(key):
        return None
    for pattern, names, transform in family_of(cfg).weight_rules(cfg):
        m = re.fullmatch(pattern, key)
        if m:
            names = (names,) if isinstance(names, str) else names
            if not names:  # a rule that names no param: a weight the family skips
                return None
            index = [int(g) for g in m.groups()]
            if index:  # a weight stacking only some layers (DeepSeek's MoE, a hybrid's mixers)
                index[0] = stacked_index(cfg, names[0], index[0])
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
