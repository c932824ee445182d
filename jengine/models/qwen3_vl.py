"""Qwen3-VL: its family record (the Qwen3 text model with interleaved multimodal rope and
DeepStack rows added into its first layers) and its image tower.

The tower differs from Qwen2.5-VL's (`qwen2_5_vl.py`): LayerNorm blocks with a GELU MLP, full
attention over each image (no windows), a learned square table of position embeddings
resampled bilinearly to each image's grid, and DeepStack: after the blocks in
`deepstack_visual_indexes`, a merger of their own turns the hidden states into extra rows that
the text model adds into its first layers' hidden states at the image's placeholders. The
resampling taps are computed on the host (`tower_plan`), so one compiled program per
patch-count bucket serves any grid, as for Qwen2.5-VL.

Einsum letters as in `qwen2_5_vl.py`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jengine.models.family import Family, ModelType
from jengine.models.layers import ParamSpec
from jengine.models.llama import NETWORK
from jengine.models.llama_variants import LLAMA_RULES
from jengine.models.qwen2_5_vl import text_config
from jengine.models.weight_rules import same

_LAYER_KEY = re.compile(r"blocks\.(\d+)\.(.+)")
_LAYER_RULES = {
    "norm1.weight": "ln1_w", "norm1.bias": "ln1_b", "norm2.weight": "ln2_w", "norm2.bias": "ln2_b",
    "attn.qkv.weight": ("wq", "wk", "wv"), "attn.qkv.bias": ("bq", "bk", "bv"),
    "attn.proj.weight": "wo", "attn.proj.bias": "bo",
    "mlp.linear_fc1.weight": "fc1_w", "mlp.linear_fc1.bias": "fc1_b",
    "mlp.linear_fc2.weight": "fc2_w", "mlp.linear_fc2.bias": "fc2_b",
}
_MERGER_KEY = re.compile(r"(merger|deepstack_merger_list\.(\d+))\.(.+)")
_MERGER_RULES = {"norm.weight": "ln_w", "norm.bias": "ln_b", "linear_fc1.weight": "w1",
                 "linear_fc1.bias": "b1", "linear_fc2.weight": "w2", "linear_fc2.bias": "b2"}
_VISUAL = re.compile(r"(?:model\.)?visual\.(.+)")
_LAYER_NAMES = ("ln1_w", "ln1_b", "ln2_w", "ln2_b", "wq", "wk", "wv", "bq", "bk", "bv", "wo",
                "bo", "fc1_w", "fc1_b", "fc2_w", "fc2_b")
EPS = 1e-6


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """The tower's shapes, read from a Qwen3-VL `config.json`."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0
    text_hidden_size: int
    image_token_id: int

    @property
    def patch_in(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.merge_size ** 2

    @property
    def grid_side(self) -> int:
        return int(self.num_position_embeddings ** 0.5)


def vision_config_from_hf(hf: dict[str, Any]) -> VisionConfig:
    """The vision side of a Qwen3-VL `config.json` (its nested `vision_config`)."""
    v = hf.get("vision_config") or {}
    if (act := v.get("hidden_act", "gelu_pytorch_tanh")) not in ("gelu_pytorch_tanh", "gelu_new"):
        raise ValueError(f"unsupported vision activation {act!r}")
    rope = v.get("rope_parameters") or {}
    return VisionConfig(
        depth=v.get("depth", 27), hidden_size=v.get("hidden_size", 1152),
        intermediate_size=v.get("intermediate_size", 4304), num_heads=v.get("num_heads", 16),
        patch_size=v.get("patch_size", 16), temporal_patch_size=v.get("temporal_patch_size", 2),
        merge_size=v.get("spatial_merge_size", 2), in_channels=v.get("in_channels", 3),
        num_position_embeddings=v.get("num_position_embeddings", 2304),
        deepstack_visual_indexes=tuple(v.get("deepstack_visual_indexes", (8, 16, 24))),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        text_hidden_size=v.get("out_hidden_size", 3584),
        image_token_id=hf.get("image_token_id", 151655),
    )


def param_specs(vc: VisionConfig) -> dict[str, ParamSpec]:
    """Every weight of the tower and its mergers (the last one's, then DeepStack's, stacked)."""
    n, e, f, k = vc.depth, vc.hidden_size, vc.intermediate_size, len(vc.deepstack_visual_indexes)
    m = e * vc.merge_unit
    specs = {
        "patch_w": ParamSpec((vc.patch_in, e), ("patch_in", "vision_embed")),
        "patch_b": ParamSpec((e,), ("vision_embed",), "zeros"),
        "pos_embed": ParamSpec((vc.num_position_embeddings, e), ("patches", "vision_embed")),
    }
    for name in ("ln1_w", "ln2_w"):
        specs[name] = ParamSpec((n, e), ("layers", "vision_embed"), "ones")
    for name in ("ln1_b", "ln2_b", "bq", "bk", "bv", "bo", "fc2_b"):
        specs[name] = ParamSpec((n, e), ("layers", "vision_embed"), "zeros")
    for name in ("wq", "wk", "wv", "wo"):
        specs[name] = ParamSpec((n, e, e), ("layers", "vision_embed", "vision_embed"))
    specs["fc1_w"] = ParamSpec((n, e, f), ("layers", "vision_embed", "vision_mlp"))
    specs["fc1_b"] = ParamSpec((n, f), ("layers", "vision_mlp"), "zeros")
    specs["fc2_w"] = ParamSpec((n, f, e), ("layers", "vision_mlp", "vision_embed"))
    for prefix, count, norm in (("merge_", None, e), ("deep_", k, m)):
        lead = () if count is None else (count,)
        axis = () if count is None else ("mergers",)
        specs[prefix + "ln_w"] = ParamSpec(lead + (norm,), axis + ("vision_embed",), "ones")
        specs[prefix + "ln_b"] = ParamSpec(lead + (norm,), axis + ("vision_embed",), "zeros")
        specs[prefix + "w1"] = ParamSpec(lead + (m, m), axis + ("vision_mlp", "vision_mlp"))
        specs[prefix + "b1"] = ParamSpec(lead + (m,), axis + ("vision_mlp",), "zeros")
        specs[prefix + "w2"] = ParamSpec(lead + (m, vc.text_hidden_size),
                                         axis + ("vision_mlp", "embed"))
        specs[prefix + "b2"] = ParamSpec(lead + (vc.text_hidden_size,), axis + ("embed",),
                                         "zeros")
    return specs


def params_from_hf(vc: VisionConfig, tensors: Iterator[tuple[str, np.ndarray]],
                   dtype=np.float32) -> dict[str, np.ndarray]:
    """The tower's params from an HF checkpoint's (key, array) pairs; other keys are skipped.

    Raises:
      ValueError: a weight is missing or has the wrong shape.
    """
    specs = param_specs(vc)
    out = {name: np.zeros(spec.shape, dtype) for name, spec in specs.items()}
    found: set[tuple[str, int]] = set()

    def put(name: str, index: int, value: np.ndarray) -> None:
        want = specs[name].shape[1:] if index >= 0 else specs[name].shape
        if tuple(value.shape) != tuple(want):
            raise ValueError(f"vision weight {name}: shape {value.shape}, expected {want}")
        if index >= 0:
            out[name][index] = value
        else:
            out[name] = value.astype(dtype)
        found.add((name, index))

    for key, value in tensors:
        if not (v := _VISUAL.fullmatch(key)):
            continue
        key, value = v.group(1), np.asarray(value, np.float32)
        value = value.T if value.ndim == 2 else value
        if (m := _LAYER_KEY.fullmatch(key)) and m.group(2) in _LAYER_RULES:
            names, layer = _LAYER_RULES[m.group(2)], int(m.group(1))
            if isinstance(names, tuple):
                for name, part in zip(names, np.split(value, 3, axis=-1)):
                    put(name, layer, part)
            else:
                put(names, layer, value)
        elif (m := _MERGER_KEY.fullmatch(key)) and m.group(3) in _MERGER_RULES:
            prefix = "merge_" if m.group(2) is None else "deep_"
            index = -1 if m.group(2) is None else int(m.group(2))
            put(prefix + _MERGER_RULES[m.group(3)], index, value)
        elif key == "patch_embed.proj.weight":  # conv [e, c, t, p, p] -> [c*t*p*p, e]
            put("patch_w", -1, value.reshape(value.shape[0], -1).T)
        elif key == "patch_embed.proj.bias":
            put("patch_b", -1, value)
        elif key == "pos_embed.weight":
            put("pos_embed", -1, value.T)  # undo the transpose above: a table, not a linear
    needed = {(name, i) for name, spec in specs.items()
              for i in (range(spec.shape[0]) if spec.axes[0] in ("layers", "mergers") else (-1,))}
    if missing := sorted(needed - found):
        raise ValueError(f"vision weights missing from the checkpoint: {missing[:4]}")
    return out


@dataclasses.dataclass(frozen=True)
class TowerPlan:
    """The host's part of a tower run over some images' patches, padded to `n` patches."""

    hw: np.ndarray  # [n, 2] int32 each patch's (row, column) in its image
    image: np.ndarray  # [n] int32 the image a patch belongs to (-1 - k: padding)
    taps: np.ndarray  # [n, 4] int32 rows of `pos_embed` its position embedding mixes
    weights: np.ndarray  # [n, 4] float32 their bilinear weights


def tower_plan(vc: VisionConfig, grids: list[tuple[int, int, int]], n: int) -> TowerPlan:
    """Positions, attention groups and position-embedding taps of the images with these
    (t, gh, gw) grids, patches in merge-block order, padded to `n` (HF's
    `get_vision_position_ids` and bilinear, align-corners
    `get_vision_interpolation_indices_and_weights`)."""
    m, side = vc.merge_size, vc.grid_side
    hw, image, taps, weights = [], [], [], []
    for k, (t, gh, gw) in enumerate(grids):
        if t != 1:
            raise ValueError("video grids (t > 1) are not supported")
        rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
        rows = rows.reshape(gh // m, m, gw // m, m).transpose(0, 2, 1, 3).reshape(-1)
        cols = cols.reshape(gh // m, m, gw // m, m).transpose(0, 2, 1, 3).reshape(-1)
        (h_taps, h_w), (w_taps, w_w) = _axis_taps(rows, gh, side), _axis_taps(cols, gw, side)
        taps.append((h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4))
        weights.append((h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4))
        hw.append(np.stack([rows, cols], -1))
        image.append(np.full(gh * gw, k))
    real = sum(len(x) for x in hw)
    if real > n:
        raise ValueError(f"{real} patches exceed the run's {n}")
    pad = n - real
    return TowerPlan(
        hw=np.concatenate(hw + [np.zeros((pad, 2), np.int64)]).astype(np.int32),
        image=np.concatenate(image + [np.arange(-1, -1 - pad, -1)]).astype(np.int32),
        taps=np.concatenate(taps + [np.zeros((pad, 4), np.int64)]).astype(np.int32),
        weights=np.concatenate(weights + [np.zeros((pad, 4), np.float32)]).astype(np.float32))


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear, align-corners taps [N, 2] and weights [N, 2] of positions `index` of an axis
    `size` long in a table `side` long (float32, as HF computes them)."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    raw = floor.astype(np.int64)[:, None] + np.arange(2)
    distance = np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32))
    return np.clip(raw, 0, side - 1), np.clip(1 - distance, 0, None).astype(np.float32)


def _layer_norm(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + EPS) * w + b


def _merge(x: jax.Array, p: dict[str, jax.Array], unit: int, post: bool) -> jax.Array:
    """A patch merger: LayerNorm (after folding `unit` patches into one row where `post`,
    DeepStack's), then a GELU MLP to the text model's width."""
    n, e = x.shape
    x = x.reshape(n // unit, e * unit) if post else x
    x = _layer_norm(x, p["ln_w"], p["ln_b"]).reshape(n // unit, e * unit)
    x = jax.nn.gelu(jnp.einsum("nf,fg->ng", x, p["w1"]) + p["b1"], approximate=False)
    return jnp.einsum("ng,gE->nE", x, p["w2"]) + p["b2"]


def encode(params: dict[str, jax.Array], vc: VisionConfig, patches: jax.Array, hw: jax.Array,
           image: jax.Array, taps: jax.Array, weights: jax.Array) -> jax.Array:
    """Patches [n, i] (merge-block order) with their plan -> rows [1 + K, n / unit, E]: the
    merger's (what replaces the placeholders' embeddings), then each DeepStack merger's."""
    n = patches.shape[0]
    e, heads = vc.hidden_size, vc.num_heads
    d = e // heads
    x = jnp.einsum("ni,ie->ne", patches, params["patch_w"]) + params["patch_b"]
    x = x + jnp.einsum("nk,nke->ne", weights, params["pos_embed"][taps])
    inv = 1.0 / vc.rope_theta ** (jnp.arange(0, d // 2, 2, dtype=jnp.float32) / (d // 2))
    angles = jnp.concatenate([hw[:, :1] * inv, hw[:, 1:] * inv], axis=-1)  # [n, d/2]
    cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]
    mask = image[:, None] == image[None, :]

    def turn(q):
        q1, q2 = jnp.split(q, 2, axis=-1)
        return jnp.concatenate([q1 * cos - q2 * sin, q2 * cos + q1 * sin], axis=-1)

    def block(x, p):
        h = _layer_norm(x, p["ln1_w"], p["ln1_b"])
        q, k, v = ((jnp.einsum("ne,ef->nf", h, p[w]) + p[b]).reshape(n, heads, d)
                   for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
        scores = jnp.einsum("qhd,khd->hqk", turn(q), turn(k)) * d ** -0.5
        probs = jax.nn.softmax(jnp.where(mask[None], scores, -jnp.inf), axis=-1)
        attn = jnp.einsum("hqk,khd->qhd", probs.astype(v.dtype), v).reshape(n, e)
        x = x + jnp.einsum("ne,ef->nf", attn, p["wo"]) + p["bo"]
        h = _layer_norm(x, p["ln2_w"], p["ln2_b"])
        h = jax.nn.gelu(jnp.einsum("ne,ef->nf", h, p["fc1_w"]) + p["fc1_b"], approximate=True)
        return x + jnp.einsum("nf,fe->ne", h, p["fc2_w"]) + p["fc2_b"]

    deep = []
    for i in range(vc.depth):
        x = block(x, {k: params[k][i] for k in _LAYER_NAMES})
        if i in vc.deepstack_visual_indexes:
            j = vc.deepstack_visual_indexes.index(i)
            p = {k: params["deep_" + k][j] for k in _MERGER_RULES.values()}
            deep.append(_merge(x, p, vc.merge_unit, post=True))
    main = _merge(x, {k: params["merge_" + k] for k in _MERGER_RULES.values()}, vc.merge_unit,
                  post=False)
    return jnp.stack([main] + deep)


def encode_images(params, vc: VisionConfig, patches: np.ndarray,
                  grids: list[tuple[int, int, int]]) -> np.ndarray:
    """Every image's patches [N, i] -> rows [1 + K, N / unit, E] in placeholder order: one
    unpadded run (tests)."""
    plan = tower_plan(vc, grids, len(patches))
    return np.asarray(encode(params, vc, jnp.asarray(patches), *(
        jnp.asarray(a) for a in (plan.hw, plan.image, plan.taps, plan.weights))))


QWEN3_VL = Family(
    name="qwen3_vl",
    network=NETWORK,
    model_types=(
        ModelType(name="qwen3_vl", features="Qwen3-VL: patches through a ViT with interpolated "
                  "learned positions + DeepStack mergers (`models/qwen3_vl.py`) into the Qwen3 "
                  "text model with interleaved multimodal rope; docs/vision.md",
                  parity_test="test_qwen3_vl_image_logits"),
    ),
    unwrap_hf=text_config,
    switches={"qk_norm": True}, sliding_window_flag=True,
    hf_weights=((r"(?:model\.)?visual\..*", (), same),) + LLAMA_RULES,  # tower: its own loader
)
