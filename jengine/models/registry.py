"""Every model family jengine runs, in one tuple, and the lookups by name that the config
readers, the converters, the supported-models table and `jengine info` use.

Adding a family is its record (`jengine.models.family.Family`, in its own file) plus one line
here; tests/models/test_family_registry.py checks that no HF `model_type` or GGUF architecture is
claimed twice and that every record is reached by its names.
"""

from __future__ import annotations

from typing import Any

from jengine.models import llama_variants as lv
from jengine.models.config import ModelConfig
from jengine.models.deepseek import DEEPSEEK_V2
from jengine.models.family import Family, Network
from jengine.models.gemma3 import GEMMA2, GEMMA3
from jengine.models.gemma4 import GEMMA4
from jengine.models.glm4_moe import GLM4_MOE
from jengine.models.gpt_oss import GPT_OSS
from jengine.models.granite4 import GRANITE4
from jengine.models.hf_config import config_from_hf
from jengine.models.idefics3 import IDEFICS3
from jengine.models.llama4 import LLAMA4
from jengine.models.nemotron_h import NEMOTRON_H
from jengine.models.qwen2_5_vl import QWEN2_5_VL
from jengine.models.qwen3_5 import QWEN3_5
from jengine.models.qwen3_next import QWEN3_NEXT
from jengine.models.qwen3_vl import QWEN3_VL

FAMILIES: tuple[Family, ...] = (
    lv.LLAMA, lv.MISTRAL, lv.MIXTRAL, lv.QWEN2, lv.QWEN3, lv.QWEN2_MOE, lv.QWEN3_MOE,
    lv.GRANITE, lv.GRANITEMOE, lv.PHI3, lv.OLMO2, lv.EXAONE4, lv.SMOLLM3, lv.SEED_OSS,
    GEMMA3, GEMMA2, GEMMA4, IDEFICS3, QWEN2_5_VL, QWEN3_VL,
    DEEPSEEK_V2, GLM4_MOE, LLAMA4, QWEN3_5, QWEN3_NEXT, GRANITE4, NEMOTRON_H,
    GPT_OSS,
)


def _index(pairs: list[tuple[str, Family]], what: str) -> dict[str, Family]:
    """name -> family; ValueError on a name two families claim (the first would win silently)."""
    out: dict[str, Family] = {}
    for name, family in pairs:
        if name in out:
            raise ValueError(f"{what} {name!r} is claimed by families {out[name].name!r} and "
                             f"{family.name!r}")
        out[name] = family
    return out


BY_MODEL_TYPE = _index([(t, f) for f in FAMILIES for t in f.model_type_names], "model_type")
BY_GGUF_ARCH = _index([(a, f) for f in FAMILIES for a, _ in f.gguf_archs], "GGUF architecture")


def family_of(cfg: ModelConfig) -> Family:
    return BY_MODEL_TYPE[cfg.model_type]


def family_module(cfg: ModelConfig) -> Network:
    """The network `cfg` runs: its `param_specs(cfg)`, `forward`, `logits`, `layer_keys`."""
    return family_of(cfg).network


def layer_offsets(cfg: ModelConfig) -> dict[str, int | tuple[int, ...]]:
    """Every layer weight that stacks fewer than all layers: its first layer (DeepSeek's MoE
    weights start after its dense layers), or the layers it stacks, in order, where they are
    not one run (a hybrid's mixers: `Network.layer_ordinals`); {} for the families whose
    layers are all alike."""
    network = family_module(cfg)
    offsets: dict[str, int | tuple[int, ...]] = {}
    if network.layer_offsets:
        offsets.update(network.layer_offsets(cfg))
    if network.layer_ordinals:
        offsets.update(network.layer_ordinals(cfg))
    return offsets


def stacked_index(cfg: ModelConfig, name: str, layer: int) -> int:
    """Where layer `layer`'s slice of weight `name` sits on its leading axis (`layer_offsets`);
    -1 for a layer the weight does not stack."""
    held = layer_offsets(cfg).get(name, 0)
    if isinstance(held, int):
        return layer - held
    return held.index(layer) if layer in held else -1


def gguf_family(arch: str) -> tuple[Family, str]:
    """(the family, the model_type its files read as) of a GGUF architecture.

    Raises:
      KeyError: an architecture no family reads.
    """
    family = BY_GGUF_ARCH[arch]
    return family, dict(family.gguf_archs)[arch]


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Builds the config from an HF `config.json` dict (transformers 4.x or 5.x layout).

    Raises:
      ValueError: an architecture, rope scaling or MoE layout jengine does not run.
    """
    family = BY_MODEL_TYPE.get(hf.get("model_type"))
    if family is None:
        archs = hf.get("architectures") or []
        raise ValueError(f"unsupported architecture {hf.get('model_type')!r} {archs}; jengine "
                         f"supports {sorted(BY_MODEL_TYPE)}")
    if family.unwrap_hf:
        hf = family.unwrap_hf(hf)
        family = BY_MODEL_TYPE[hf["model_type"]]
    return family.read_hf(hf) if family.read_hf else config_from_hf(hf, family)
