"""Pre-quantized sources read as int8: HF compressed-tensors int8 checkpoints and GGUF Q8_0.

Both map onto jengine's own weight scheme (`jengine.models.quant`: int8 values, one float32
scale per output channel, no zero points) without a float copy of the weight:
- compressed-tensors (`quantization_config.quant_method: compressed-tensors`, format
  `int-quantized` or `naive-quantized`, which store the same int8 tensors): `<proj>.weight`
  int8 [out, in] and `<proj>.weight_scale` [out, 1] are our scheme exactly, taken as stored.
  Weight-only groups run as `w8a16`, groups with dynamic per-token int8 activations as `int8`.
- GGUF Q8_0 (32-wide blocks, each `d_b * q`): folded per output row onto the row's largest
  block scale, `s = max_b |d_b|`, `q' = round(q * d_b / s)`; exact for the blocks holding `s`
  and what quantizing the dequantized row would give (`quantize_weight`: its scale is the same
  `s` where a block reaches 127, as llama.cpp's and gguf-py's quantizers make every non-zero
  block do).
A param stacked over layers is int8 only when every one of its tensors is; an `Int8Tensor` is
one such tensor in HF's layout, on its way into the stacked param (a host `QArray` whose q is
int8 [param shape] and whose scale has the contracted axes of size 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from converters.errors import ModelLoadError
from converters.tables import Placement
from jengine.models.layers import ParamSpec
from jengine.models.quant import QArray, scale_shape
from jengine.models.quant4 import W4Groups

SCALE_SUFFIX = "_scale"  # `x.weight` -> `x.weight_scale`
_INT_FORMATS = ("int-quantized", "naive-quantized")


@dataclasses.dataclass(frozen=True)
class Int8Tensor:
    """One int8 tensor in HF's layout: `q * scale` approximates the float weight."""

    q: np.ndarray  # int8 [..., out, in]
    scale: np.ndarray  # float32 [..., out, 1]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape


@dataclasses.dataclass(frozen=True)
class W4Tensor:
    """One 4-bit tensor in HF's layout, from a GGUF's Q4_0 / Q4_1 / Q4_K blocks: `s * q + m`
    (per group of 32 along `in`) is the file's dequantized weight."""

    q: np.ndarray  # uint8 [..., out, in], values 0..15
    scale: np.ndarray  # float32 [..., out, in / 32]
    min: np.ndarray  # float32 [..., out, in / 32]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape


