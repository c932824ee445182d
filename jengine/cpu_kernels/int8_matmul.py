"""The native W8A8 matmuls on CPU: int8 activations (quantized per row) times an int8 weight
(per-channel scales), int32 sums rescaled in f32, equal to `jengine.models.quant`'s XLA int8 dot
bit for bit. `int8_matmul` (`csrc/int8_matmul.cc`) runs AVX-512 VNNI over the weight as stored;
`amx_int8_matmul` and `amx_int8_swiglu` (`csrc/amx_int8.h`) run on the AMX-INT8 tiles over a
weight packed once at load time (`amx_int8_tiles`); `vnni_int8_matmul` (`csrc/vnni_int8.cc`)
reads the same packed tiles with AVX-512 VNNI on CPUs without AMX-INT8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jengine import cpu_info
from jengine.cpu_kernels import library
from jengine.cpu_kernels.matmul import b_tiles, granted, require

AMX_INT8_TILE = (2, 16, 64)  # a k step's two B tiles: 16 k quads x 16 columns x 4 bytes each


def int8_isa() -> str:
    """The instruction set the W8A8 kernel runs here with `isa="auto"`: `avx512_vnni`, or
    `portable` (exact but slow; the engine keeps XLA's int8 dot then)."""
    require()
    vnni = cpu_info.allows("avx512_vnni") and library.runs("int8_matmul", "auto") == (
        library.isa_code("int8_matmul", "avx512_vnni"))
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
    call = jax.ffi.ffi_call(library.target("jengine_int8_matmul"),
                            jax.ShapeDtypeStruct((xq.shape[0], n), jnp.float32))
    return call(xq, sx.astype(jnp.float32), w, sw.astype(jnp.float32),
                isa=np.int32(library.isa_code("int8_matmul", isa)),
                transpose_w=np.int32(transpose_w), max_threads=np.int32(max_threads))


def amx_int8_available() -> bool:
    """Whether `amx_int8_matmul` runs here: the library loaded, the CPU has AMX-INT8 in
    `cpu_info.flags()`, and Linux granted this process the tile state."""
    return cpu_info.allows("amx_int8") and granted("int8")


def vnni_int8_available() -> bool:
    """Whether `vnni_int8_matmul` runs here: the library has it and the CPU has AVX-512 VNNI
    in `cpu_info.flags()` (so `cpu_info.hiding("avx512_vnni")` turns it off)."""
    return (cpu_info.allows("avx512_vnni") and library.has_target("jengine_vnni_int8_packed")
            and library.runs("vnni_int8_packed", "avx512_vnni") == 1)


def vnni_int8_matmul(
    xq: jax.Array,  # [R, K] int8 (quant.quantize_rows)
    sx: jax.Array,  # [R, 1] or [R] f32
    tiles: jax.Array,  # amx_int8_tiles(w) for w [K, N] int8
    w_scale: jax.Array,  # [N] f32
    n: int,  # N
    *,
    max_threads: int = 0,
    out_dtype=jnp.float32,
) -> jax.Array:  # [R, N] out_dtype
    """`amx_int8_matmul`'s product (the same packed weight, exact int32 sums, the same f32
    rescale: XLA's int8 dot to the bit, or that rounded to bf16) by VPDPBUSD on AVX-512 VNNI,
    for CPUs without AMX-INT8."""
    library.require("the VNNI int8 matmul", "XLA's int8 dot (matmul_backend 'xla')")
    _check_packed(xq, sx, tiles, w_scale, n, out_dtype, "vnni_int8_matmul")
    call = jax.ffi.ffi_call(library.target("jengine_vnni_int8_packed"),
                            jax.ShapeDtypeStruct((xq.shape[0], n), out_dtype))
    return call(xq, sx.reshape(-1).astype(jnp.float32), tiles,
                w_scale.reshape(-1).astype(jnp.float32), n=np.int64(n),
                isa=np.int32(library.isa_code("vnni_int8_packed", "avx512_vnni")),
                max_threads=np.int32(max_threads))


def _check_packed(xq, sx, tiles, w_scale, n: int, out_dtype, name: str) -> None:
    """ValueError unless the operands are what both packed-int8 kernels read (`amx_int8_tiles`
    of a [K, n] weight, int8 rows, their scales) and the output is f32 or bf16."""
    if (xq.dtype != jnp.int8 or xq.ndim != 2 or tiles.dtype != jnp.int8
            or tiles.shape[2:] != AMX_INT8_TILE or tiles.shape[0] != -(-n // 32)
            or tiles.shape[1] != -(-xq.shape[1] // 64) or sx.size != xq.shape[0]
            or w_scale.size != n):
        raise ValueError(f"{name} takes int8 xq [R, K], sx [R], the int8 "
                         f"amx_int8_tiles(w) of a w [K, {n}] and its [{n}] scales, got "
                         f"{xq.dtype}{xq.shape}, {sx.shape}, {tiles.dtype}{tiles.shape}, "
                         f"{w_scale.shape}")
    if jnp.dtype(out_dtype) not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"{name} returns float32 or bfloat16, not {out_dtype}")


def amx_int8_tiles(w: np.ndarray) -> np.ndarray:
    """An int8 weight [K, N] (row-major) in the layout `amx_int8_matmul` reads: [ceil(N / 32),
    ceil(K / 64), 2, 16, 64], strip s / k step ks / half h holding the B tile whose row p is,
    for its 16 columns c of 32 s + 16 h + (0..15), the quad w[64 ks + 4p + (0..3), c]; zeros
    pad K and N. Done once, on the host, at load time."""
    if w.ndim != 2 or w.dtype != np.int8:
        raise ValueError(f"amx_int8_tiles takes a 2-D int8 weight, got {w.dtype}{w.shape}")
    return b_tiles(w, group=4)


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
    _check_packed(xq, sx, tiles, w_scale, n, out_dtype, "amx_int8_matmul")
    call = jax.ffi.ffi_call(library.target("jengine_amx_int8_matmul"),
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
    call = jax.ffi.ffi_call(library.target("jengine_amx_int8_swiglu"),
                            jax.ShapeDtypeStruct((xq.shape[0], n), jnp.bfloat16))
    f32 = lambda a: a.reshape(-1).astype(jnp.float32)  # noqa: E731
    return call(xq, f32(sx), gate[0], f32(gate[1]), up[0], f32(up[1]), n=np.int64(n),
                max_threads=np.int32(max_threads))
