"""Qwen2.5-VL: its family record (the Qwen2 text model with multimodal rope) and its image side,
a ViT over 14-pixel patches with 2D rope, window attention and a 2x2 patch merger.

An image reaches the tower as flattened patches in merge-block order
(`jengine.vision.qwen2_vl_processor`), a grid of gh x gw patches. The tower attends within
windows of `window_size` pixels on most blocks and over the whole image on the blocks in
`fullatt_block_indexes`; HF reorders the patches window by window and cuts the sequence at the
window edges. Here the host computes that order and, per patch, which window and which image
it belongs to (`vision_plan`); the compiled tower masks attention to patches of the same
window (or image), so one program per patch-count bucket serves any grid. The merger folds
each 2x2 block into one text-model row; the rows go back to raster order on the host.

In the text model, every token has three rope positions (time, row, column): a text token's are
all its index in the sequence (shifted by the images before it), an image's placeholders take
the image's start plus (0, row, column) of their merged block, and the text after an image
resumes at the largest position so far + 1 (`mrope_positions`). The rope's frequencies are cut
into `mrope_section` runs, each turned by one of the three (`layers.mrope_tables`).

Einsum letters: n patches, e the tower's width, h heads, d head dim, f the MLP width, i a
patch's pixels (channels x temporal x patch x patch), E the text model's width.
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
from jengine.models.weight_rules import same

# HF key (after `model.` / `visual.`) -> param name; linear weights are transposed (torch keeps
# [out, in]), the fused qkv split in three, the 3D patch conv flattened.
_LAYER_KEY = re.compile(r"blocks\.(\d+)\.(.+)")
_LAYER_RULES = {
    "norm1.weight": "ln1", "norm2.weight": "ln2",
    "attn.qkv.weight": ("wq", "wk", "wv"), "attn.qkv.bias": ("bq", "bk", "bv"),
    "attn.proj.weight": "wo", "attn.proj.bias": "bo",
    "mlp.gate_proj.weight": "w_gate", "mlp.gate_proj.bias": "b_gate",
    "mlp.up_proj.weight": "w_up", "mlp.up_proj.bias": "b_up",
    "mlp.down_proj.weight": "w_down", "mlp.down_proj.bias": "b_down",
}
_GLOBAL_RULES = {
    "patch_embed.proj.weight": "patch_w", "merger.ln_q.weight": "merge_ln",
    "merger.mlp.0.weight": "merge_w1", "merger.mlp.0.bias": "merge_b1",
    "merger.mlp.2.weight": "merge_w2", "merger.mlp.2.bias": "merge_b2",
}
_VISUAL = re.compile(r"(?:model\.)?visual\.(.+)")
_LAYER_NAMES = ("ln1", "ln2", "wq", "wk", "wv", "bq", "bk", "bv", "wo", "bo",
                "w_gate", "b_gate", "w_up", "b_up", "w_down", "b_down")
EPS = 1e-6  # the tower's RMSNorms (fixed in HF's modeling, not in the config)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """The tower's shapes, read from a Qwen2.5-VL `config.json`."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2  # spatial_merge_size
    window_size: int = 112  # pixels
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    in_channels: int = 3
    rope_theta: float = 10000.0
    text_hidden_size: int  # out_hidden_size
    image_token_id: int

    @property
    def patch_in(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.merge_size ** 2


def vision_config_from_hf(hf: dict[str, Any]) -> VisionConfig:
    """The vision side of a Qwen2.5-VL `config.json`: published checkpoints nest
    `vision_config` with `in_chans`; transformers 5 writes `in_channels`."""
    v = hf.get("vision_config") or {}
    if (act := v.get("hidden_act", "silu")) != "silu":
        raise ValueError(f"unsupported vision activation {act!r}")
    rope = v.get("rope_parameters") or {}
    return VisionConfig(
        depth=v.get("depth", 32), hidden_size=v.get("hidden_size", 3584),
        intermediate_size=v.get("intermediate_size", 3420), num_heads=v.get("num_heads", 16),
        patch_size=v.get("patch_size", 14), temporal_patch_size=v.get("temporal_patch_size", 2),
        merge_size=v.get("spatial_merge_size", 2), window_size=v.get("window_size", 112),
        fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))),
        in_channels=v.get("in_channels", v.get("in_chans", 3)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        text_hidden_size=v.get("out_hidden_size", 3584),
        image_token_id=hf.get("image_token_id", 151655),
    )


