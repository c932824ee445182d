"""HF checkpoint key -> jengine param, one table per family, with the transform each needs.

HF stores projections as torch Linear weights `[out, in]`; jengine stores them input-first with
heads split out (`wq: [L, E, H, D]`), stacked over layers. Every tensor's shape is asserted
against the model's `ParamSpec` before it is placed.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from jengine.models.config import ModelConfig

Transform = Callable[[np.ndarray, ModelConfig], np.ndarray]


def _same(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return w


def _t(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return w.T


def _q_in(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:  # [H*D, E] -> [E, H, D]
    return w.T.reshape(cfg.hidden_size, cfg.num_heads, cfg.head_dim)


def _kv_in(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:  # [K*D, E] -> [E, K, D]
    return w.T.reshape(cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim)


def _q_bias(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return w.reshape(cfg.num_heads, cfg.head_dim)


def _kv_bias(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return w.reshape(cfg.num_kv_heads, cfg.head_dim)


def _o_in(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:  # [E, H*D] -> [H, D, E]
    return w.T.reshape(cfg.num_heads, cfg.head_dim, cfg.hidden_size)


_LAYER = r"model\.layers\.(\d+)\."

_COMMON: list[tuple[str, str, Transform]] = [
    (r"model\.embed_tokens\.weight", "embed", _same),
    (r"model\.norm\.weight", "final_norm", _same),
    (_LAYER + r"input_layernorm\.weight", "attn_norm", _same),
    (_LAYER + r"self_attn\.q_proj\.weight", "wq", _q_in),
    (_LAYER + r"self_attn\.k_proj\.weight", "wk", _kv_in),
    (_LAYER + r"self_attn\.v_proj\.weight", "wv", _kv_in),
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
        (_LAYER + r"self_attn\.q_proj\.bias", "bq", _q_bias),
        (_LAYER + r"self_attn\.k_proj\.bias", "bk", _kv_bias),
        (_LAYER + r"self_attn\.v_proj\.bias", "bv", _kv_bias),
        (_LAYER + r"self_attn\.o_proj\.bias", "bo", _same),
        (_LAYER + r"mlp\.gate_proj\.bias", "b_gate", _same),
        (_LAYER + r"mlp\.up_proj\.bias", "b_up", _same),
        (_LAYER + r"mlp\.down_proj\.bias", "b_down", _same),
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
