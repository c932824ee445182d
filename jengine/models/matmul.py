"""Which kernel runs a projection's dot: XLA's einsum, the native small-row kernel, the
native W8A8 kernel, or over bf16 weights packed for the AMX tiles at load time the AMX kernel
(jengine.cpu_kernels.matmul) or, on a CPU without AMX, the packed-bf16 one
(jengine.cpu_kernels.packed_bf16: AVX-512-BF16, AVX-512F or AVX2), chosen per shape, weight
dtype and CPU at trace time; `dot` is the one entry point the model code calls."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jengine import cpu_info
from jengine.cpu_kernels import int8_matmul as cpu_int8
from jengine.cpu_kernels import matmul as cpu_matmul
from jengine.cpu_kernels import packed_bf16
from jengine.cpu_kernels import w4_matmul as cpu_w4
from jengine.models import quant, quant4
from jengine.models.quant import QArray
from jengine.models.quant4 import W4Array


@dataclasses.dataclass(frozen=True)
class Observed:
    """A float weight whose dots report their input `x` [T, K] to `seen` (at trace time).

    Only calibration (`jengine.models.smoothing`) builds these, inside its own jitted function,
    to learn each projection's per-input-channel activation range; the step never sees one."""

    w: jax.Array
    seen: Callable[[jax.Array], None]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape

    def reshape(self, *shape) -> Observed:
        return Observed(self.w.reshape(*shape), self.seen)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AmxPacked:
    """A bf16 projection weight in the AMX tiles' layout (`cpu_matmul.amx_tiles` of its
    [K, out...] form, the contracted axes merged into K; of a tied embedding's transpose),
    which only `cpu_matmul.amx_matmul` reads, or off AMX `packed_bf16.packed_matmul` (and
    `packed_rows`, the embedding's gather); or
    an `int8` (W8A8) one's int8 values and scales, which `cpu_int8.amx_int8_matmul` reads.
    Packed once at load time (`pack_projections`), so that a call reads the tiles straight from
    memory instead of repacking the weight (docs/kernels.md, "AMX bf16 projections")."""

    tiles: jax.Array  # bf16 [ceil(N / 32), ceil(K / 32), 2, 16, 32]; int8: [.., K / 64, 2, 16, 64]
    k: int = dataclasses.field(metadata={"static": True})
    out_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})  # N's axes
    # The tiles of w.T: the weight is [N, K], a tied embedding [V, E] as the output head.
    transposed: bool = dataclasses.field(default=False, metadata={"static": True})
    # An `int8` (W8A8) weight's column scales [N] f32 (its tiles `amx_int8_tiles`), else None.
    scale: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.out_shape, self.k) if self.transposed else (self.k, *self.out_shape)

    @property
    def dtype(self):
        return self.tiles.dtype


Weight = jax.Array | QArray | W4Array | AmxPacked  # float, quantized, or packed for AMX

# The layer weights `pack_projections` packs: every one reaches `dot` as a `kn` projection
# (its leading axes contracted) in the families that declare it.
AMX_PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")

