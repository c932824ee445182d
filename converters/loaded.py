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
    params: dict[str, np.ndarray]  # or LazyParam (lazy HF), or {} (lazy checkpoint)
    tokenizer: Any  # transformers.PreTrainedTokenizerFast
    source: str
    kind: str  # "gguf" | "hf" | "checkpoint"
    generation_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    quantization: str = "none"  # of the stored weights (a checkpoint `jengine convert` quantized)


def numpy_dtype(dtype: str) -> np.dtype:
    if dtype in ("float32", "f32"):
        return np.dtype(np.float32)
    if dtype in ("bfloat16", "bf16"):
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if dtype in ("float16", "f16"):
        return np.dtype(np.float16)
    raise ValueError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")
