"""HF safetensors params that read only the slices asked for (sharded loading).

`open_hf_params` checks every key and shape from the safetensors headers alone, then returns one
`LazyParam` per jengine param (for a compressed-tensors int8 checkpoint, a host `QArray` of an
int8 `LazyParam` and its scales, which are small and read now: `converters.prequant`).
Indexing a `LazyParam` with a device's shard index reads, for each layer in it, just the HF
slice that shard needs (`safe_open(...).get_slice(key)[rows, cols]`; the table transform says
which rows and columns: `Transform.source_index`), transforms it to jengine's layout and stacks
the layers. Every read is recorded in `LazyParam.reads`, so a test can assert that no device's
read exceeds its share of the tensor.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

import ml_dtypes  # noqa: F401 (registers bfloat16 with numpy, so bf16 safetensors can be sliced)
import numpy as np

from converters import mxfp4, prequant, tables
from converters.errors import ModelLoadError
from jengine.models import ModelConfig, family_module
from jengine.models.quant import QArray, scale_shape


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One tensor in a safetensors file, and the transform that brings it to jengine's layout."""

    handle: object  # safetensors safe_open(..., framework="numpy")
    key: str
    target: tables.Placement  # which param (and which block of a fused tensor) it fills
    nbytes: int  # of the whole tensor


class LazyParam:
    """One jengine param, stacked over layers (and experts), read from safetensors slice by
    slice.

    Array-like as far as loading needs: `shape`, `dtype`, `param[index]` (a tuple of slices, one
    per dim, as `jax.make_array_from_callback` passes them) reads only that slice, and
    `np.asarray(param)` reads it whole.
    """

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, cfg: ModelConfig,
                 lead: int, sources: list[HFTensor]):
        self.shape = shape
        self.dtype = dtype
        self.cfg = cfg
        # Leading axes that index HF tensors: 0, 1 (layers; also a layer's stacked experts),
        # 2 (layers, then one tensor per expert).
        self.lead = lead
        self.sources = sources  # one per leading index, in row-major order
        self.reads: dict[str, list[int]] = defaultdict(list)  # HF key -> bytes of each read

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index) -> np.ndarray:
        index = normalize_index(index, self.shape)
        if not self.lead:
            return self._read(self.sources[0], index)
        out = np.empty(tuple(s.stop - s.start for s in index), self.dtype)
        lead_shape = self.shape[:self.lead]
        for at in np.ndindex(*(s.stop - s.start for s in index[:self.lead])):
            source = np.ravel_multi_index(
                tuple(s.start + i for s, i in zip(index, at)), lead_shape)
            out[at] = self._read(self.sources[source], index[self.lead:])
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[tuple(slice(None) for _ in self.shape)]
        return whole if dtype is None else whole.astype(dtype)

    def _read(self, source: HFTensor, index: tuple[slice, ...]) -> np.ndarray:
        src_index, post = source.target.source_index(index, self.cfg.head_dim)
        w = source.handle.get_slice(source.key)[src_index]
        self.reads[source.key].append(w.nbytes)
        if self.dtype != np.int8:  # int8 values stay as stored (a pre-quantized checkpoint)
            w = np.asarray(w, dtype=np.float32)
        value = source.target.transform(w, self.cfg)[post]
        return value.astype(self.dtype)


def normalize_index(index, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """A shard index (slices, maybe open-ended, maybe fewer than dims) -> one
    `slice(start, stop)` per dim with concrete bounds; ValueError for strided slices."""
    if index is Ellipsis:
        index = ()
    index = tuple(index) if isinstance(index, tuple) else (index,)
    index = index + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape, strict=True):
        if not isinstance(s, slice):
            raise ValueError(f"expected slices, got {index}")
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided slice {s} is not supported")
        out.append(slice(start, max(start, stop)))
    return tuple(out)


def open_hf_params(cfg: ModelConfig, files: list[Path], dtype: np.dtype,
                   mode: str = "none") -> dict[str, LazyParam | QArray]:
    """One `LazyParam` per param of `cfg` over the safetensors `files`; reads no tensor data
    but the scales of a pre-quantized checkpoint (`mode` int8 | w8a16: its weights with a
    `weight_scale` become `QArray`s of `mode`).

    Raises:
      ModelLoadError: a file is unreadable, a key fits nothing or has the wrong shape, some
        param (or some layer of it) has no tensor, or mixes int8 and float tensors.
    """
    from safetensors import safe_open

    specs = family_module(cfg).param_specs(cfg)
    handles, headers = {}, {}
    for file in files:
        try:
            handle = mxfp4.wrap(safe_open(str(file), framework="numpy"))
            # An empty read gives the dtype without touching any data.
            for key in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                handles[key] = handle
                headers[key] = (tuple(handle.get_slice(key).get_shape()),
                                handle.get_slice(key)[0:0].dtype)
        except Exception as e:
            raise ModelLoadError(f"corrupt or truncated safetensors file {file}: {e}") from e
    scales = prequant.scale_keys(list(headers)) if mode != "none" else {}
    found: dict[str, dict[tuple[int, ...], HFTensor]] = defaultdict(dict)
    placed = []
    for key, (shape, dt) in headers.items():
        if mode != "none" and prequant.skipped(key):
            continue
        if key in scales and dt != np.int8:
            raise ModelLoadError(f"{key} has a weight_scale but is stored as {dt}, not int8")
        targets = tables.place(cfg, specs, key, shape)
        placed.append((targets, key in scales))
        for target in targets:
            nbytes = int(np.prod(shape)) * dt.itemsize
            found[target.name][target.index] = HFTensor(handles[key], key, target, nbytes)
    tables.check_complete(cfg, specs, {(n, i) for n, found_at in found.items()
                                       for at in found_at for i in tables.covered(specs[n], at)})
    int8, mixed = prequant.int8_params(placed, specs)
    if mixed:
        raise ModelLoadError(f"{', '.join(sorted(mixed))} mix int8 and float layers; jengine "
                             "reads a param as int8 only when every layer of it is")
    params = {}
    for name, spec in specs.items():
        lead = len(next(iter(found[name])))
        sources = [found[name][tuple(int(j) for j in i)] for i in np.ndindex(*spec.shape[:lead])]
        if name not in int8:
            params[name] = LazyParam(spec.shape, dtype, cfg, lead, sources)
            continue
        scale = np.empty(scale_shape(spec.shape, spec.contract), np.float32)
        for s in sources:
            stored = handles[scales[s.key]].get_tensor(scales[s.key])
            scale[s.target.index] = prequant.layer_scale(s.target, stored, spec)
        q = LazyParam(spec.shape, np.dtype(np.int8), cfg, lead, sources)
        params[name] = QArray(q=q, scale=scale, mode=mode)
    return params