def param_specs(vc: VisionConfig) -> dict[str, ParamSpec]:
    """Every weight of the tower and merger; per-layer weights carry a leading layer axis."""
    n, e, f = vc.depth, vc.hidden_size, vc.intermediate_size
    m = e * vc.merge_unit
    specs = {
        "patch_w": ParamSpec((vc.patch_in, e), ("patch_in", "vision_embed")),
        "merge_ln": ParamSpec((e,), ("vision_embed",), "ones"),
        "merge_w1": ParamSpec((m, m), ("vision_mlp", "vision_mlp")),
        "merge_b1": ParamSpec((m,), ("vision_mlp",), "zeros"),
        "merge_w2": ParamSpec((m, vc.text_hidden_size), ("vision_mlp", "embed")),
        "merge_b2": ParamSpec((vc.text_hidden_size,), ("embed",), "zeros"),
    }
    for name in ("ln1", "ln2"):
        specs[name] = ParamSpec((n, e), ("layers", "vision_embed"), "ones")
    for name in ("bq", "bk", "bv", "bo", "b_down"):
        specs[name] = ParamSpec((n, e), ("layers", "vision_embed"), "zeros")
    for name in ("wq", "wk", "wv", "wo"):
        specs[name] = ParamSpec((n, e, e), ("layers", "vision_embed", "vision_embed"))
    for name in ("w_gate", "w_up"):
        specs[name] = ParamSpec((n, e, f), ("layers", "vision_embed", "vision_mlp"))
    for name in ("b_gate", "b_up"):
        specs[name] = ParamSpec((n, f), ("layers", "vision_mlp"), "zeros")
    specs["w_down"] = ParamSpec((n, f, e), ("layers", "vision_mlp", "vision_embed"))
    return specs


def params_from_hf(vc: VisionConfig, tensors: Iterator[tuple[str, np.ndarray]],
                   dtype=np.float32) -> dict[str, np.ndarray]:
    """The tower's params from an HF checkpoint's (key, array) pairs (`visual.*` as published,
    `model.visual.*` as transformers 5 saves); other keys are skipped. Every declared weight must
    be found, with its declared shape.

    Raises:
      ValueError: a weight is missing or has the wrong shape.
    """
    specs = param_specs(vc)
    out = {name: np.zeros(spec.shape, dtype) for name, spec in specs.items()}
    found: set[tuple[str, int]] = set()
    for key, value in tensors:
        if not (v := _VISUAL.fullmatch(key)):
            continue
        key, value = v.group(1), np.asarray(value, np.float32)
        if (m := _LAYER_KEY.fullmatch(key)) and m.group(2) in _LAYER_RULES:
            names, layer = _LAYER_RULES[m.group(2)], int(m.group(1))
            value = value.T if value.ndim == 2 else value
            parts = np.split(value, 3, axis=-1) if isinstance(names, tuple) else [value]
            for name, part in zip((names,) if isinstance(names, str) else names, parts):
                _check(name, part.shape, specs[name].shape[1:])
                out[name][layer] = part
                found.add((name, layer))
        elif key in _GLOBAL_RULES:
            name = _GLOBAL_RULES[key]
            if name == "patch_w":  # conv [e, c, t, p, p] -> [c*t*p*p, e], the patches' order
                value = value.reshape(value.shape[0], -1).T
            elif value.ndim == 2:
                value = value.T
            _check(name, value.shape, specs[name].shape)
            out[name] = value.astype(dtype)
            found.add((name, -1))
    needed = {(name, layer) for name, spec in specs.items()
              for layer in (range(vc.depth) if spec.axes[0] == "layers" else (-1,))}
    if missing := sorted(needed - found):
        raise ValueError(f"vision weights missing from the checkpoint: {missing[:4]}")
    return out


