"""A vision model's image tower read from its HF checkpoint (the text model loads through
`converters.source` like any other; its tables skip these keys)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from converters.errors import ModelLoadError
from jengine.models import idefics3


def load_vision(path: str | Path) -> tuple[idefics3.VisionConfig, dict[str, np.ndarray]]:
    """(its VisionConfig, the tower's and connector's params as float32 NumPy).

    Raises:
      ModelLoadError: no safetensors, or a tower weight missing or misshapen.
    """
    from safetensors import safe_open

    path = Path(path)
    vc = idefics3.vision_config_from_hf(json.loads((path / "config.json").read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors files in {path}")

    def tensors():
        for file in files:
            with safe_open(str(file), framework="numpy") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    if "vision_model." in key or "connector." in key:
                        yield key, f.get_tensor(key)

    try:
        return vc, idefics3.params_from_hf(vc, tensors())
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