MATMUL_BACKENDS = ("auto", "xla", "native", "amx")
# The row counts (the step's token bucket) the native kernel takes; XLA's dot keeps the rest.
# Measured in-program (docs/engine.md, "Small-row matmul"): for an f32 weight the kernel streams
# 1-2 rows faster than XLA (each thread a contiguous run of whole weight rows), except a tied
# embedding as the output head at one row ([N, K] contracted over K), which XLA's one-row dot
# streams as fast (NT_NATIVE_ROWS); from NATIVE_ROWS[1] + 1 rows on XLA's blocked GEMM wins.
# A bf16 or int8 (w8a16) weight is 2x / 4x fewer bytes for the kernel, while XLA:CPU converts
# it to f32 on every call (10x its f32 dot at one row), so the kernel takes those from one row
# up to NARROW_NATIVE_ROWS[1].
# On a CPU with AMX-BF16, XLA:CPU runs a bf16 x bf16 -> f32 dot on the tiles (2-4.5x its f32
# rate, measured 2026-12-03 on a Xeon), so with bf16 activations the kernel keeps only what it
# still streams faster: a bf16 weight up to AMX_BF16_NATIVE_ROWS[1] rows (alone XLA took
# 0.3x the kernel's time at 64 rows, 0.13x for the tied head, 0.6-1.0x at 8, yet the 8-row
# step ran 12% faster on the kernel), an int8 (w8a16) one up to AMX_INT8_WEIGHT_NATIVE_ROWS[1]
# (XLA 0.5x at 64, 1.7-1.8x at 8).
NATIVE_ROWS = (1, 32)
NT_NATIVE_ROWS = (2, 32)
NARROW_NATIVE_ROWS = (1, 64)
AMX_BF16_NATIVE_ROWS = (1, 8)
AMX_INT8_WEIGHT_NATIVE_ROWS = (1, 16)
INT8_NATIVE_ROWS = 128  # from this many rows an `int8` projection runs the native W8A8 kernel


def resolve_matmul_backend(backend: str, platform: str, tp: int) -> str:
    """`auto` -> `amx` (the native kernels, and bf16 projections packed for the AMX kernel)
    on one CPU device with AMX-BF16, `native` (jengine.cpu_kernels.matmul) on other
    CPUs when the library loaded, else `xla`. XLA cannot partition the custom calls, so a tp
    mesh keeps XLA's dot, and so do accelerators; `native` or `amx` there is an error, and so
    is `amx` on a CPU without it. `amx` packs only a bf16 model's float projections."""
    if backend not in MATMUL_BACKENDS:
        raise ValueError(f"unknown matmul_backend {backend!r}; expected one of {MATMUL_BACKENDS}")
    if backend in ("native", "amx"):
        if platform != "cpu" or tp > 1:
            raise ValueError(f"matmul_backend {backend!r} runs on CPU without tensor "
                             f"parallelism (here: platform {platform}, tp={tp})")
        cpu_matmul.require()
        if backend == "amx" and not cpu_matmul.amx_available():
            raise ValueError("matmul_backend 'amx' needs a CPU with AMX-BF16 (and a kernel "
                             "granted the tile state); use auto or native here")
        return backend
    if backend == "xla":
        return backend
    if platform != "cpu" or tp != 1 or not cpu_matmul.available():
        return "xla"
    return "amx" if cpu_matmul.amx_available() else "native"


# The packed-bf16 kernel's paths that pay off AMX: its portable C++ path is far slower than
# XLA's dot, so a CPU with none of these keeps the bf16 weights as they are.
PACKED_BF16_ISAS = ("avx512_bf16", "avx512", "avx2")


def packs_bf16(backend: str) -> bool:
    """Whether a bf16 model's projections and head are packed at load (`pack_projections`)
    under the resolved `backend`: `amx`, or `native` on a CPU without AMX (a `native` chosen
    on an AMX CPU keeps the small-row kernel and XLA's dots) whose packed-bf16 kernel runs a
    vector path (AVX-512-BF16 without AMX: VDPBF16PS; AVX-512F or AVX2: f32 FMA). Off AMX,
    XLA:CPU's bf16 dot runs at a fraction of its f32 rate, and decode rows stream half the
    bytes of f32 (docs/kernels.md, "bf16 projections without AMX")."""
    if backend == "amx":
        return True
    return (backend == "native" and cpu_matmul.available() and not cpu_matmul.amx_available()
            and packed_bf16.available() and packed_bf16.best_isa() in PACKED_BF16_ISAS)


