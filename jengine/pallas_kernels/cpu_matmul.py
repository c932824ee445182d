"""The native small-row matmul on CPU: `x [R, K] @ w [K, N]` inside a jitted program, x f32 and
w f32, bf16 or int8 (the int8 weight's per-channel scale is the caller's to apply).

XLA:CPU's dot of a few rows costs far more than one row's (2 / 4 / 8 / 16 rows ran 1.6 / 2.5 /
3.3 / 3.5x one row, `experiments/small_row_dots.py`), while a step of that shape should cost what
streaming the weights costs. The C++ kernel (`csrc/small_matmul.cc`, built into
`_cpu_kernels*.so` by the package's install) keeps each output tile's R rows in registers so
every weight row segment is read once for all of them, splits the columns over XLA's intra-op
threads, and picks AVX-512, AVX2+FMA or portable code at run time. A bf16 or int8 weight is
widened to f32 in registers, so the step streams 2x or 4x fewer weight bytes with f32 sums.

On a CPU with AMX-BF16, `amx_matmul` multiplies on the tiles (`csrc/amx_bf16.h`) from a bf16
weight packed once into their layout (`amx_tiles`), its columns split over the threads like
the small-row kernel's.

The FFI target is registered when this module is imported (jengine.pallas_kernels imports it),
before any program that calls it is compiled or loaded from the persistent compilation cache.
If the library is missing, importing still succeeds; `available()` says so and the engine
keeps XLA's dot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jengine import cpu_info
from jengine.pallas_kernels.native_library import load_native, missing

_TARGET = "jengine_small_matmul"
ISAS = {"auto": 0, "portable": 1, "avx2": 2, "avx512": 3}  # instruction set of the kernel

_AMX_TARGET = "jengine_amx_matmul"
_SWIGLU_TARGET = "jengine_amx_swiglu"
_AMX_CODE = 4  # JengineMatmulIsa's code for "the AMX target runs here"
AMX_TILE = (2, 16, 32)  # a k step's two B tiles: 16 k pairs x 16 columns x 2 words each
_AMX_INT8_TARGET = "jengine_amx_int8_matmul"
_INT8_SWIGLU_TARGET = "jengine_amx_int8_swiglu"
_AMX_INT8_CODE = 5  # JengineMatmulIsa's code for "the AMX-INT8 target runs here"
AMX_INT8_TILE = (2, 16, 64)  # a k step's two B tiles: 16 k quads x 16 columns x 4 bytes each

WEIGHT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8)

_INT8_TARGET = "jengine_int8_matmul"
_NORM_TARGET = "jengine_rms_norm"
INT8_ISAS = {"auto": 0, "portable": 1, "avx512_vnni": 4}  # instruction set of the int8 kernel

_LIB, _LOAD_ERROR = load_native("_cpu_kernels", {_TARGET: "JengineSmallMatmul",
                                                _INT8_TARGET: "JengineInt8Matmul",
                                                _AMX_TARGET: "JengineAmxMatmul",
                                                _SWIGLU_TARGET: "JengineAmxSwiGlu",
                                                _AMX_INT8_TARGET: "JengineAmxInt8Matmul",
                                                _INT8_SWIGLU_TARGET: "JengineAmxInt8SwiGlu",
                                                _NORM_TARGET: "JengineRmsNorm"})


def available() -> bool:
    """Whether the native library was built and its FFI target is registered."""
    return _LIB is not None


def require() -> None:
    """Raises a `RuntimeError` naming the fix when the native library is unavailable."""
    if _LIB is None:
        raise missing("matmul backend 'native'", _LOAD_ERROR, "matmul_backend 'xla'")


def best_isa() -> str:
    """The instruction set `isa="auto"` runs on this CPU (of those `cpu_info.flags()` allows,
    so `cpu_info.hiding` steers it)."""
    require()
    return cpu_info.best_vector_isa(supports)


def supports(isa: str) -> bool:
    """Whether this CPU runs the kernel's `isa` path."""
    require()
    return bool(_LIB.JengineMatmulIsa(ISAS[isa]))


