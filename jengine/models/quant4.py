"""4-bit group-quantized projection weights (`quantization: w4a16`), and their dot.

Why: a decode step reads every weight once, so its pace is the weight bytes; 4-bit values with
a float32 scale and min per group of 32 are 0.75 bytes a weight (f32: 4, bf16: 2, int8: 1). The
form `w[k, n] = s[k // 32, n] * q[k, n] + m[k // 32, n]`, q in 0..15, with groups along the
contracted axis K, is the one GGUF Q4_0 / Q4_1 / Q4_K and AWQ / GPTQ int4 share.

A `W4Array` keeps the weight packed as the native kernel reads it (`cpu_kernels.w4_matmul`:
tile-major, contracted axes merged into K and output axes into N), with its float shape as
static fields, so the model code sees the weight it declared. On CPU with the native matmul
backend its dots run the kernel; everywhere else (GPU, TPU, `matmul_backend: xla`) the weight is
dequantized in jnp and multiplied in float32: the reference the kernel is tested against.

Weights are quantized at load time from the float weights, per group asymmetric: m = the
group's min, s = (max - min) / 15, q = round((w - m) / s). A GGUF Q4_1 block (whose values span
q = 0..15, as llama.cpp's quantizer makes them) comes back with the same q, and s, m within
float rounding of the file's d, m.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jengine import cpu_info
from jengine.cpu_kernels import w4_matmul as cpu_w4

GROUP = cpu_w4.GROUP


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class W4Array:
    """A 4-bit weight of float shape (*lead, *in_shape, *out_shape), packed per leading index
    (a stacked layer axis) as `cpu_w4.pack` lays out its [K, N] = [prod(in), prod(out)] form."""

    q: jax.Array  # uint8 [*lead, ceil(N / 64), K / 32, 16, 64]
    scale: jax.Array  # f32 [*lead, ceil(N / 64), K / 32, 64]
    min: jax.Array  # f32, as scale
    in_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})  # contracted axes
    out_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})

    @property
    def lead(self) -> tuple[int, ...]:
        return tuple(self.q.shape[:-4])

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.lead, *self.in_shape, *self.out_shape)

    @property
    def dtype(self):
        return jnp.float32

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float weight [*lead, *in_shape, *out_shape]."""
        n = math.prod(self.out_shape)

        def one(q, s, m):
            return cpu_w4.dequantize(q, s, m, n, dtype)

        f = one
        for _ in self.lead:
            f = jax.vmap(f)
        return f(self.q, self.scale, self.min).reshape(self.shape)

    def merged(self, n: int) -> W4Array:
        """The first `n` contracted axes merged into one (free: K is merged already)."""
        return dataclasses.replace(self, in_shape=(math.prod(self.in_shape[:n]),
                                                   *self.in_shape[n:]))


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [K, N] float (K a multiple of 32) -> (q uint8 [K, N] in 0..15, s, m f32 [K / 32, N]).

    A constant group gets s = 0 (q = 0, every value m)."""
    k, n = w.shape
    groups = np.asarray(w, np.float32).reshape(k // GROUP, GROUP, n)
    lo, hi = groups.min(axis=1), groups.max(axis=1)
    s = (hi - lo) / np.float32(15)
    safe = np.where(s > 0, s, np.float32(1))
    q = np.clip(np.rint((groups - lo[:, None]) / safe[:, None]), 0, 15).astype(np.uint8)
    return q.reshape(k, n), s.astype(np.float32), lo.astype(np.float32)


def from_float(w: np.ndarray, n_in: int, n_lead: int = 0) -> W4Array:
    """A float weight [*lead, *in, *out] (its `n_in` axes after `n_lead` leading ones
    contracted) as a host `W4Array`.

    Raises:
      ValueError: the contracted size is not a multiple of 32.
    """
    k, n = _kn(w.shape, n_in, n_lead)
    lead = w.shape[:n_lead]
    parts = [quantize(np.asarray(w[i]).reshape(k, n)) for i in np.ndindex(*lead)]
    return _packed(parts, w.shape, n_in, n_lead)


@dataclasses.dataclass
class W4Groups:
    """A host 4-bit weight read from a source's own blocks (a GGUF's Q4_0 / Q4_1 / Q4_K,
    `converters.gguf_reader.four_bit_groups`), filled tensor by tensor, then `packed`."""

    q: np.ndarray  # uint8 [*lead, *in, *out], values 0..15
    scale: np.ndarray  # f32 [*lead, K / 32, N]: in and out axes merged
    min: np.ndarray  # f32, as scale
    n_in: int  # the contracted axes (after the leading ones)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    def packed(self) -> W4Array:
        n_lead = self.scale.ndim - 2
        k, n = _kn(self.q.shape, self.n_in, n_lead)
        parts = [(self.q[i].reshape(k, n), self.scale[i], self.min[i])
                 for i in np.ndindex(*self.q.shape[:n_lead])]
        return _packed(parts, self.q.shape, self.n_in, n_lead)


def _kn(shape: tuple[int, ...], n_in: int, n_lead: int) -> tuple[int, int]:
    k = math.prod(shape[n_lead:n_lead + n_in])
    if k % GROUP:
        raise ValueError(f"quantization w4a16 needs the contracted size to be a multiple of "
                         f"{GROUP} (groups of {GROUP} along it), got {k} for a weight of shape "
                         f"{shape}; use w8a16 or int8 for this model")
    return k, math.prod(shape[n_lead + n_in:])


def _packed(parts: list, shape: tuple[int, ...], n_in: int, n_lead: int) -> W4Array:
    """(q [K, N], s, m [K / 32, N]) per leading index -> a host W4Array of float `shape`."""
    lead = shape[:n_lead]
    packs = [cpu_w4.pack(*p) for p in parts]
    q, s, m = (np.stack([p[j] for p in packs]).reshape(*lead, *packs[0][j].shape)
               for j in range(3))
    return W4Array(q=q, scale=s, min=m, in_shape=tuple(shape[n_lead:n_lead + n_in]),
                   out_shape=tuple(shape[n_lead + n_in:]))


# The most rows the float (W4A16) paths of the native kernel take, by activation dtype; beyond,
# the weight is dequantized to x's dtype for XLA's dot. Measured (30 SmolLM2 w_gate-shaped
# layers, 2-core Xeon with AMX, shared): bf16 rows at 32 / 64 / 256 took 38 / 71 / 258 ms on the
# kernel (compute-bound past a few rows: 3 rows a pass) against 26 / 11 / 40 ms dequantized to
# bf16 on XLA's AMX dot; f32 rows at 32 / 64 / 256: 18 / 39 / 132 ms against XLA f32's 32 / 30 /
# 104. The W4A8 path (VNNI) takes up to VNNI_AMX_ROWS rows on a CPU with AMX-BF16 and every
# row count elsewhere: on 30 layers of SmolLM2's 7 projections (experiments/w4_matmul_bench.py,
# 2 cores shared) it took 620 ms at 128 rows against 1,367 dequantized to bf16 for XLA's AMX
# dot, 3,045 against 2,624 at 512 (docs/quantization.md, "W4A8 on VNNI").
NATIVE_ROWS = {jnp.dtype(jnp.bfloat16): 16, jnp.dtype(jnp.float32): 32}
VNNI_AMX_ROWS = 256


def native_rows(dtype) -> int | None:
    """The most rows of `dtype` the native kernel takes here (None: any)."""
    if cpu_w4.best_isa() in ("avx512_vnni", "avx_vnni"):
        return VNNI_AMX_ROWS if "amx_bf16" in cpu_info.flags() else None
    return NATIVE_ROWS.get(jnp.dtype(dtype), 0)


def dot(eq: str, x: jax.Array, w: W4Array, native: bool) -> jax.Array:
    """`einsum(eq, x, w)` in float32. `native` (the caller checked: CPU, a `kn` product of a
    2-D x, the library loaded): the kernel on the packed weight up to `native_rows` rows, else
    the weight dequantized to x's dtype in XLA's dot (a prefill chunk);
    not `native`: the reference, the dequantized weight in a float32 einsum."""
    if native and not w.lead:
        most = native_rows(x.dtype)
        if most is None or x.shape[0] <= most:
            y = cpu_w4.w4_matmul(x.astype(jnp.float32), w.q, w.scale, w.min,
                                 math.prod(w.out_shape))
            return y.reshape(x.shape[0], *w.out_shape)
        return jnp.einsum(eq, x, w.dequantize(x.dtype), preferred_element_type=jnp.float32)
    return jnp.einsum(eq, x.astype(jnp.float32), w.dequantize(),
                      precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
