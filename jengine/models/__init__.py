"""Model families. Each family's record (`family.Family`) is listed in `registry.FAMILIES`;
`family_module(cfg)` gives the network it runs (`param_specs(cfg)`, `forward`, `logits`)."""

from __future__ import annotations

from jengine.models.attention import AttentionMetadata, KVCache
from jengine.models.config import ModelConfig, RopeConfig
from jengine.models.registry import family_module, layer_offsets, model_config_from_hf

__all__ = ["AttentionMetadata", "KVCache", "ModelConfig", "RopeConfig", "family_module",
           "layer_offsets", "model_config_from_hf"]