def pack_projections(params: dict, specs: dict, *, amx: bool = True) -> dict:
    """`params` (unstacked: `params["layers"]` a tuple of per-layer dicts) with every bf16
    layer projection of AMX_PROJECTIONS (and every `int8` one, where the CPU has AMX-INT8),
    and the output head (`lm_head` [E, V], or a tied
    `embed` [V, E] as the tiles of its transpose), as an `AmxPacked` (packed on the host, each
    float weight freed once packed). `specs` are the stacked declarations: a layer weight's
    contracted axes follow the layer axis. `amx=False` (the `native` backend off AMX) packs
    the bf16 weights for the packed-bf16 kernel, and the `int8` ones for the VNNI kernel
    (`cpu_int8.vnni_int8_matmul`, the same tiles) where the CPU has AVX-512 VNNI."""
    int8 = cpu_int8.amx_int8_available() if amx else (
        not cpu_int8.amx_int8_available() and cpu_int8.vnni_int8_available())
    layers = []
    for layer in params["layers"]:
        out = dict(layer)
        for name in AMX_PROJECTIONS:
            w, spec = layer.get(name), specs.get(name)
            # A weight that declares no contracted axes is not a projection to pack.
            if (spec is None or not spec.contract
                    or spec.contract != tuple(range(1, 1 + len(spec.contract)))):
                continue
            if _packable(w):
                out[name] = _packed(w, len(spec.contract))
            elif int8 and isinstance(w, QArray) and w.mode == "int8":
                out[name] = _packed_int8(w, len(spec.contract))
        layers.append(out)
    out = {**params, "layers": tuple(layers)}
    head = "lm_head" if "lm_head" in params else "embed"
    contract = specs[head].contract if head in specs else ()
    if _packable(params.get(head)) and contract in ((0,), (1,)):
        out[head] = _packed(params[head], 1, transposed=contract == (1,))
    return out


def _packable(w) -> bool:
    return isinstance(w, jax.Array) and w.dtype == jnp.bfloat16


def _packed(w: jax.Array, n_in: int, transposed: bool = False) -> AmxPacked:
    """w [in..., out...] (its first n_in axes contracted), or a 2-D [N, K] `transposed`, packed
    for the AMX kernel; w is freed."""
    host = np.asarray(w)
    host = host.T if transposed else host.reshape(int(np.prod(w.shape[:n_in])), -1)
    out_shape = tuple(w.shape[:1]) if transposed else tuple(w.shape[n_in:])
    packed = AmxPacked(tiles=jax.device_put(cpu_matmul.amx_tiles(host), w.sharding),
                       k=host.shape[0], out_shape=out_shape, transposed=transposed)
    w.delete()
    return packed


def _packed_int8(w: QArray, n_in: int) -> AmxPacked:
    """An `int8` weight [in..., out...] (its first n_in axes contracted) packed for
    `amx_int8_matmul`, with its column scales; w is freed."""
    host = np.asarray(w.q)
    host = host.reshape(int(np.prod(w.shape[:n_in])), -1)
    packed = AmxPacked(tiles=jax.device_put(cpu_int8.amx_int8_tiles(host), w.q.sharding),
                       k=host.shape[0], out_shape=tuple(w.shape[n_in:]),
                       scale=w.scale.reshape(-1))
    w.q.delete()
    return packed


def packed_rows(table: AmxPacked, ids: jax.Array) -> jax.Array:
    """Rows `ids` [T] of a tied embedding packed as the output head: [T, E] bf16."""
    return cpu_matmul.amx_columns(table.tiles, ids, table.k)


def _native_operand(x: jax.Array, w: Weight, form: str
                    ) -> tuple[jax.Array, jax.Array | None] | None:
    """The weight array the native kernel reads for `x @ w` in `form` (`_native_form`) and the
    per-channel scale to apply to its f32 result (a w8a16 weight), or None where XLA's dot
    keeps the product."""
    if isinstance(w, QArray):
        if w.mode != "w8a16":
            return None
        operand, scale = w.q, w.scale
    else:
        operand, scale = w, None
    if x.dtype not in (jnp.float32, jnp.bfloat16) or x.ndim != 2:
        return None
    if operand.dtype == jnp.float32 and x.dtype == jnp.float32:
        lo, hi = NT_NATIVE_ROWS if form == "nk" else NATIVE_ROWS
    elif operand.dtype in (jnp.bfloat16, jnp.int8):
        lo, hi = NARROW_NATIVE_ROWS
        if x.dtype == jnp.bfloat16 and "amx_bf16" in cpu_info.flags():
            lo, hi = AMX_BF16_NATIVE_ROWS if operand.dtype == jnp.bfloat16 \
                else AMX_INT8_WEIGHT_NATIVE_ROWS
    else:
        return None
    return (operand, scale) if lo <= x.shape[0] <= hi else None


