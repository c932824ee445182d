"""Model families. `family_module(cfg)` gives the module with `param_specs(cfg)` and `forward`."""

from __future__ import annotations

from types import ModuleType

from jengine.models import gemma3, llama
from jengine.models.attention import AttentionMetadata, KVCache
from jengine.models.config import ModelConfig, RopeConfig

_FAMILIES: dict[str, ModuleType] = {"llama": llama, "gemma3": gemma3}


def family_module(cfg: ModelConfig) -> ModuleType:
    return _FAMILIES[cfg.family]


__all__ = ["AttentionMetadata", "KVCache", "ModelConfig", "RopeConfig", "family_module"]
