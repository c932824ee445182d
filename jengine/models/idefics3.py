"""Idefics3 / SmolVLM: its family record (a Llama text model) and its image side, a SigLIP
vision tower and the pixel-shuffle connector.

An image reaches the text model as tiles of `image_size` squared pixels (the processor cuts a
large image into a grid of tiles plus one downscaled global tile). Each tile runs through the
tower on its own (bidirectional attention over its `(image_size / patch_size) ** 2` patches),
the connector folds every `scale_factor` x `scale_factor` block of patch states into one vector
and projects it to the text model's width: `tokens_per_tile` rows per tile, which the prompt's
`<image>` placeholder tokens are replaced by (`AttentionMetadata.embeds`). The text model is
the Llama network (`llama.py`) unchanged.

Einsum letters: n tiles, p patches of a tile, e the tower's width, h heads, d head dim,
f the MLP width, c colour channels, E the text model's width.
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

# HF key (after `model.`) -> (param name, whether it has a layer index); the transform is a
# transpose for the linear weights (torch keeps [out, in]) and a flatten for the patch conv.
_LAYER_KEY = re.compile(r"vision_model\.encoder\.layers\.(\d+)\.(.+)")
_LAYER_RULES = {
    "layer_norm1.weight": "ln1_w", "layer_norm1.bias": "ln1_b",
    "self_attn.q_proj.weight": "wq", "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.weight": "wk", "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.weight": "wv", "self_attn.v_proj.bias": "bv",
    "self_attn.out_proj.weight": "wo", "self_attn.out_proj.bias": "bo",
    "layer_norm2.weight": "ln2_w", "layer_norm2.bias": "ln2_b",
    "mlp.fc1.weight": "fc1_w", "mlp.fc1.bias": "fc1_b",
    "mlp.fc2.weight": "fc2_w", "mlp.fc2.bias": "fc2_b",
}
_GLOBAL_RULES = {
    "vision_model.embeddings.patch_embedding.weight": "patch_w",
    "vision_model.embeddings.patch_embedding.bias": "patch_b",
    "vision_model.embeddings.position_embedding.weight": "pos_embed",
    "vision_model.post_layernorm.weight": "post_ln_w",
    "vision_model.post_layernorm.bias": "post_ln_b",
    "connector.modality_projection.proj.weight": "proj",
}
_PREFIXES = ("model.", "")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """The tower's and connector's shapes, read from an Idefics3 `config.json`."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int  # a tile's side in pixels
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    scale_factor: int  # the connector's pixel-shuffle factor
    text_hidden_size: int
    image_token_id: int

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        """Text-model rows one tile becomes (the processor's `image_seq_len`)."""
        return self.patches_per_side ** 2 // self.scale_factor ** 2


def vision_config_from_hf(hf: dict[str, Any]) -> VisionConfig:
    """The vision side of an Idefics3 / SmolVLM `config.json` (its nested `vision_config`;
    published checkpoints spell out only what differs from transformers' defaults, so the
    defaults here are Idefics3VisionConfig's)."""
    v = hf.get("vision_config") or {}
    text = hf.get("text_config") or {}
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_new"):
        raise ValueError(f"unsupported vision activation {act!r}")
    return VisionConfig(
        hidden_size=v.get("hidden_size", 1152),
        intermediate_size=v.get("intermediate_size", 3072),
        num_layers=v.get("num_hidden_layers", 12),
        num_heads=v.get("num_attention_heads", 16),
        image_size=v.get("image_size", 224),
        patch_size=v.get("patch_size", 32),
        num_channels=v.get("num_channels", 3),
        layer_norm_eps=v.get("layer_norm_eps", 1e-6),
        scale_factor=hf.get("scale_factor", 2),
        text_hidden_size=text.get("hidden_size", hf.get("hidden_size", 4096)),
        image_token_id=hf.get("image_token_id", 128257),
    )