def _check(name: str, shape: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(shape) != tuple(want):
        raise ValueError(f"vision weight {name}: shape {tuple(shape)}, expected {tuple(want)}")


@dataclasses.dataclass(frozen=True)
class VisionPlan:
    """The host's part of a tower run over some images' patches, padded to `n` patches."""

    order: np.ndarray  # [n] int32 the patch each row of the run takes (window order); pad: 0
    hw: np.ndarray  # [n, 2] int32 that patch's (row, column) in its image
    window: np.ndarray  # [n] int32 the window a row attends within (-1 - k: padding)
    image: np.ndarray  # [n] int32 the image a row belongs to (full-attention blocks)
    unorder: np.ndarray  # [real / merge_unit] int32 merged row -> raster order (HF's argsort)


def vision_plan(vc: VisionConfig, grids: list[tuple[int, int, int]], n: int) -> VisionPlan:
    """Window order, rope positions and attention groups of the images with these (t, gh, gw)
    grids, padded to `n` patches (HF's `get_vision_window_index` and `get_vision_position_ids`:
    windows of `window_size / patch_size / merge_size` merged blocks a side, the last ones cut
    short at the image's edge)."""
    unit, m = vc.merge_unit, vc.merge_size
    side = vc.window_size // m // vc.patch_size  # merged blocks per window side
    order, hw, window, image = [], [], [], []
    base, block_base, windows = 0, 0, 0
    for k, (t, gh, gw) in enumerate(grids):
        if t != 1:
            raise ValueError("video grids (t > 1) are not supported")
        bh, bw = gh // m, gw // m
        # (row, column) of every patch in merge-block order, as the processor flattens them.
        rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
        rows = rows.reshape(bh, m, bw, m).transpose(0, 2, 1, 3).reshape(-1)
        cols = cols.reshape(bh, m, bw, m).transpose(0, 2, 1, 3).reshape(-1)
        blocks = np.arange(bh * bw).reshape(bh, bw)
        for wr in range(0, bh, side):
            for wc in range(0, bw, side):
                for b in blocks[wr:wr + side, wc:wc + side].reshape(-1):
                    patch = base + b * unit + np.arange(unit)
                    order.extend(patch)
                    hw.extend(zip(rows[b * unit:(b + 1) * unit], cols[b * unit:(b + 1) * unit]))
                    window.extend([windows] * unit)
                    image.extend([k] * unit)
                windows += 1
        base += gh * gw
        block_base += bh * bw
    real = len(order)
    if real > n:
        raise ValueError(f"{real} patches exceed the run's {n}")
    pad = n - real
    merged_order = np.asarray(order[::unit], np.int64) // unit
    return VisionPlan(
        order=np.asarray(order + [0] * pad, np.int32),
        hw=np.asarray(hw + [(0, 0)] * pad, np.int32).reshape(n, 2),
        window=np.asarray(window + list(range(-1, -1 - pad, -1)), np.int32),
        image=np.asarray(image + list(range(-1, -1 - pad, -1)), np.int32),
        unorder=np.argsort(merged_order).astype(np.int32),
    )


def _rms(x: jax.Array, w: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + EPS)).astype(x.dtype) * w


