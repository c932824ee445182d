"""Native CPU ragged paged attention and KV write: C++ kernels called through `jax.ffi`, the
`cpu` attention backend (jengine.pallas_kernels.backends reaches it through its
`AttentionBackend` record).

The kernels (`csrc/paged_attention.cc`) are built into `_cpu_kernels*.so` by the package's
install (a setuptools Extension against the XLA FFI headers of jaxlib); nothing is compiled at
run time. They read and write the paged cache in place: attention visits only the pages each
query block can see (no gathered copy), and the KV write is an aliased output, so a donated
cache is never copied (XLA's own scatter on a bf16 cache rewrites all of it).

If the library is missing, importing still succeeds and the `cpu` backend raises `RuntimeError`
naming the fix when asked for; the `reference` backend never needs it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jengine import cpu_info
from jengine.cpu_kernels import library

# The cache dtypes the kernel widens to f32 a page at a time; int8 rows come with f32 scales.
# `pallas_kernels.kv_quant.READERS` reads this to say which quantized caches `cpu` serves.
CACHE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.int8))


def available() -> bool:
    """Whether the native library was built and its FFI targets are registered."""
    return library.available()


def require() -> None:
    """Raises a `RuntimeError` naming the fix when the native library is unavailable."""
    library.require("attention backend 'cpu'", "--attention-backend reference")


def best_isa() -> str:
    """The instruction set `isa="auto"` runs on this CPU: AVX-512F where present, else AVX2+FMA,
    else portable C++ (and, for bf16 queries and cache, `amx` where `amx_runs()`); what the CPU
    has is `cpu_info.flags()`, so `cpu_info.hiding` steers it."""
    require()
    return cpu_info.best_vector_isa(supports)


def amx_runs() -> bool:
    """Whether `auto` takes the AMX path for a bf16 model's prefill blocks here."""
    return cpu_info.allows("amx") and supports("amx")


def supports(isa: str) -> bool:
    """Whether this CPU runs the kernel's `isa` path; forcing one it does not is an error."""
    require()
    return bool(library.runs("attention", isa))


def has_avx2() -> bool:
    """Whether this CPU runs the kernel's AVX2+FMA path."""
    return supports("avx2")


def _check_cache(k_cache: jax.Array, k_scale: jax.Array | None) -> None:
    """The kernel reads a float32, bfloat16 or int8 cache, the int8 one with its scales."""
    dtype = jnp.dtype(k_cache.dtype)
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"attention backend 'cpu' reads float32, bfloat16 and int8 KV caches, "
                         f"not {dtype} (kv_cache_dtype fp8 needs another backend)")
    if (dtype == jnp.int8) != (k_scale is not None):
        raise ValueError("cpu: an int8 or fp8 KV cache needs its scales (k_scale, v_scale), a "
                         "float one none")


def ragged_paged_attention_cpu(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [L, K, P, O, D] float32, bfloat16 or int8
    v_cache: jax.Array,  # [L, K, P, O, D]
    layer: jax.Array,  # [] int32
    token_seq: jax.Array,  # [T] int32
    positions: jax.Array,  # [T] int32
    page_table: jax.Array,  # [S, Pmax] int32
    *,
    sm_scale: float,
    sliding_window: jax.Array | int | None = None,
    soft_cap: float | None = None,
    kv_head_map: tuple[int, ...] | jax.Array | None = None,  # [H] (else h // G)
    k_scale: jax.Array | None = None,  # [L, K, P, O, 1] f32: an int8 cache's row scales
    v_scale: jax.Array | None = None,  # (an fp8 cache: ValueError, see `CACHE_DTYPES`)
    sinks: jax.Array | None = None,  # [H] f32: gpt-oss's sink logits, in the denominator
    block_q: int = 32,
    isa: str = "auto",
    max_threads: int = 0,  # 0: all of XLA's intra-op threads
    ffi_target: str | None = None,
) -> jax.Array:  # [T, H, D]
    """`reference.ragged_paged_attention`'s result, computed by the native kernel.

    `block_q` query rows of one sequence share a pass over its pages; `isa` forces the
    portable, AVX2 or AVX-512 path (tests, benchmarks; `supports` says which run here), where
    `auto` takes `best_isa()`; scores, softmax and accumulation are f32 throughout. bf16 and
    int8 pages are widened to f32 a page at a time as they are read (int8 times its rows'
    scales).
    `isa="amx"` (what `auto` takes for bf16 `q` over a bf16 cache where the CPU has AMX-BF16)
    runs the prefill blocks' products on the AMX tiles instead (`csrc/amx_attention.h`): q and
    the probabilities rounded to bf16, sums in f32, so the result is within bf16 rounding of
    the f32 path's; decode rows and other caches take the AVX-512 path.
    `ffi_target` calls another build of the kernel, registered under that target name (the
    benchmark's `--baseline`) instead of this package's.
    """
    require()
    if isa == "auto" and q.dtype == k_cache.dtype == jnp.bfloat16 and amx_runs():
        isa = "amx"  # a bf16 model's queries: rounding them to bf16 changes nothing
    elif isa == "auto":
        isa = best_isa()
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[1]
    if kv_head_map is None:
        kv_head_map = np.arange(num_heads, dtype=np.int32) // (num_heads // num_kv_heads)
    window = jnp.iinfo(jnp.int32).max if sliding_window is None else sliding_window
    _check_cache(k_cache, k_scale)
    no_scales = jnp.zeros((0,), jnp.float32)
    call = jax.ffi.ffi_call(ffi_target or library.target("jengine_paged_attention"),
                            jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(
        q.astype(jnp.float32), k_cache, v_cache,
        no_scales if k_scale is None else k_scale, no_scales if v_scale is None else v_scale,
        jnp.asarray(layer, jnp.int32).reshape(()),
        token_seq.astype(jnp.int32), positions.astype(jnp.int32), page_table.astype(jnp.int32),
        jnp.asarray(window, jnp.int32).reshape(()), jnp.asarray(kv_head_map, jnp.int32),
        no_scales if sinks is None else sinks.astype(jnp.float32),
        sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0),
        isa=np.int32(library.isa_code("attention", isa)), block_q=np.int32(block_q),
        max_threads=np.int32(max_threads),
    )
    return out.astype(q.dtype)


def write_kv_cpu(
    cache: jax.Array,  # [L, K, P, O, D] float32, bfloat16 or int8 (or int8 scales, D = 1)
    layer: jax.Array,  # [] int32
    slot_mapping: jax.Array,  # [T] int32 flat slot = page * O + offset
    new: jax.Array,  # [T, K, D]
) -> jax.Array:
    """`reference.write_kv`, in place: the result aliases `cache` (donate it to avoid a copy).
    Slots outside the pool are skipped; bf16 rounds to nearest even; an int8 cache takes rows
    already quantized (`kv_quant.quantize_rows`)."""
    require()
    new = new.astype(jnp.int8 if cache.dtype == jnp.int8 else jnp.float32)
    call = jax.ffi.ffi_call(library.target("jengine_kv_write"),
                            jax.ShapeDtypeStruct(cache.shape, cache.dtype),
                            input_output_aliases={0: 0})
    return call(cache, jnp.asarray(layer, jnp.int32).reshape(()), slot_mapping.astype(jnp.int32),
                new)