def _native_int8(x: jax.Array, w: Weight, form: str) -> bool:
    """Whether the native W8A8 kernel (cpu_int8.int8_matmul) takes this `int8` product: a
    projection (`kn`) of at least INT8_NATIVE_ROWS rows on a VNNI CPU without AMX-INT8 (where
    XLA's int8 dot runs on the tiles at 1.4-2.1 TOP/s on two cores, 2-3x the kernel's rate:
    docs/kernels.md).

    Alone, with the weights streamed from DRAM, the kernel was 1.0-1.8x as fast as XLA's int8
    dot at 1 to 64 rows (experiments/int8_matmul_bench.py); inside a decode step it lost (steps
    1.4-1.8x as long at 1 and 8 rows, 1.03-1.24x at 64): each call hands half its work to a
    pool thread, while XLA runs its single-threaded small dots side by side (q/k/v, gate/up)
    with no handoff. Prefill
    chunks gain (0.89-0.97x the step). The tied output head (`nk`) stays on XLA: packing
    w^T costs more than the kernel saves there."""
    return (isinstance(w, QArray) and w.mode == "int8" and form == "kn" and x.ndim == 2
            and x.shape[0] >= INT8_NATIVE_ROWS and cpu_int8.int8_isa() == "avx512_vnni"
            and "amx_int8" not in cpu_info.flags())


def _int8_dot(x: jax.Array, w: QArray) -> jax.Array:
    """`quant.einsum` of an `int8` projection by the native kernel: the same per-row quantized
    x, int32 sums and rescale, so the same floats."""
    xq, sx = quant.quantize_rows(x)
    y = cpu_int8.int8_matmul(xq, sx, w.q.reshape(w.q.shape[0], -1), w.scale)
    return y.reshape(x.shape[0], *w.q.shape[1:])


def _native_form(eq: str) -> str | None:
    """How the native kernel takes `eq` for a 2-D x [R, K]: "kn" (w's leading axis contracted,
    `te,ehd->thd`), "nk" (w [N, K]'s last, `te,ve->tv`: a tied embedding as the output head),
    or None (XLA's einsum)."""
    lhs, rest = eq.split(",")
    rhs, out = rest.split("->")
    if len(lhs) != 2:
        return None
    if rhs[0] == lhs[1] and out == lhs[0] + rhs[1:]:
        return "kn"
    if len(rhs) == 2 and rhs[1] == lhs[1] and out == lhs[0] + rhs[0]:
        return "nk"
    return None


def swiglu(x: jax.Array, w_gate: Weight, w_up: Weight, backend: str = "xla") -> jax.Array:
    """The SwiGLU activation silu(x @ w_gate) * (x @ w_up) [T, F] in x's dtype: both products
    rounded to it, the activation in f32 rounded once, as torch computes a bf16 model's. Two
    AMX-packed weights run it in one kernel call (`cpu_matmul.amx_swiglu`, or
    `amx_int8_swiglu` for `int8` ones: neither product goes to memory); others as two `dot`s
    and an elementwise pass."""
    if (isinstance(w_gate, AmxPacked) and isinstance(w_up, AmxPacked) and x.ndim == 2
            and x.dtype == jnp.bfloat16 and w_gate.shape == w_up.shape and not w_gate.transposed
            and not w_up.transposed and w_gate.scale is None and w_up.scale is None):
        n = int(np.prod(w_gate.out_shape))
        if not cpu_matmul.amx_available():
            return packed_bf16.packed_swiglu(x, w_gate.tiles, w_up.tiles, n)
        return cpu_matmul.amx_swiglu(x, w_gate.tiles, w_up.tiles, n)
    if (isinstance(w_gate, AmxPacked) and isinstance(w_up, AmxPacked) and x.ndim == 2
            and x.dtype == jnp.bfloat16 and w_gate.scale is not None and w_up.scale is not None
            and w_gate.tiles.shape == w_up.tiles.shape and cpu_int8.amx_int8_available()):
        xq, sx = quant.quantize_rows(x)
        return cpu_int8.amx_int8_swiglu(xq, sx, (w_gate.tiles, w_gate.scale),
                                          (w_up.tiles, w_up.scale), int(np.prod(w_gate.out_shape)))
    eq = "te,ef->tf"
    gate = dot(eq, x, w_gate, backend, rounded_to=x.dtype).astype(x.dtype)
    up = dot(eq, x, w_up, backend, rounded_to=x.dtype).astype(x.dtype)
    return jax.nn.silu(gate.astype(jnp.float32)).astype(x.dtype) * up


