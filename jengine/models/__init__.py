"""Model families. `family_module(cfg)` gives the module with `param_specs(cfg)` and `forward`."""

from __future__ import annotations

from types import ModuleType

from jengine.models import deepseek, gemma3, llama
from jengine.models.attention import AttentionMetadata, KVCache
from jengine.models.config import ModelConfig, RopeConfig
from jengine.models.hf_config import model_config_from_hf

_FAMILIES: dict[str, ModuleType] = {"llama": llama, "gemma3": gemma3, "deepseek": deepseek}


def family_module(cfg: ModelConfig) -> ModuleType:
    return _FAMILIES[cfg.family]


def layer_offsets(cfg: ModelConfig) -> dict[str, int]:
    """The first layer of every layer weight that stacks fewer than all layers (DeepSeek's MoE
    weights start after its dense layers); {} for the families whose layers are all alike."""
    offsets = getattr(family_module(cfg), "layer_offsets", None)
    return offsets(cfg) if offsets else {}


__all__ = ["AttentionMetadata", "KVCache", "ModelConfig", "RopeConfig", "family_module",
           "layer_offsets", "model_config_from_hf"]
