"""The host-side form of a model every source loads into (`LoadedModel`), and the names the
loaders share. Kept apart from `converters.source` so that the checkpoint reader, which
`source` calls, does not import `source` back."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jengine.models import ModelConfig

CHECKPOINT_MARKER = "jengine_model.json"


@dataclasses.dataclass
class LoadedModel:
    """A model on the host: config, params in jengine layout, tokenizer, and its source."""

    config: ModelConfig
    # Or LazyParam (lazy HF), or {} (lazy checkpoint); a weight read as int8 (a pre-quantized
    # source, `converters.prequant`) is a host QArray of int8 values (or an int8 LazyParam).
    params: dict[str, np.ndarray]
    tokenizer: Any  # transformers.PreTrainedTokenizerFast
    source: str
    kind: str  # "gguf" | "hf" | "checkpoint" | "dummy" (config and tokenizer only)
    generation_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Of the weights as read: a checkpoint `jengine convert` quantized, a compressed-tensors int8
    # checkpoint, a GGUF's Q8_0 projections read as int8 for an int8 / w8a16 engine.
    quantization: str = "none"
    weights_note: str = ""  # one line: which stored formats are read as int8, which as float


def numpy_dtype(dtype: str) -> np.dtype:
    if dtype in ("float32", "f32"):
        return np.dtype(np.float32)
    if dtype in ("bfloat16", "bf16"):
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if dtype in ("float16", "f16"):
        return np.dtype(np.float16)
    raise ValueError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")