def small_matmul(
    x: jax.Array,  # [R, K] float32
    w: jax.Array,  # [K, N] f32 | bf16 | int8, row-major as stored; [N, K] with transpose_w
    *,
    transpose_w: bool = False,  # x @ w.T (a tied embedding [V, E] as the output head)
    isa: str = "auto",
    max_threads: int = 0,  # 0: all of XLA's intra-op threads
) -> jax.Array:  # [R, N] float32
    """`x @ w` (or `x @ w.T`) by the native kernel in float32; each weight element is read
    from memory once for all R rows."""
    require()
    if x.dtype != jnp.float32 or w.dtype not in WEIGHT_DTYPES or x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"small_matmul takes a 2-D float32 x and a 2-D float32, bfloat16 or "
                         f"int8 w, got {x.dtype}{x.shape} and {w.dtype}{w.shape}")
    n = w.shape[0] if transpose_w else w.shape[1]
    isa = best_isa() if isa == "auto" else isa
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x, w, isa=np.int32(ISAS[isa]), transpose_w=np.int32(transpose_w),
                max_threads=np.int32(max_threads))


def int8_isa() -> str:
    """The instruction set the W8A8 kernel runs here with `isa="auto"`: `avx512_vnni`, or
    `portable` (exact but slow; the engine keeps XLA's int8 dot then)."""
    require()
    vnni = cpu_info.allows("avx512_vnni") and _LIB.JengineInt8MatmulIsa(0) == INT8_ISAS[
        "avx512_vnni"]
    return "avx512_vnni" if vnni else "portable"


def int8_matmul(
    xq: jax.Array,  # [R, K] int8: per-row quantized activations
    sx: jax.Array,  # [R, 1] float32 row scales
    w: jax.Array,  # [K, N] int8; [N, K] with transpose_w (K divisible by 4 then)
    sw: jax.Array,  # N float32 channel scales (any shape of N elements)
    *,
    transpose_w: bool = False,
    isa: str = "auto",
    max_threads: int = 0,
) -> jax.Array:  # [R, N] float32
    """`float(xq @ w) * sx * sw` (int32 sums, rescaled in that order) by the native VNNI kernel
    (`csrc/int8_matmul.cc`): equal to `jengine.models.quant`'s XLA int8 dot bit for bit."""
    require()
    if (xq.dtype != jnp.int8 or w.dtype != jnp.int8 or xq.ndim != 2 or w.ndim != 2
            or sx.size != xq.shape[0]):
        raise ValueError(f"int8_matmul takes 2-D int8 xq and w and one scale per row, got "
                         f"{xq.dtype}{xq.shape}, {w.dtype}{w.shape}, scales {sx.shape}")
    n = w.shape[0] if transpose_w else w.shape[1]
    if sw.size != n or (transpose_w and xq.shape[1] % 4):
        raise ValueError(f"int8_matmul: {sw.size} channel scales for {n} columns"
                         + (", K not divisible by 4" if transpose_w else ""))
    isa = int8_isa() if isa == "auto" else isa
    call = jax.ffi.ffi_call(_INT8_TARGET, jax.ShapeDtypeStruct((xq.shape[0], n), jnp.float32))
    return call(xq, sx.astype(jnp.float32), w, sw.astype(jnp.float32),
                isa=np.int32(INT8_ISAS[isa]), transpose_w=np.int32(transpose_w),
                max_threads=np.int32(max_threads))


def amx_available() -> bool:
    """Whether `amx_matmul` runs here: the library loaded, the CPU has AMX-BF16 (and AVX-512
    BF16) in `cpu_info.flags()`, and Linux granted this process the tile state."""
    return cpu_info.allows("amx") and _granted(_AMX_CODE)


@functools.cache
def _granted(code: int) -> bool:
    # Asks the CPU and Linux once (the first ask requests the tile state for the process).
    return available() and bool(_LIB.JengineMatmulIsa(code))