def encode(params: dict[str, jax.Array], vc: VisionConfig, patches: jax.Array,
           hw: jax.Array, window: jax.Array, image: jax.Array) -> jax.Array:
    """Patches [n, i] already in window order (`VisionPlan.order`) with their positions and
    groups -> merged rows [n / merge_unit, E] in the same (window) order; padding rows come out
    as rows nobody reads."""
    n = patches.shape[0]
    e, heads = vc.hidden_size, vc.num_heads
    d = e // heads
    x = jnp.einsum("ni,ie->ne", patches, params["patch_w"])
    inv = 1.0 / vc.rope_theta ** (jnp.arange(0, d // 2, 2, dtype=jnp.float32) / (d // 2))
    angles = jnp.concatenate([hw[:, :1] * inv, hw[:, 1:] * inv], axis=-1)  # [n, d/2]
    cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]
    same_window = window[:, None] == window[None, :]  # [n, n]
    same_image = image[:, None] == image[None, :]

    def turn(q):  # rotate-half over the whole head dim
        q1, q2 = jnp.split(q, 2, axis=-1)
        return jnp.concatenate([q1 * cos - q2 * sin, q2 * cos + q1 * sin], axis=-1)

    def block(x, p, mask):
        h = _rms(x, p["ln1"])
        q, k, v = ((jnp.einsum("ne,ef->nf", h, p[w]) + p[b]).reshape(n, heads, d)
                   for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
        q, k = turn(q), turn(k)
        scores = jnp.einsum("qhd,khd->hqk", q, k) * d ** -0.5
        scores = jnp.where(mask[None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
        attn = jnp.einsum("hqk,khd->qhd", probs, v).reshape(n, e)
        x = x + jnp.einsum("ne,ef->nf", attn, p["wo"]) + p["bo"]
        h = _rms(x, p["ln2"])
        gate = jax.nn.silu(jnp.einsum("ne,ef->nf", h, p["w_gate"]) + p["b_gate"])
        up = jnp.einsum("ne,ef->nf", h, p["w_up"]) + p["b_up"]
        return x + jnp.einsum("nf,fe->ne", gate * up, p["w_down"]) + p["b_down"]

    full = set(vc.fullatt_block_indexes)
    for i in range(vc.depth):
        x = block(x, {k: params[k][i] for k in _LAYER_NAMES},
                  same_image if i in full else same_window)
    x = _rms(x, params["merge_ln"]).reshape(n // vc.merge_unit, e * vc.merge_unit)
    x = jax.nn.gelu(jnp.einsum("nf,fg->ng", x, params["merge_w1"]) + params["merge_b1"],
                    approximate=False)
    return jnp.einsum("ng,gE->nE", x, params["merge_w2"]) + params["merge_b2"]


def encode_images(params, vc: VisionConfig, patches: np.ndarray,
                  grids: list[tuple[int, int, int]]) -> np.ndarray:
    """Every image's patches [N, i] (prompt order) -> rows [N / merge_unit, E] in raster order,
    the order their placeholders take them: one unpadded run (tests; the engine's runs are
    bucketed by `runtime.vision`)."""
    plan = vision_plan(vc, grids, len(patches))
    rows = encode(params, vc, jnp.asarray(patches[plan.order]), jnp.asarray(plan.hw),
                  jnp.asarray(plan.window), jnp.asarray(plan.image))
    return np.asarray(rows)[plan.unorder]


def mrope_positions(token_ids: np.ndarray, image_token_id: int,
                    grids: list[tuple[int, int, int]], merge_size: int) -> tuple[np.ndarray, int]:
    """([3, P] int32 rope positions of a prompt's tokens, the offset decode adds to a token's
    index): HF's `get_rope_index` for images. Each run of placeholders is the next image; its
    tokens take start + (0, block row, block column), and the text after it resumes at the
    largest position so far + 1. The offset (HF's `rope_deltas`) is that max + 1 less P.

    Raises:
      ValueError: the placeholder runs do not match the grids.
    """
    ids = np.asarray(token_ids)
    is_image = ids == image_token_id
    out = np.zeros((3, len(ids)), np.int32)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]])))
    runs = list(zip(edges[::2].tolist(), edges[1::2].tolist()))
    if len(runs) != len(grids):
        raise ValueError(f"{len(runs)} runs of image placeholders for {len(grids)} images")
    pos, last = 0, 0
    for (start, stop), (_, gh, gw) in zip(runs, grids):
        bh, bw = gh // merge_size, gw // merge_size
        if stop - start != bh * bw:
            raise ValueError(f"an image of {bh * bw} rows has {stop - start} placeholders")
        out[:, last:start] = pos + np.arange(start - last)
        pos += start - last
        rows, cols = np.meshgrid(np.arange(bh), np.arange(bw), indexing="ij")
        out[0, start:stop] = pos
        out[1, start:stop] = pos + rows.reshape(-1)
        out[2, start:stop] = pos + cols.reshape(-1)
        pos += max(bh, bw)
        last = stop
    out[:, last:] = pos + np.arange(len(ids) - last)
    top = int(out.max()) + 1 if len(ids) else 0
    return out, top - len(ids)


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The Qwen2 text model of a Qwen2.5-VL checkpoint, still typed as the wrapper so that the
    engine knows its prompts may hold images and its rope is multimodal. Published checkpoints
    keep the text fields at the top level; transformers 5 nests them in `text_config`."""
    text = {k: v for k, v in hf.items() if k not in ("vision_config", "text_config")}
    text.update(hf.get("text_config") or {})
    # transformers ties the head when either config says so (pre-5 saves set the inner one).
    tied = hf.get("tie_word_embeddings") or (hf.get("text_config") or {}).get(
        "tie_word_embeddings")
    if tied is not None:
        text["tie_word_embeddings"] = bool(tied)
    return {**text, "model_type": hf["model_type"]}


QWEN2_5_VL = Family(
    name="qwen2_5_vl",
    network=NETWORK,
    model_types=(
        ModelType(name="qwen2_5_vl", features="Qwen2.5-VL: patches through a windowed ViT with "
                  "2D rope + 2x2 merger (`models/qwen2_5_vl.py`) into the Qwen2 text model "
                  "with multimodal rope; docs/vision.md",
                  parity_test="test_qwen2_5_vl_image_logits"),
    ),
    unwrap_hf=text_config,
    switches={"qkv_bias": True, "o_bias": False}, sliding_window_flag=True,
    hf_weights=((r"(?:model\.)?visual\..*", (), same),) + LLAMA_RULES,  # tower: its own loader
)
