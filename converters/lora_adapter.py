"""PEFT LoRA adapters -> host arrays in jengine's layout (NumPy only: no torch at run time).

A PEFT directory holds `adapter_config.json` (r, lora_alpha, use_rslora, target_modules, ...)
and `adapter_model.safetensors` with, per targeted Linear, `...layers.{i}.{module}.lora_A.weight`
[r, in] and `lora_B.weight` [out, r]. `load_adapter` checks every tensor against the model's
declared weights and returns, per layer and target, `a` [*in, r] and `b` [r, *out] with the
scale (lora_alpha / r, or / sqrt(r) under rsLoRA) folded into `b`, so that the step computes
`(x @ a) @ b`. What is not built is a `ModelLoadError` (a ValueError) naming it: DoRA,
embedding or lm_head adapters, `modules_to_save`, per-module rank or alpha patterns.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from converters.errors import ModelLoadError
from jengine.models import ModelConfig, family_module
from jengine.models.lora import target_shapes

# HF module name -> the jengine projections it feeds (a fused module feeds several: its `A` is
# shared, its `B` rows split in the order listed, as the base weight's rows are).
MODULES = {
    "q_proj": ("wq",), "k_proj": ("wk",), "v_proj": ("wv",), "o_proj": ("wo",),
    "gate_proj": ("w_gate",), "up_proj": ("w_up",), "down_proj": ("w_down",),
    "qkv_proj": ("wq", "wk", "wv"), "gate_up_proj": ("w_gate", "w_up"),
}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F64": np.float64}


@dataclasses.dataclass
class Adapter:
    """One adapter on the host: `layers[i][target] = (a [*in, r], b [r, *out])` float32, the
    scale folded into `b`."""

    path: str
    rank: int
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.layers for a, b in layer.values())


def load_adapter(path: str | Path, cfg: ModelConfig, max_rank: int) -> Adapter:
    """Reads and checks a PEFT LoRA directory for a model of `cfg`.

    Raises:
      ModelLoadError: a missing or corrupt file, a rank over `max_rank`, a tensor whose shape
        does not fit this model (named), or a feature that is not built (named).
    """
    path = Path(path)
    config = _read_config(path)
    _check_supported(config)
    rank = int(config.get("r", 8))
    if rank > max_rank:
        raise ModelLoadError(f"adapter {path} has rank {rank}, over max_lora_rank {max_rank} "
                             "(raise --max-lora-rank)")
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    if cfg.padded_heads:
        raise ModelLoadError("LoRA adapters on a model whose query heads are padded for tp are "
                             "not built")
    shapes = target_shapes(family_module(cfg).param_specs(cfg))
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]] = [{} for _ in range(cfg.num_layers)]
    tensors = _read_safetensors(path / "adapter_model.safetensors")
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise ModelLoadError(f"adapter tensor {key!r} is not a LoRA A/B weight of a layer's "
                                 "attention or MLP projection (embedding, lm_head and other "
                                 "adapters are not built)")
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in MODULES:
            raise ModelLoadError(f"adapter tensor {key!r}: module {module!r} is not built "
                                 f"(LoRA targets: {', '.join(MODULES)})")
        if layer >= cfg.num_layers:
            raise ModelLoadError(f"adapter tensor {key!r}: layer {layer} but the model has "
                                 f"{cfg.num_layers} layers (an adapter for another base?)")
        pairs.setdefault((layer, module), {})[which] = (key, value)
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ModelLoadError(f"adapter {path}: layer {layer} {module} lacks lora_"
                                 f"{'B' if 'A' in ab else 'A'}")
        for target, (a, b) in _convert(module, ab, shapes, rank, scale).items():
            layers[layer][target] = (a, b)
    return Adapter(str(path), rank, layers)


def _convert(module: str, ab: dict, shapes: dict, rank: int,
             scale: float) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """One module's HF pair -> {target: (a [*in, r], b [r, *out])}, every shape checked."""
    (a_key, a), (b_key, b) = ab["A"], ab["B"]
    targets = MODULES[module]
    missing = [t for t in targets if t not in shapes]
    if missing:
        raise ModelLoadError(f"adapter tensor {a_key!r}: this model has no {missing[0]} "
                             "projection to adapt (MoE experts are not built)")
    ins = shapes[targets[0]][0]
    outs = [shapes[t][1] for t in targets]
    out_rows = sum(math.prod(o) for o in outs)
    if a.ndim != 2 or a.shape != (rank, math.prod(ins)):
        raise ModelLoadError(f"adapter tensor {a_key!r} has shape {list(a.shape)}; this model "
                             f"needs [{rank}, {math.prod(ins)}] (an adapter for another base?)")
    if b.ndim != 2 or b.shape != (out_rows, rank):
        raise ModelLoadError(f"adapter tensor {b_key!r} has shape {list(b.shape)}; this model "
                             f"needs [{out_rows}, {rank}] (an adapter for another base?)")
    a32 = np.ascontiguousarray(a.astype(np.float32).T.reshape(*ins, rank))
    b32 = b.astype(np.float32) * np.float32(scale)
    out, start = {}, 0
    for target, shape in zip(targets, outs):
        rows = math.prod(shape)
        out[target] = (a32, np.ascontiguousarray(b32[start:start + rows].T.reshape(rank, *shape)))
        start += rows
    return out


def _read_config(path: Path) -> dict:
    file = path / "adapter_config.json"
    if not path.is_dir():
        raise ModelLoadError(f"LoRA adapter directory {path} does not exist")
    if not file.is_file():
        raise ModelLoadError(f"{path} has no adapter_config.json (not a PEFT adapter)")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"corrupt adapter_config.json in {path}: {e}") from e
    if not isinstance(config, dict):
        raise ModelLoadError(f"corrupt adapter_config.json in {path}: not an object")
    return config


def _check_supported(config: dict) -> None:
    """Raises for every PEFT feature the step does not compute."""
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ModelLoadError(f"peft_type {kind!r} is not built (LoRA only)")
    if config.get("use_dora"):
        raise ModelLoadError("DoRA adapters (use_dora) are not built")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    for name in ("embed_tokens", "lm_head"):
        if name in targets:
            raise ModelLoadError(f"{name} adapters are not built (target_modules has {name})")
    if config.get("modules_to_save"):
        raise ModelLoadError(f"modules_to_save {config['modules_to_save']} is not built (a "
                             "full copy of those weights per adapter)")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ModelLoadError(f"per-module ranks or alphas ({key}) are not built")


def _read_safetensors(file: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file (float32, float16 or bfloat16) as NumPy."""
    if not file.is_file():
        raise ModelLoadError(f"{file.parent} has no adapter_model.safetensors")
    data = file.read_bytes()
    try:
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + size])
        base = 8 + size
        out = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            dtype = _DTYPES.get(info["dtype"])
            if dtype is None:
                raise ModelLoadError(f"adapter tensor {key!r} has dtype {info['dtype']}; "
                                     "expected F32, F16 or BF16")
            start, end = info["data_offsets"]
            if base + end > len(data) or end - start != math.prod(info["shape"]) * np.dtype(
                    dtype).itemsize:
                raise ValueError(f"tensor {key!r} runs past the file's end")
            out[key] = np.frombuffer(data, dtype, offset=base + start,
                                     count=math.prod(info["shape"])).reshape(info["shape"])
    except ModelLoadError:
        raise
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise ModelLoadError(f"corrupt or truncated safetensors file {file}: {e}") from e
    return out
