"""`Family`: one record per model family, everything jengine knows about it in one value.

A family is what one HF `model_type` (or a few that share every switch) needs: the network it
runs (`Network`: the model file's parameter specs and forward), how its `config.json` and its
GGUF header become a `ModelConfig`, and how its HF and GGUF weights map to that network's
params. Each record lives in the file that implements it (`llama.py`'s network serves the
variants of `llama_variants.py`; `gemma3.py`, `deepseek.py` hold their own), and
`jengine.models.registry.FAMILIES` lists them all: the config readers, the converters, the
README's supported-models table and `jengine info` read that one tuple.

Hooks are typed fields that default to None (the generic behaviour); nothing here is found by
probing a module for attributes. The weight rules are plain data (`weight_rules.Rule`) that
`converters.tables` applies: the models layer never imports the converters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from jengine.models.config import ModelConfig
from jengine.models.layers import ParamSpec
from jengine.models.weight_rules import Rule


class GGUFHeader(Protocol):
    """What a family's GGUF hook reads of an opened file (`converters.gguf_file.GGUFModel`)."""

    arch: str
    path: Path

    def get(self, key: str, default: Any = None) -> Any:
        """The metadata value `{arch}.{key}`."""

    def has_tensor(self, name: str) -> bool: ...

    def tensor_values(self, name: str) -> np.ndarray | None:
        """The tensor dequantized to float32, None where the file has no such tensor."""


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Network:
    """A model file's pure functions: the weights it declares and the step it runs."""

    name: str  # the model file (`jengine/models/{name}.py`), as `jengine info` shows it
    param_specs: Callable[[ModelConfig], dict[str, ParamSpec]]
    forward: Callable[..., Any]  # (params, cfg, kv, md, *, all_logits, head) -> (out, kv)
    logits: Callable[..., Any]  # (params, cfg, hidden [S, E]) -> float32 logits [S, V]
    layer_keys: tuple[str, ...]  # the per-layer weights `layers.unstack_layers` splits
    # Where int8 smoothing may fold its factors (`smoothing.NormFold` / `ChannelFold`s, in
    # order; None: nowhere, the weights stay as they are).
    smoothing_folds: Callable[[ModelConfig], tuple[Any, ...]] | None = None
    # The first layer of every weight stacking fewer than all layers (DeepSeek's MoE weights).
    layer_offsets: Callable[[ModelConfig], dict[str, int]] | None = None
    # The layers each weight stacking only some layers holds, in order, where they are not one
    # run (a hybrid's attention and linear-attention weights interleave): name -> layers
    # (`registry.layer_offsets` merges them with `layer_offsets`).
    layer_ordinals: Callable[[ModelConfig], dict[str, tuple[int, ...]]] | None = None
    # (params, cfg, hidden [N, E]) -> the final norm's output [N, E], what an embedding pools;
    # None: RMSNorm by `final_norm` (Llama's); Gemma scales by 1 + weight.
    final_norm: Callable[..., Any] | None = None
    # Whether `forward` reads the fused `w_qkv` / `w_gate_up` (`jengine.models.fused`) where a
    # layer holds them instead of the separate weights.
    fused_projections: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelType:
    """One HF `model_type` a family serves, with its row of the supported-models table."""

    name: str
    features: str
    # in tests/models/test_models_parity.py, test_deepseek.py, test_deepseek_v3.py,
    # test_gemma4.py, test_glm4_moe.py, test_gpt_oss.py, test_idefics3.py, test_qwen2_5_vl.py,
    # test_qwen3_5.py, test_qwen3_vl.py, test_granite4.py, test_nemotron_h.py or
    # test_qwen3_next.py
    parity_test: str | None = None
    # How GGUF files reach this type when no architecture maps to it by name (Mixtral is
    # llama.cpp's `llama` with experts).
    gguf_note: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Family:
    """Everything about one model family; see the module docstring."""

    name: str
    network: Network
    model_types: tuple[ModelType, ...]

    # HF config.json -> ModelConfig (`jengine.models.hf_config.config_from_hf` reads the keys
    # every family shares, then applies these).
    switches: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # fixed fields
    # (HF config, the fields read so far) -> the fields this family reads from keys of its own.
    hf_fields: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None
    # The whole reader, for a family that shares none of the generic keys' meanings.
    read_hf: Callable[[dict[str, Any]], ModelConfig] | None = None
    # The text model's config of a checkpoint that wraps it (multimodal Gemma 3).
    unwrap_hf: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # (HF config, layers) -> where the window applies when `layer_types` does not say
    # (None: every layer).
    default_sliding: Callable[[dict[str, Any], int], tuple[bool, ...]] | None = None
    sliding_window_flag: bool = False  # the window applies only with `use_sliding_window`
    tied_by_default: bool = False  # the HF config class's `tie_word_embeddings` default

    # HF weights: the rules the converters apply (first match wins); `hf_weights_for` instead
    # where the transforms depend on the config (DeepSeek's head widths).
    hf_weights: tuple[Rule, ...] = ()
    hf_weights_for: Callable[[ModelConfig], tuple[Rule, ...]] | None = None

    # GGUF files: (llama.cpp architecture, the model_type its files read as).
    gguf_archs: tuple[tuple[str, str], ...] = ()
    # (file, HF config dict so far) -> the HF fields this architecture's own keys give.
    gguf_config: Callable[[GGUFHeader, dict[str, Any]], None] | None = None
    # llama.cpp block tensor names of this family's own, or named otherwise than the shared
    # table (`converters.gguf_file`): base name -> HF name.
    gguf_tensor_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # llama.cpp tensors an HF checkpoint holds as one, their rows interleaved (gpt-oss's expert
    # gate and up): first base name -> (second base name, HF name of the joined tensor).
    gguf_interleaved: Mapping[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    gguf_permuted_qk: bool = False  # llama.cpp's LlamaModel converter permuted q/k rows
    gguf_norm_offset: float = 0.0  # norms stored as (offset + w) (Gemma's 1 + w)

    @property
    def model_type_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.model_types)

    def weight_rules(self, cfg: ModelConfig) -> tuple[Rule, ...]:
        """The HF key -> param rules for `cfg`, in the order they are tried."""
        return self.hf_weights_for(cfg) if self.hf_weights_for else self.hf_weights