def param_specs(vc: VisionConfig) -> dict[str, ParamSpec]:
    """Every weight of the tower and connector; per-layer weights carry a leading layer axis."""
    n, e, f = vc.num_layers, vc.hidden_size, vc.intermediate_size
    patch_in = vc.num_channels * vc.patch_size ** 2
    specs = {
        "patch_w": ParamSpec((patch_in, e), ("patch_in", "vision_embed")),
        "patch_b": ParamSpec((e,), ("vision_embed",), "zeros"),
        "pos_embed": ParamSpec((vc.patches_per_side ** 2, e), ("patches", "vision_embed")),
        "post_ln_w": ParamSpec((e,), ("vision_embed",), "ones"),
        "post_ln_b": ParamSpec((e,), ("vision_embed",), "zeros"),
        "proj": ParamSpec((e * vc.scale_factor ** 2, vc.text_hidden_size),
                          ("vision_mlp", "embed")),
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
    return specs


def params_from_hf(vc: VisionConfig, tensors: Iterator[tuple[str, np.ndarray]],
                   dtype=np.float32) -> dict[str, np.ndarray]:
    """The tower's params from an HF checkpoint's (key, array) pairs; keys of the text model
    are skipped. Every declared weight must be found, with its declared shape.

    Raises:
      ValueError: a weight is missing or has the wrong shape.
    """
    specs = param_specs(vc)
    out = {name: np.zeros(spec.shape, dtype) for name, spec in specs.items()}
    found: set[tuple[str, int]] = set()
    for key, value in tensors:
        key = next(key[len(p):] for p in _PREFIXES if key.startswith(p))
        value = np.asarray(value, np.float32)
        if (m := _LAYER_KEY.fullmatch(key)) and m.group(2) in _LAYER_RULES:
            name, layer = _LAYER_RULES[m.group(2)], int(m.group(1))
            value = value.T if value.ndim == 2 else value
            _check(name, value.shape, specs[name].shape[1:])
            out[name][layer] = value
        elif key in _GLOBAL_RULES:
            name, layer = _GLOBAL_RULES[key], -1
            if name == "patch_w":  # conv [e, c, p, p] -> [c*p*p, e], the patchify order
                value = value.reshape(value.shape[0], -1).T
            elif name == "proj":
                value = value.T
            _check(name, value.shape, specs[name].shape)
            out[name] = value.astype(dtype)
        else:
            continue
        found.add((name, layer))
    needed = {(name, layer) for name, spec in specs.items()
              for layer in (range(vc.num_layers) if spec.axes[0] == "layers" else (-1,))}
    if missing := sorted(needed - found):
        raise ValueError(f"vision weights missing from the checkpoint: {missing[:4]}")
    return out


def _check(name: str, shape: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(shape) != tuple(want):
        raise ValueError(f"vision weight {name}: shape {tuple(shape)}, expected {tuple(want)}")


def _layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * w + b


def encode(params: dict[str, jax.Array], vc: VisionConfig, pixels: jax.Array) -> jax.Array:
    """Tiles [N, C, S, S] (normalized pixels) -> the text model's rows for them
    [N * tokens_per_tile, E], tile after tile, in the order their placeholders appear."""
    n = pixels.shape[0]
    side, patch = vc.patches_per_side, vc.patch_size
    tiles = pixels.reshape(n, vc.num_channels, side, patch, side, patch)
    tiles = tiles.transpose(0, 2, 4, 1, 3, 5).reshape(n, side * side, -1)  # [n, p, c*P*P]
    x = jnp.einsum("npi,ie->npe", tiles, params["patch_w"]) + params["patch_b"]
    x = x + params["pos_embed"][None]  # a full tile: patch i sits at position i
    heads, head_dim = vc.num_heads, vc.hidden_size // vc.num_heads
    eps = vc.layer_norm_eps

    def layer(x, p):
        h = _layer_norm(x, p["ln1_w"], p["ln1_b"], eps)
        q, k, v = (
            (jnp.einsum("npe,ef->npf", h, p[w]) + p[b]).reshape(n, -1, heads, head_dim)
            for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv"))
        )
        scores = jnp.einsum("nqhd,nkhd->nhqk", q, k) * head_dim ** -0.5
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
        attn = jnp.einsum("nhqk,nkhd->nqhd", probs, v).reshape(n, -1, vc.hidden_size)
        x = x + jnp.einsum("npe,ef->npf", attn, p["wo"]) + p["bo"]
        h = _layer_norm(x, p["ln2_w"], p["ln2_b"], eps)
        h = jax.nn.gelu(jnp.einsum("npe,ef->npf", h, p["fc1_w"]) + p["fc1_b"], approximate=True)
        return x + jnp.einsum("npf,fe->npe", h, p["fc2_w"]) + p["fc2_b"]

    for i in range(vc.num_layers):
        x = layer(x, {k: params[k][i] for k in _LAYER_RULES.values()})
    x = _layer_norm(x, params["post_ln_w"], params["post_ln_b"], eps)
    x = _pixel_shuffle(x, side, vc.scale_factor)  # [n, tokens_per_tile, e * s * s]
    out = jnp.einsum("ntf,fE->ntE", x, params["proj"])
    return out.reshape(n * vc.tokens_per_tile, vc.text_hidden_size)


def _pixel_shuffle(x: jax.Array, side: int, s: int) -> jax.Array:
    """Idefics3Connector.pixel_shuffle: each s x s block of patches becomes one vector (in the
    order of HF's views and permutes, which the projection's weights were trained for)."""
    n, _, e = x.shape
    x = x.reshape(n, side, side // s, e * s)  # [n, rows, col blocks, s cols' features]
    x = x.transpose(0, 2, 1, 3).reshape(n, side // s, side // s, e * s * s)
    return x.transpose(0, 2, 1, 3).reshape(n, (side // s) ** 2, e * s * s)


def splice_positions(token_ids: np.ndarray, image_token_id: int) -> np.ndarray:
    """[T] -> [T] int32: for each placeholder token, the row of the encoded images that
    replaces it (the k-th placeholder takes row k); -1 elsewhere."""
    at = np.full(len(token_ids), -1, np.int32)
    hits = np.flatnonzero(np.asarray(token_ids) == image_token_id)
    at[hits] = np.arange(len(hits), dtype=np.int32)
    return at


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The Llama text model of an Idefics3 / SmolVLM checkpoint, still typed as the wrapper so
    that the engine knows its prompts may hold images. The wrapper's `tie_word_embeddings`
    wins where it is set (transformers keeps it on the outer config)."""
    text = dict(hf.get("text_config") or {})
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return {**text, "model_type": hf["model_type"]}


IDEFICS3 = Family(
    name="idefics3",
    network=NETWORK,
    model_types=(
        ModelType(name="idefics3", features="SmolVLM / Idefics3: images as tiles through a "
                  "SigLIP tower + pixel-shuffle connector (`models/idefics3.py`) into the "
                  "Llama text model; docs/vision.md", parity_test="test_idefics3_image_logits"),
        ModelType(name="smolvlm", features="SmolVLM2's model_type: read as `idefics3` "
                  "(same config and weight names; untested)"),
    ),
    unwrap_hf=_text_config, hf_weights=LLAMA_RULES,
)
VISION_MODEL_TYPES = frozenset(IDEFICS3.model_type_names)


def image_prompt(rows: int, cols: int, seq_len: int) -> str:
    """The text an `<image>` of a `rows` x `cols` tile grid (0 x 0: one global tile only)
    becomes in the prompt: each tile's `seq_len` placeholders behind its grid tag, then the
    global tile's (Idefics3Processor's layout, which the model was trained on)."""
    fake, image, glob = "<fake_token_around_image>", "<image>", "<global-img>"
    tail = f"{fake}{glob}{image * seq_len}{fake}"
    if rows == 0 and cols == 0:
        return tail
    grid = "".join(
        "".join(f"{fake}<row_{r + 1}_col_{c + 1}>{image * seq_len}" for c in range(cols)) + "\n"
        for r in range(rows)
    )
    return f"{grid}\n{tail}"
