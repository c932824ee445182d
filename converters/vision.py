"""A vision model's image tower read from its HF checkpoint (the text model loads through
`converters.source` like any other; its tables skip these keys)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from converters.errors import ModelLoadError
from jengine.models import idefics3, qwen2_5_vl, qwen3_vl

# model_type -> (the family's vision module, whether a key belongs to its tower)
_TOWERS = {
    "idefics3": (idefics3, lambda key: "vision_model." in key or "connector." in key),
    "smolvlm": (idefics3, lambda key: "vision_model." in key or "connector." in key),
    "qwen2_5_vl": (qwen2_5_vl, lambda key: key.startswith(("visual.", "model.visual."))),
    "qwen3_vl": (qwen3_vl, lambda key: key.startswith(("visual.", "model.visual."))),
}


def load_vision(path: str | Path) -> tuple[Any, dict[str, np.ndarray]]:
    """(its VisionConfig, the tower's and connector's params as float32 NumPy), by the
    checkpoint's `model_type` (idefics3 / smolvlm, qwen2_5_vl, qwen3_vl).

    Raises:
      ModelLoadError: no safetensors, or a tower weight missing or misshapen.
    """
    from safetensors import safe_open

    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    if hf.get("model_type") not in _TOWERS:
        raise ModelLoadError(f"{path}: no image tower for model_type {hf.get('model_type')!r}")
    module, is_tower = _TOWERS[hf["model_type"]]
    vc = module.vision_config_from_hf(hf)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors files in {path}")

    def tensors():
        for file in files:
            with safe_open(str(file), framework="numpy") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    if is_tower(key):
                        yield key, f.get_tensor(key)

    try:
        return vc, module.params_from_hf(vc, tensors())
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
