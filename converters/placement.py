"""Placement: every device receives its slice of every weight, read on its own.

It lives with the readers (not in `jengine.sharding`) because it is their other half: it reads
through their lazy sources and restores their checkpoints; the shardings it is given come from
`jengine.sharding.ShardingRules`, which it never imports.

`load_params_sharded` takes what `load_source(..., lazy=True)` gives and the target shardings:
- HF safetensors: each distinct shard index is read once, from the safetensors slices it needs
  (`LazyParam`), and put on the devices that hold it; no tensor is materialized whole on the
  host unless it is replicated.
- GGUF: tensors were dequantized whole on the host (ggml blocks do not slice along heads); they
  are placed shard by shard the same way.
- Converted (Orbax) checkpoints: restored straight onto the shardings (`restore_params`).
- Pre-quantized weights (a host `QArray`: compressed-tensors int8, GGUF Q8_0 read as int8): the
  int8 values shard like the float weight would, the scales like their output channels.
Q heads padded for tp (`padded_config`) read as zeros: `ZeroPadded` cuts a shard index at the
real heads, so the padding is never read from the source.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from converters.lazy import normalize_index
from converters.loaded import LoadedModel
from jengine.models import ModelConfig, family_module
from jengine.models.layers import ParamSpec
from jengine.models.quant import QArray, scale_shape, scale_sharding
from jengine.models.quant4 import W4Groups
from jengine.progress import progress_bar


class ZeroPadded:
    """`base` (any array-like with shape/dtype/[index]) zero-padded at the end of one axis."""

    def __init__(self, base, axis: int, size: int):
        self.base = base
        self.axis = axis
        self.shape = tuple(size if i == axis else n for i, n in enumerate(base.shape))
        self.dtype = base.dtype

    def __getitem__(self, index) -> np.ndarray:
        index = normalize_index(index, self.shape)
        out = np.zeros(tuple(s.stop - s.start for s in index), self.dtype)
        cut = index[self.axis]
        real = slice(cut.start, min(cut.stop, self.base.shape[self.axis]))
        if real.stop > real.start:
            part = index[:self.axis] + (real,) + index[self.axis + 1:]
            dest = [slice(None)] * len(index)
            dest[self.axis] = slice(0, real.stop - real.start)
            out[tuple(dest)] = self.base[part]
        return out


def load_params_sharded(
    loaded: LoadedModel,
    cfg: ModelConfig,
    shardings: dict[str, jax.sharding.Sharding] | None,
    dtype: str,
    *,
    progress: bool = False,
) -> dict[str, jax.Array]:
    """`loaded`'s params on their devices, each device's slice read on its own.

    Args:
      loaded: from `load_source(..., lazy=True)` (eager numpy params work too).
      cfg: the config the params are for, after q-head padding (`padded_config`); its param
        specs give the target shapes.
      shardings: param name -> sharding; None puts every param whole on the default device.
      dtype: the param dtype (float32 | bfloat16 | float16), used to restore checkpoints.
    """
    if loaded.kind == "checkpoint":
        from converters.checkpoint import restore_params

        return restore_params(Path(loaded.source), cfg, shardings, dtype)
    specs = family_module(cfg).param_specs(cfg)
    out = {}
    for name, spec in progress_bar(specs.items(), desc="loading weights", enabled=progress,
                                   unit="param", leave=False):
        sharding = shardings[name] if shardings is not None else None
        source = loaded.params[name]
        if isinstance(source, QArray):
            out[name] = _place_int8(source, spec, sharding)
        elif isinstance(source, W4Groups):  # packed on the host by quantize_params_w4
            out[name] = source
        else:
            out[name] = _place_padded(source, spec.shape, sharding)
    return out


def _place_padded(source, shape: tuple[int, ...], sharding) -> jax.Array:
    source = _pad_to(source, shape)
    if sharding is None:
        return jax.device_put(np.asarray(source[...]))
    return place(source, sharding)


def _place_int8(source: QArray, spec: ParamSpec, sharding) -> QArray:
    """A host QArray on the devices: q sharded as the float weight, the scale as its output
    channels (padded q heads get zero values and zero scales, as a checkpoint restores them)."""
    scales = None if sharding is None else scale_sharding(sharding, len(spec.shape),
                                                          spec.contract)
    return QArray(q=_place_padded(source.q, spec.shape, sharding),
                  scale=_place_padded(source.scale, scale_shape(spec.shape, spec.contract),
                                      scales),
                  mode=source.mode)


def place(source, sharding: jax.sharding.Sharding) -> jax.Array:
    """One global array from `source[index]` per addressable device; devices that hold the same
    slice (replicated axes) share one read."""
    shape = tuple(source.shape)
    reads: dict[tuple[tuple[int, int], ...], np.ndarray] = {}
    arrays = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        bounds = tuple((s.start, s.stop) for s in normalize_index(index, shape))
        if bounds not in reads:
            reads[bounds] = np.asarray(source[index])
        arrays.append(jax.device_put(reads[bounds], device))
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _pad_to(source, shape: tuple[int, ...]):
    """`source` as is, or zero-padded along the one (q-head) axis where `shape` is larger."""
    if tuple(source.shape) == shape:
        return source
    grown = [i for i, (a, b) in enumerate(zip(source.shape, shape, strict=True)) if a != b]
    if len(grown) != 1 or source.shape[grown[0]] > shape[grown[0]]:
        raise ValueError(f"cannot pad a {tuple(source.shape)} param to {shape}")
    return ZeroPadded(source, grown[0], shape[grown[0]])


def to_device_params(
    params: dict[str, np.ndarray], shardings: dict[str, jax.sharding.Sharding] | None = None
) -> dict[str, jax.Array]:
    """Host params -> device arrays. With shardings, each device receives only its own slice
    (`make_array_from_callback`), so no device ever holds a whole tensor it does not own."""
    if shardings is None:
        return {k: jnp.asarray(v) for k, v in params.items()}
    return {
        k: jax.make_array_from_callback(v.shape, shardings[k], lambda index, v=v: v[index])
        for k, v in params.items()
    }