def dot(eq: str, x: jax.Array, w: Weight, backend: str = "xla", *,
        rounded_to=None) -> jax.Array:
    """`einsum(eq, x, w)` accumulated and returned in float32; a quantized `w` runs its
    int8 (or weight-only) dot, an `AmxPacked` one the AMX kernel (whatever `backend`: nothing
    else reads it), which with `rounded_to=jnp.bfloat16` returns the sums already rounded
    (what the caller's cast would make, in half the bytes; other paths leave the rounding to
    the caller). `backend="native"` (or `"amx"`) sends the shapes it fits
    (`_native_operand`, `_native_form`) to the native small-row kernel, a 3-D weight over its
    free row-major [K, N] view, a bf16 x widened to f32 first (exact), a w8a16 weight's scale
    applied after."""
    if isinstance(w, Observed):
        w.seen(x)
        w = w.w
    if isinstance(w, AmxPacked):
        if _native_form(eq) != ("nk" if w.transposed else "kn") or x.ndim != 2:
            raise ValueError(f"an AMX-packed weight runs only as the product it was packed "
                             f"for, not {eq!r}")
        out = rounded_to if rounded_to == jnp.bfloat16 else jnp.float32
        n = int(np.prod(w.out_shape))
        if w.scale is not None:  # int8 (W8A8): the rows quantized as quant.einsum's
            xq, sx = quant.quantize_rows(x)
            int8_matmul = (cpu_int8.amx_int8_matmul if cpu_int8.amx_int8_available()
                           else cpu_int8.vnni_int8_matmul)
            y = int8_matmul(xq, sx, w.tiles, w.scale, n, out_dtype=out)
        elif cpu_matmul.amx_available():
            y = cpu_matmul.amx_matmul(x, w.tiles, n, out_dtype=out)
        else:  # packed off AMX (`packs_bf16`): VDPBF16PS, or FMA over the widened pairs
            y = packed_bf16.packed_matmul(x, w.tiles, n, out_dtype=out)
        return y.reshape(x.shape[0], *w.out_shape)
    form = _native_form(eq) if backend in ("native", "amx") else None
    if isinstance(w, W4Array):  # the native kernel on CPU, else its dequantized reference
        native = form == "kn" and x.ndim == 2 and cpu_w4.available()
        return quant4.dot(eq, x, w, native)
    if form is not None and _native_int8(x, w, form):
        return _int8_dot(x, w)
    native = _native_operand(x, w, form) if form is not None else None
    if native is not None:
        operand, scale = native
        x32 = x.astype(jnp.float32)
        if form == "nk":
            y = cpu_matmul.small_matmul(x32, operand, transpose_w=True)
        else:
            y = cpu_matmul.small_matmul(x32, operand.reshape(operand.shape[0], -1))
            y = y.reshape(x.shape[0], *operand.shape[1:])
        return y if scale is None else y * scale.reshape(y.shape[1:])
    if isinstance(w, QArray):
        return quant.einsum(eq, x, w)
    return jnp.einsum(eq, x, w, preferred_element_type=jnp.float32)

