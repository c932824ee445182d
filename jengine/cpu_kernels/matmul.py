"""The native small-row matmul on CPU: `x [R, K] @ w [K, N]` inside a jitted program, x f32 and
w f32, bf16 or int8 (the int8 weight's per-channel scale is the caller's to apply); and on a CPU
with AMX-BF16 the bf16 products on the tiles.

XLA:CPU's dot of a few rows costs far more than one row's (2 / 4 / 8 / 16 rows ran 1.6 / 2.5 /
3.3 / 3.5x one row, `experiments/small_row_dots.py`), while a step of that shape should cost what
streaming the weights costs. The C++ kernel (`csrc/small_matmul.cc`, built into
`_cpu_kernels*.so` by the package's install) keeps each output tile's R rows in registers so
every weight row segment is read once for all of them, splits the columns over XLA's intra-op
threads, and picks AVX-512, AVX2+FMA or portable code at run time. A bf16 or int8 weight is
widened to f32 in registers, so the step streams 2x or 4x fewer weight bytes with f32 sums.

On a CPU with AMX-BF16, `amx_matmul` multiplies on the tiles (`csrc/amx_bf16.h`) from a bf16
weight packed once into their layout (`amx_tiles`), its columns split over the threads like
the small-row kernel's. The W8A8 kernels are `int8_matmul.py`'s.

If the library is missing, importing still succeeds; `available()` says so and the engine
keeps XLA's dot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jengine import cpu_info
from jengine.cpu_kernels import library

AMX_TILE = (2, 16, 32)  # a k step's two B tiles: 16 k pairs x 16 columns x 2 words each
WEIGHT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8)


def available() -> bool:
    """Whether the native library was built and its FFI targets are registered."""
    return library.available()


def require() -> None:
    """Raises a `RuntimeError` naming the fix when the native library is unavailable."""
    library.require("matmul backend 'native'", "matmul_backend 'xla'")


def best_isa() -> str:
    """The instruction set `isa="auto"` runs on this CPU (of those `cpu_info.flags()` allows,
    so `cpu_info.hiding` steers it)."""
    require()
    return cpu_info.best_vector_isa(supports)


def supports(isa: str) -> bool:
    """Whether this CPU runs the kernel's `isa` path."""
    require()
    return bool(library.runs("matmul", isa))


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
    call = jax.ffi.ffi_call(library.target("jengine_small_matmul"),
                            jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x, w, isa=np.int32(library.isa_code("matmul", isa)),
                transpose_w=np.int32(transpose_w), max_threads=np.int32(max_threads))


def amx_available() -> bool:
    """Whether `amx_matmul` runs here: the library loaded, the CPU has AMX-BF16 (and AVX-512
    BF16) in `cpu_info.flags()`, and Linux granted this process the tile state."""
    return cpu_info.allows("amx") and granted("bf16")


@functools.cache
def granted(amx: str) -> bool:
    """Whether the library's `amx` target ("bf16" or "int8") runs here: the CPU has it and Linux
    granted this process the tile state (asked once: the first ask requests it)."""
    return available() and bool(library.runs("amx", amx))


def amx_tiles(w: np.ndarray) -> np.ndarray:
    """A bf16 weight [K, N] (row-major) in the AMX tiles' layout `amx_matmul` reads:
    [ceil(N / 32), ceil(K / 32), 2, 16, 32], strip s / k step ks / half h holding the B tile
    whose row p is the pairs (w[32 ks + 2p, c], w[32 ks + 2p + 1, c]) for its 16 columns c of
    32 s + 16 h + (0..15); zeros pad K and N. Done once, on the host, at load time."""
    if w.ndim != 2 or w.dtype != jnp.bfloat16:
        raise ValueError(f"amx_tiles takes a 2-D bfloat16 weight, got {w.dtype}{w.shape}")
    return b_tiles(w, group=2)


def b_tiles(w: np.ndarray, group: int) -> np.ndarray:
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
    call = jax.ffi.ffi_call(library.target("jengine_amx_matmul"),
                            jax.ShapeDtypeStruct((x.shape[0], n), out_dtype))
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
    call = jax.ffi.ffi_call(library.target("jengine_amx_swiglu"),
                            jax.ShapeDtypeStruct((x.shape[0], n), jnp.bfloat16))
    return call(x, gate_tiles, up_tiles, n=np.int64(n), max_threads=np.int32(max_threads))
