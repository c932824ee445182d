"""Weight quantization at load time, and the dots that read quantized weights in the step.

Why: a decode step reads every weight once, so on a memory-bound step the weight bytes set the
pace; int8 weights are 4x fewer bytes than float32. With `int8` (W8A8) the activations are
quantized too, inside the step, and the dot runs int8 x int8 -> int32, which XLA:CPU hands to
VNNI/AMX units where the CPU has them (4-6x its float32 dot; ~1.1x on AVX2 only).

The scheme is symmetric, with no zero points:
- weights: one scale per output channel, `max |w|` over the axes the dot contracts / 127
  (`ParamSpec.contract` names those axes), so each output column uses its own int8 range;
- activations (`int8` only): one scale per token row, `max |x|` over the row / 127, computed
  in the jitted step from the live values (no calibration data);
- the int32 accumulator is exact, then rescaled in float32 by `s_x[t] * s_w[out]`.

A `QArray` keeps the scale with the contracted axes present as size 1 (`[L, 1, H, D]` for a
stacked `wq [L, E, H, D]`), so slicing out a layer (`lax.scan`, `unstack_layers`) slices the
scale with it and the scale always broadcasts against the weight it belongs to. Under tensor
parallelism the scale is sharded like its output channels (its size-1 axes replicated).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jengine.models import quant4
from jengine.models.quant4 import W4Array

MODES = ("none", "int8", "w8a16", "fp8", "w4a16", "auto")
# The float oracle of `int8`: the same quantized operands, dequantized and multiplied in float32.
INT8_REFERENCE = "int8_ref"
_INT8_MAX = 127.0
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def resolve_quantization(mode: str, platform: str, tp: int = 1) -> str:
    """Checks a `quantization` setting against the platform and tensor parallelism (before any
    weight loads); `auto` is resolved later, from the source (`converters.auto_quantization`).

    Raises:
      ValueError: an unknown mode, fp8 on a platform without fp8 dots (CPU), or w4a16 under
        tensor parallelism (its 32-wide groups along the contracted axis are not split over
        shards).
    """
    if mode not in MODES:
        raise ValueError(f"unsupported quantization {mode!r}; use one of {', '.join(MODES)}")
    if mode == "w4a16" and tp > 1:
        raise ValueError(f"quantization w4a16 runs on one device (tp=1), not tp={tp}: its "
                         "4-bit weights are not sharded; use w8a16 or int8 under tensor "
                         "parallelism")
    if mode == "fp8" and platform == "cpu":
        raise ValueError("quantization fp8 needs a GPU or TPU (XLA:CPU has no fp8 dots); "
                         "use int8 or w8a16 on CPU")
    return mode


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QArray:
    """A quantized weight: `q * scale` approximates the float weight it replaced."""

    q: jax.Array  # int8 (float8_e4m3fn for fp8), the float weight's shape, e.g. [E, H, D]
    scale: jax.Array  # f32, the weight's shape with contracted axes of size 1, e.g. [1, H, D]
    mode: str = dataclasses.field(metadata={"static": True})  # int8 | w8a16 | fp8 | int8_ref

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    @property
    def dtype(self):
        return self.q.dtype

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.q.astype(jnp.float32) * self.scale).astype(dtype)


def quantize_weight(w: jax.Array, contract: tuple[int, ...], mode: str) -> QArray:
    """Per-output-channel symmetric quantization of `w` over its `contract` axes.

    An all-zero channel (the zero q heads padded in for tp) gets scale 1, so it stays zero.
    """
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=contract, keepdims=True)
    top = _FP8_MAX if mode == "fp8" else _INT8_MAX
    scale = jnp.where(amax > 0, amax / top, 1.0)
    if mode == "fp8":
        q = jnp.clip(w32 / scale, -top, top).astype(jnp.float8_e4m3fn)
    else:
        q = jnp.clip(jnp.round(w32 / scale), -top, top).astype(jnp.int8)
    return QArray(q=q, scale=scale, mode=mode)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row (per-token) symmetric int8: x [T, K] -> (int8 [T, K], f32 scale [T, 1])."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / _INT8_MAX, 1.0)
    q = jnp.clip(jnp.round(x32 / scale), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
    return q, scale


def einsum(eq: str, x: jax.Array, w: QArray) -> jax.Array:
    """`jnp.einsum(eq, x, w)` in float32 for a quantized `w` and a 2-D `x` [T, K].

    The equation must keep `x`'s token axis first and `w`'s output axes in their order, as
    every projection here does ("te,ehd->thd", "tk,ke->te", "te,ve->tv"), so the per-channel
    scale (its size-1 axes dropped) lines up with the output's trailing axes.

    A single row is padded to two: XLA:CPU runs a one-row int8 (or int8-weight) dot by
    converting the whole weight to float on every call (profiled: the converts took ~85% of a
    batch-1 SmolLM2 step, 7x the float step), while from two rows on it calls its int8 kernels.
    """
    if x.shape[0] == 1:
        return _einsum(eq, jnp.concatenate([x, jnp.zeros_like(x)]), w)[:1]
    return _einsum(eq, x, w)


def _einsum(eq: str, x: jax.Array, w: QArray) -> jax.Array:
    if w.mode == "int8":
        xq, sx = quantize_rows(x)
        acc = jnp.einsum(eq, xq, w.q, preferred_element_type=jnp.int32)  # exact
        return _rescale(acc.astype(jnp.float32), sx, w.scale)
    if w.mode == INT8_REFERENCE:
        xq, sx = quantize_rows(x)
        return jnp.einsum(eq, xq.astype(jnp.float32) * sx, w.dequantize(),
                          precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)
    # Weight-only (w8a16, fp8): the weight converts to the activation dtype inside the dot
    # (exact: int8 and e4m3 values are representable in bfloat16), the scale applies after.
    y = jnp.einsum(eq, x, w.q.astype(x.dtype), preferred_element_type=jnp.float32)
    return _rescale(y, None, w.scale)


def _rescale(y: jax.Array, row_scale: jax.Array | None, channel_scale: jax.Array) -> jax.Array:
    """y [T, out...] * row_scale [T, 1] * channel_scale (the out axes, with size-1 axes)."""
    out = channel_scale.reshape(y.shape[1:])
    if row_scale is not None:
        y = y * row_scale.reshape((y.shape[0],) + (1,) * (y.ndim - 1))
    return y * out


def merge_input_axes(w: jax.Array | QArray | W4Array, n: int) -> jax.Array | QArray | W4Array:
    """Merges the first `n` (contracted) axes of a weight into one: [H, D, E] -> [H*D, E]."""
    if isinstance(w, W4Array):
        return w.merged(n)
    if not isinstance(w, QArray):
        return w.reshape((-1,) + w.shape[n:])
    return QArray(q=w.q.reshape((-1,) + w.q.shape[n:]),
                  scale=w.scale.reshape((1,) + w.scale.shape[n:]), mode=w.mode)


def take_rows(table: jax.Array | QArray, ids: jax.Array) -> jax.Array:
    """Rows of an embedding table [V, E] (quantized per row when it doubles as the lm_head)."""
    if not isinstance(table, QArray):
        return table[ids]
    return table.q[ids].astype(jnp.float32) * table.scale[ids]  # [T, E] * [T, 1]


def quantized_names(specs: dict, tied_embeddings: bool, lm_head: bool) -> list[str]:
    """The params a quantized model stores as `QArray`s: every declared projection (a spec
    with `contract` axes), the output head only with `lm_head`."""
    head = "embed" if tied_embeddings else "lm_head"
    return [name for name, spec in specs.items()
            if spec.contract and (lm_head or name != head)]


def quantize_params(params: dict[str, jax.Array | QArray], specs: dict, mode: str, *,
                    tied_embeddings: bool, lm_head: bool = False,
                    delete_float: bool = False) -> dict[str, jax.Array | QArray]:
    """Stacked params (as loaded, on their shardings) -> the same dict with the projections
    as `QArray`s of `mode`. Each int8 tensor keeps its float weight's sharding; each scale is
    sharded like the output channels it scales. Weights restored quantized (a converted
    checkpoint) are kept as stored and only take `mode`. `delete_float` frees every float
    weight once quantized, so loading peaks at the float weights, not more."""
    stored = {name for name, w in params.items() if isinstance(w, QArray)}
    if mode == "none" and not stored:
        return params
    out = dict(params)
    names = set(quantized_names(specs, tied_embeddings, lm_head)) | stored
    for name in (n for n in specs if n in names):
        w = params[name]
        if isinstance(w, QArray):
            out[name] = _with_mode(w, mode, name)
            continue
        contract = specs[name].contract
        quantize = jax.jit(
            lambda w, contract=contract: quantize_weight(w, contract, mode),
            out_shardings=_shardings(w, contract, mode),
        )
        out[name] = quantize(w)
        if delete_float:
            w.delete()
    return out


# The layer weights `w4a16` stores as 4-bit groups: each reaches `dot` as a projection whose
# leading axes (after the layer axis) are contracted, in every family that declares it.
W4_PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def quantize_params_w4(params: dict[str, jax.Array | QArray], specs: dict, *,
                       tied_embeddings: bool) -> dict[str, jax.Array | QArray | W4Array]:
    """Stacked params (as loaded, on one device) -> `w4a16`: the layer projections of
    W4_PROJECTIONS as `W4Array`s (quantized on the host, each float weight freed once done);
    every other projection and the output head as `w8a16` int8 (the head's bytes are a third of
    a 135M model's: left float, they would set the step's pace); weights read as int8 or 4-bit
    groups from the source (a GGUF's Q8_0, Q4_x: `W4Groups`) keep the source's values."""
    read = {name for name, w in params.items() if isinstance(w, quant4.W4Groups)}
    w4 = read | {name for name in W4_PROJECTIONS
                 if name in specs and isinstance(params.get(name), jax.Array)
                 and specs[name].contract == tuple(range(1, 1 + len(specs[name].contract)))}
    rest = {name: spec for name, spec in specs.items() if name not in w4}
    out = quantize_params(params, rest, "w8a16", tied_embeddings=tied_embeddings, lm_head=True,
                          delete_float=True)
    device = jax.devices()[0]
    for name in (n for n in specs if n in read):  # a source's own 4-bit blocks
        out[name] = jax.device_put(params[name].packed(), device)
    for name in (n for n in specs if n in w4 - read):
        w = params[name]
        packed = quant4.from_float(np.asarray(w.astype(jnp.float32)),
                                   len(specs[name].contract), n_lead=1)
        out[name] = jax.device_put(packed, device)
        w.delete()
    return out


def _with_mode(w: QArray, mode: str, name: str) -> QArray:
    """A stored QArray run as `mode`: int8 values serve int8 (W8A8) and w8a16 alike."""
    int8_modes = ("int8", "w8a16", INT8_REFERENCE)
    if (w.q.dtype == jnp.int8) != (mode in int8_modes):
        raise ValueError(f"{name} is stored as {w.q.dtype} and cannot run as {mode!r}")
    return QArray(q=w.q, scale=w.scale, mode=mode)


def _shardings(w: jax.Array, contract: tuple[int, ...], mode: str) -> QArray | None:
    """(q, scale) shardings for `w`'s QArray, in the output's tree shape; None (let XLA
    choose) off a mesh."""
    sharding = getattr(w, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    return QArray(q=sharding, scale=scale_sharding(sharding, w.ndim, contract), mode=mode)


def scale_shape(shape: tuple[int, ...], contract: tuple[int, ...]) -> tuple[int, ...]:
    """The scale's shape for a weight of `shape`: its contracted axes become size 1."""
    return tuple(1 if axis in contract else n for axis, n in enumerate(shape))


def scale_sharding(sharding: jax.sharding.NamedSharding, ndim: int,
                   contract: tuple[int, ...]) -> jax.sharding.NamedSharding:
    """The weight's sharding without the mesh axes of its contracted (size-1) axes."""
    spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
    kept = [None if axis in contract else s for axis, s in enumerate(spec)]
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*kept))


def weight_bytes(params) -> int:
    """Bytes of every array in a param tree (quantized or not)."""
    return int(sum(np.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(params)))
