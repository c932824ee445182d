"""jengine: LLM inference and serving on JAX/XLA.

The public names load lazily, so that `import jengine.models` (used by the converters) does not
pull in the whole engine.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "jengine.engine",
    "AsyncEngine": "jengine.async_engine",
    "SamplingParams": "jengine.sampling_params",
    "StructuredOutputs": "jengine.sampling_params",
    "RequestOutput": "jengine.outputs",
    "CompletionOutput": "jengine.outputs",
    "PoolingParams": "jengine.pooling_params",
    "LoRARequest": "jengine.lora_request",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jengine' has no attribute {name!r}")