def empty_w4(spec: ParamSpec, alloc) -> W4Groups:
    """A host `W4Groups` to fill tensor by tensor: uint8 values of the param's shape, and its
    scales and mins [*lead, K / 32, N] (a layer weight: lead = the layer axis)."""
    lead = spec.contract[0]
    k = int(np.prod(spec.shape[lead:lead + len(spec.contract)]))
    n = int(np.prod(spec.shape[lead + len(spec.contract):]))
    groups = (*spec.shape[:lead], k // 32, n)
    return W4Groups(q=alloc(spec.shape, np.uint8), scale=alloc(groups, np.float32),
                    min=alloc(groups, np.float32), n_in=len(spec.contract))


def put_w4(param: W4Groups, target: Placement, w: W4Tensor, cfg) -> None:
    """One HF tensor's groups into the param at `target.index`: the values through the
    tensor's transform as a float weight's, the scales and mins repeated over their 32 `in`
    each, transformed alike, and read back at every 32nd of the contracted axes."""
    q = target.convert(w.q, cfg)
    k = int(np.prod(q.shape[:param.n_in]))
    param.q[target.index] = q
    for src, dst in ((w.scale, param.scale), (w.min, param.min)):
        wide = target.convert(np.repeat(src, 32, axis=-1), cfg)
        dst[target.index] = wide.reshape(k, -1)[::32]


def hf_quantization(hf: dict[str, Any]) -> str:
    """The mode an HF config's `quantization_config` stores its weights in: none (no such
    block), int8 (W8A8: int8 per-channel weights, dynamic per-token int8 activations) or w8a16
    (int8 per-channel weights alone).

    Raises:
      ModelLoadError: a quantization this reader does not map, named: another quant_method,
        formats other than int8 (pack-quantized 4-bit, float-quantized fp8, sparse), zero
        points, group/tensor/block strategies, static activation scales, output or KV cache
        quantization.
    """
    qc = hf.get("quantization_config")
    if not qc or qc.get("quant_method") == "mxfp4":  # dequantized as read: `converters.mxfp4`
        return "none"
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ModelLoadError(f"quantization_config quant_method {method!r} is not supported; "
                             "jengine reads compressed-tensors int8 per-channel checkpoints")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise ModelLoadError(f"compressed-tensors sparsity {sparsity.get('format')!r} is not "
                             "supported")
    if qc.get("kv_cache_scheme"):
        raise ModelLoadError("compressed-tensors kv_cache_scheme (a quantized KV cache) is not "
                             "supported")
    groups = qc.get("config_groups") or {}
    modes = {_group_mode(name, group, qc.get("format")) for name, group in groups.items()}
    if len(modes) != 1:
        raise ModelLoadError(f"compressed-tensors config_groups {sorted(groups)} must share one "
                             f"scheme (found {sorted(modes) or 'none'})")
    return modes.pop()


def _group_mode(name: str, group: dict[str, Any], default_format: str | None) -> str:
    fmt = group.get("format") or default_format
    if fmt not in _INT_FORMATS:
        raise ModelLoadError(f"compressed-tensors format {fmt!r} (group {name}) is not "
                             f"supported; only {' / '.join(_INT_FORMATS)} int8 weights map")
    weights = group.get("weights") or {}
    _check_args(name, "weights", weights, strategy="channel")
    if weights.get("dynamic"):
        raise ModelLoadError(f"compressed-tensors group {name}: dynamic weight scales are not "
                             "supported")
    if weights.get("actorder"):
        raise ModelLoadError(f"compressed-tensors group {name}: actorder (g_idx) is not "
                             "supported")
    if group.get("output_activations"):
        raise ModelLoadError(f"compressed-tensors group {name}: output_activations "
                             "quantization is not supported")
    acts = group.get("input_activations")
    if not acts:
        return "w8a16"
    _check_args(name, "input_activations", acts, strategy="token")
    if acts.get("dynamic") is not True:
        raise ModelLoadError(f"compressed-tensors group {name}: static input_activations "
                             "scales (input_scale) are not supported; only dynamic per-token "
                             "int8")
    return "int8"


def _check_args(group: str, kind: str, args: dict[str, Any], *, strategy: str) -> None:
    """ModelLoadError unless `args` are symmetric 8-bit int with `strategy`."""
    what = f"compressed-tensors group {group} {kind}"
    if args.get("type", "int") != "int" or args.get("num_bits") != 8:
        raise ModelLoadError(f"{what}: {args.get('num_bits')}-bit {args.get('type')} is not "
                             "supported; only 8-bit int")
    if not args.get("symmetric", True):
        raise ModelLoadError(f"{what}: asymmetric quantization (zero points) is not supported")
    if args.get("strategy") != strategy or args.get("group_size"):
        raise ModelLoadError(f"{what}: strategy {args.get('strategy')!r} is not supported; "
                             f"only {strategy!r}")


def scale_keys(keys: list[str]) -> dict[str, str]:
    """weight key -> its `_scale` key, for every weight of `keys` stored with one."""
    present = set(keys)
    return {key[:-len(SCALE_SUFFIX)]: key for key in keys
            if key.endswith(".weight" + SCALE_SUFFIX) and key[:-len(SCALE_SUFFIX)] in present}


def skipped(key: str) -> bool:
    """Keys of a compressed-tensors checkpoint that carry nothing a symmetric scheme reads."""
    return key.endswith(("weight_scale", "weight_zero_point"))


def int8_params(placed: list[tuple[list[Placement], bool]], specs: dict[str, ParamSpec],
                eligible: set[str] | None = None) -> tuple[set[str], set[str]]:
    """(params every tensor of which is int8, params mixing int8 and float tensors), from each
    tensor's placements and whether it is int8. With `eligible`, only those names count."""
    kinds: dict[str, set[bool]] = {}
    for targets, is_int8 in placed:
        for target in targets:
            kinds.setdefault(target.name, set()).add(is_int8)
    int8 = {n for n, k in kinds.items() if k == {True} and (eligible is None or n in eligible)}
    mixed = {n for n, k in kinds.items() if len(k) == 2}
    for name in int8:
        if not specs[name].contract:
            raise ModelLoadError(f"{name} is stored as int8, but jengine keeps it in float")
    return int8, mixed


def empty_int8(spec: ParamSpec, mode: str, alloc) -> QArray:
    """A host QArray to fill tensor by tensor (`alloc(shape, dtype)`): int8 values and float32
    scales."""
    return QArray(q=alloc(spec.shape, np.int8),
                  scale=alloc(scale_shape(spec.shape, spec.contract), np.float32), mode=mode)


def layer_scale(target: Placement, scale: np.ndarray, spec: ParamSpec) -> np.ndarray:
    """An HF scale [..., out, 1] -> the scale of the param at `target.index` (its block of a
    fused tensor): HF's output rows are the param's non-contracted axes, in order."""
    lead = len(target.index)
    if target.block is not None:
        scale = scale[(slice(None),) * target.transform.split_axis + (target.block,)]
    contract = tuple(a - lead for a in spec.contract)
    return np.asarray(scale, np.float32).reshape(scale_shape(spec.shape[lead:], contract))


def fold_q8_0(blocks: np.ndarray, shape: tuple[int, ...]) -> Int8Tensor:
    """GGUF Q8_0 blocks [n, 34] (f16 d, 32 x int8) of a tensor of `shape` [..., out, in] ->
    one scale per output row: s = max |d_b| over the row's blocks, q' = round(q * d_b / s)
    (in float32: q * d_b is exact, then one division, as `quantize_weight` divides)."""
    rows = int(np.prod(shape[:-1]))
    d = blocks[:, :2].copy().view("<f2").astype(np.float32).reshape(rows, -1)  # [rows, nb]
    q = blocks[:, 2:].view(np.int8).reshape(rows, d.shape[1], 32)
    top = np.abs(d).max(axis=1, keepdims=True)  # [rows, 1]
    scale = np.where(top > 0, top, np.float32(1.0))
    if np.array_equal(d, np.broadcast_to(scale, d.shape)):  # one scale a row already
        folded = q
    else:
        folded = np.round((q * d[:, :, None]) / scale[:, :, None])
        folded = np.clip(folded, -127, 127).astype(np.int8)
    return Int8Tensor(folded.reshape(shape), scale.reshape(*shape[:-1], 1))