def amx_tiles(w: np.ndarray) -> np.ndarray:
    """A bf16 weight [K, N] (row-major) in the AMX tiles' layout `amx_matmul` reads:
    [ceil(N / 32), ceil(K / 32), 2, 16, 32], strip s / k step ks / half h holding the B tile
    whose row p is the pairs (w[32 ks + 2p, c], w[32 ks + 2p + 1, c]) for its 16 columns c of
    32 s + 16 h + (0..15); zeros pad K and N. Done once, on the host, at load time."""
    if w.ndim != 2 or w.dtype != jnp.bfloat16:
        raise ValueError(f"amx_tiles takes a 2-D bfloat16 weight, got {w.dtype}{w.shape}")
    return _b_tiles(w, group=2)


def _b_tiles(w: np.ndarray, group: int) -> np.ndarray:
    """w [K, N] as the B tiles of a k step of 16 * `group` (2 bf16 pairs, 4 int8 quads):
    [ceil(N / 32), K steps, 2, 16, 16 * group], tile (s, ks, h) row p holding, for each of its 16
    columns c of 32 s + 16 h + c, the group w[16 group ks + group p + (0..group-1), c]."""
    step = 16 * group
    k, n = w.shape
    kp, np_ = -(-k // step) * step, -(-n // 32) * 32
    padded = np.zeros((kp, np_), w.dtype)
    padded[:k, :n] = w
    # k = step ks + group p + i, n = 32 s + 16 h + c  ->  [s, ks, h, p, c, i]
    t = padded.reshape(kp // step, 16, group, np_ // 32, 2, 16).transpose(3, 0, 4, 1, 5, 2)
    return np.ascontiguousarray(t).reshape(np_ // 32, kp // step, 2, 16, step)


def amx_int8_available() -> bool:
    """Whether `amx_int8_matmul` runs here: the library loaded, the CPU has AMX-INT8 in
    `cpu_info.flags()`, and Linux granted this process the tile state."""
    return cpu_info.allows("amx_int8") and _granted(_AMX_INT8_CODE)


def amx_int8_tiles(w: np.ndarray) -> np.ndarray:
    """An int8 weight [K, N] (row-major) in the layout `amx_int8_matmul` reads: [ceil(N / 32),
    ceil(K / 64), 2, 16, 64], strip s / k step ks / half h holding the B tile whose row p is,
    for its 16 columns c of 32 s + 16 h + (0..15), the quad w[64 ks + 4p + (0..3), c]; zeros
    pad K and N. Done once, on the host, at load time."""
    if w.ndim != 2 or w.dtype != np.int8:
        raise ValueError(f"amx_int8_tiles takes a 2-D int8 weight, got {w.dtype}{w.shape}")
    return _b_tiles(w, group=4)


def amx_int8_matmul(
    xq: jax.Array,  # [R, K] int8: the activations quantized per row (quant.quantize_rows)
    sx: jax.Array,  # [R, 1] or [R] f32: their row scales
    tiles: jax.Array,  # amx_int8_tiles(w) for w [K, N] int8
    w_scale: jax.Array,  # [N] f32 (any shape of N elements): w's column scales
    n: int,  # N
    *,
    max_threads: int = 0,  # 0: all of XLA's intra-op threads
    out_dtype=jnp.float32,
) -> jax.Array:  # [R, N] out_dtype
    """`(xq @ w) * sx * w_scale` on the AMX tiles (TDPBSSD, exact int32 sums, then the f32
    rescale in quant._rescale's order): XLA's int8 dot and rescale to the bit, or that rounded
    to bf16 (`out_dtype`), from the packed weight, its columns split over the threads."""
    require()
    if (xq.dtype != jnp.int8 or xq.ndim != 2 or tiles.dtype != jnp.int8
            or tiles.shape[2:] != AMX_INT8_TILE or tiles.shape[0] != -(-n // 32)
            or tiles.shape[1] != -(-xq.shape[1] // 64) or sx.size != xq.shape[0]
            or w_scale.size != n):
        raise ValueError(f"amx_int8_matmul takes int8 xq [R, K], sx [R], the int8 "
                         f"amx_int8_tiles(w) of a w [K, {n}] and its [{n}] scales, got "
                         f"{xq.dtype}{xq.shape}, {sx.shape}, {tiles.dtype}{tiles.shape}, "
                         f"{w_scale.shape}")
    if jnp.dtype(out_dtype) not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"amx_int8_matmul returns float32 or bfloat16, not {out_dtype}")
    call = jax.ffi.ffi_call(_AMX_INT8_TARGET,
                            jax.ShapeDtypeStruct((xq.shape[0], n), out_dtype))
    return call(xq, sx.reshape(-1).astype(jnp.float32), tiles,
                w_scale.reshape(-1).astype(jnp.float32), n=np.int64(n),
                max_threads=np.int32(max_threads))


def amx_int8_swiglu(
    xq: jax.Array,  # [R, K] int8 (quant.quantize_rows)
    sx: jax.Array,  # [R, 1] or [R] f32
    gate: tuple[jax.Array, jax.Array],  # w_gate's (amx_int8_tiles, [N] scales)
    up: tuple[jax.Array, jax.Array],  # w_up's, the same shapes
    n: int,  # N
    *,
    max_threads: int = 0,
) -> jax.Array:  # [R, N] bfloat16
    """silu(x @ w_gate) * (x @ w_up) for `int8` gate and up weights in one call: each product
    as `amx_int8_matmul(..., out_dtype=bf16)` rounds it, the activation as `amx_swiglu`'s
    (up to the sigmoid's last f32 bit); neither product goes to memory."""
    require()
    for tiles, scale in (gate, up):
        if (tiles.dtype != jnp.int8 or tiles.shape != gate[0].shape
                or tiles.shape[0] != -(-n // 32) or tiles.shape[1] != -(-xq.shape[1] // 64)
                or scale.size != n or xq.dtype != jnp.int8 or sx.size != xq.shape[0]):
            raise ValueError(f"amx_int8_swiglu takes int8 xq [R, K], sx [R] and two int8 "
                             f"amx_int8_tiles of a w [K, {n}] with [{n}] scales")
    call = jax.ffi.ffi_call(_INT8_SWIGLU_TARGET,
                            jax.ShapeDtypeStruct((xq.shape[0], n), jnp.bfloat16))
    f32 = lambda a: a.reshape(-1).astype(jnp.float32)  # noqa: E731
    return call(xq, f32(sx), gate[0], f32(gate[1]), up[0], f32(up[1]), n=np.int64(n),
                max_threads=np.int32(max_threads))



def amx_columns(tiles: jax.Array, cols: jax.Array, k: int) -> jax.Array:
    """Columns `cols` [C] of the weight w [K, N] that `tiles` = amx_tiles(w) holds, as rows
    [C, K] (bf16): the rows of a tied embedding packed as w = table.T for the output head."""
    s, ks = tiles.shape[:2]
    split = tiles.reshape(s, ks, 2, 16, 16, 2)  # [s, ks, h, p, c, pair], as amx_tiles lays out
    picked = split[cols // 32, :, (cols % 32) // 16, :, cols % 16, :]  # [C, ks, p, pair]
    return picked.reshape(cols.shape[0], ks * 32)[:, :k]


def amx_matmul_check(x: jax.Array, tiles: jax.Array, n: int, name: str) -> None:
    """Raises a `ValueError` unless x [R, K] (float32 or bfloat16) and `tiles` are the bf16
    `amx_tiles` of a w [K, n]."""
    if (x.dtype not in (jnp.float32, jnp.bfloat16) or x.ndim != 2 or tiles.dtype != jnp.bfloat16
            or tiles.shape[2:] != AMX_TILE or tiles.shape[0] != -(-n // 32)
            or tiles.shape[1] != -(-x.shape[1] // 32)):
        raise ValueError(f"{name} takes a 2-D float32 or bfloat16 x and the bf16 "
                         f"amx_tiles(w) of a w [{x.shape[-1]}, {n}], got {x.dtype}{x.shape} "
                         f"and {tiles.dtype}{tiles.shape}")


def amx_matmul(
    x: jax.Array,  # [R, K] bfloat16, or float32 (rounded to bf16: exact for bf16 values)
    tiles: jax.Array,  # amx_tiles(w) for w [K, N] bf16
    n: int,  # N
    *,
    max_threads: int = 0,  # 0: all of XLA's intra-op threads
    out_dtype=jnp.float32,
) -> jax.Array:  # [R, N] out_dtype
    """`x @ w` on the AMX tiles (TDPBF16PS, f32 sums) from the packed weight; each weight byte
    is read from memory once for all R rows, and the columns are split over the threads.
    `out_dtype` bfloat16: the sums rounded to nearest even, `.astype(jnp.bfloat16)` of the f32
    result bit for bit, stored in half the bytes."""
    require()
    amx_matmul_check(x, tiles, n, "amx_matmul")
    if jnp.dtype(out_dtype) not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"amx_matmul returns float32 or bfloat16, not {out_dtype}")
    call = jax.ffi.ffi_call(_AMX_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), out_dtype))
    return call(x, tiles, n=np.int64(n), max_threads=np.int32(max_threads))


def amx_swiglu(
    x: jax.Array,  # [R, K] bfloat16, or float32 (rounded to bf16: exact for bf16 values)
    gate_tiles: jax.Array,  # amx_tiles(w_gate) for w_gate [K, N] bf16
    up_tiles: jax.Array,  # amx_tiles(w_up), the same shape
    n: int,  # N
    *,
    max_threads: int = 0,
) -> jax.Array:  # [R, N] bfloat16
    """A bf16 SwiGLU's activation, silu(x @ w_gate) * (x @ w_up), from both packed weights in one
    call (csrc/amx_swiglu.h): neither product goes to memory. Rounded as
    `silu(amx_matmul(x, g, n, out_dtype=bf16).astype(f32)).astype(bf16) * amx_matmul(x, u, n,
    out_dtype=bf16)` rounds, up to the sigmoid's last f32 bit."""
    require()
    if gate_tiles.shape != up_tiles.shape:
        raise ValueError(f"amx_swiglu takes two weights of one shape, got {gate_tiles.shape} "
                         f"and {up_tiles.shape}")
    amx_matmul_check(x, gate_tiles, n, "amx_swiglu")
    call = jax.ffi.ffi_call(_SWIGLU_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.bfloat16))
    return call(x, gate_tiles, up_tiles, n=np.int64(n), max_threads=np.int32(max_threads))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0, *,
             isa: str = "auto") -> jax.Array:
    """`layers.rms_norm` of x [..., E] (float32 or bfloat16) by the native kernel
    (csrc/rms_norm.cc): each row's sum of squares in one fixed order, whatever the batch, in
    one call instead of XLA's order-fixed tree of small fusions. The result's dtype is
    `layers.rms_norm`'s: x's with an `offset`, else the promotion of weight and x."""
    require()
    if x.dtype not in (jnp.float32, jnp.bfloat16) or weight.dtype not in (jnp.float32,
                                                                          jnp.bfloat16):
        raise ValueError(f"rms_norm takes float32 or bfloat16, got {x.dtype} and {weight.dtype}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm's weight must be [{x.shape[-1]}], got {weight.shape}")
    out = x.dtype if offset else jnp.result_type(weight, x)
    rows = x.reshape(-1, x.shape[-1])
    call = jax.ffi.ffi_call(_NORM_TARGET, jax.ShapeDtypeStruct(rows.shape, out))
    y = call(rows, weight, eps=np.float32(eps), offset=np.float32(offset),
             isa=np.int32(ISAS[best_isa() if isa == "auto" else isa]))
    return y.reshape(x.shape)
