"""Attention backends behind one protocol, and the `shard_map` wrapper that runs a kernel per tp
shard.

Every backend's kernel has the reference's signature:
`fn(q, k_cache, v_cache, layer, token_seq, positions, page_table, *, sm_scale, sliding_window,
soft_cap, kv_head_map, k_scale=None, v_scale=None) -> [T, H, D]` (the scales: an int8
cache's, which every backend reads). Each backend is an `AttentionBackend` record in
`ATTENTION_BACKENDS`: `reference` (pure JAX, the oracle), `cpu` (the native C++ kernel,
jengine.cpu_kernels.attention), `pallas_tpu` and `pallas_gpu`. `auto` resolves by platform:
cpu -> cpu (reference, with a warning, when the native library was not built), tpu ->
pallas_tpu, gpu (cuda/rocm) -> pallas_gpu. Asking for `cpu` itself without the library is a
`RuntimeError` naming the fix. A Pallas backend asked for on CPU runs its kernel in interpret
mode (TPU emulation for pallas_tpu), which is how the tests and an end-to-end check on this
machine exercise the kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from jengine.cpu_kernels import attention as cpu_attention
from jengine.pallas_kernels.reference import ragged_paged_attention

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """One implementation of the attention signature, as the runtime picks it by `name`.

    `kernel(platform, **block_sizes)` returns the attention function on `platform` (a Pallas
    kernel is imported only then: Pallas and Mosaic cost ~0.35 s of a CPU start-up; off its
    hardware it runs in interpret mode). `available()` says whether it can run at all here (the
    native kernel needs its library) and `require()` raises the error naming the fix when not.
    """

    name: str
    auto_on: tuple[str, ...]  # the platforms `auto` picks this backend on
    kernel: Callable[..., Callable]
    available: Callable[[], bool] = lambda: True
    require: Callable[[], None] = lambda: None


def _reference(platform: str, **block_sizes) -> Callable:
    return ragged_paged_attention


def _cpu(platform: str, **block_sizes) -> Callable:
    if platform != "cpu":
        raise ValueError(f"attention backend 'cpu' runs on the CPU platform, not {platform!r}")
    return functools.partial(cpu_attention.ragged_paged_attention_cpu, **block_sizes)


def _pallas_tpu(platform: str, **block_sizes) -> Callable:
    from jax.experimental.pallas import tpu as pltpu

    from jengine.pallas_kernels.tpu import ragged_paged_attention_tpu

    interpret = pltpu.InterpretParams() if platform != "tpu" else False
    return functools.partial(ragged_paged_attention_tpu, interpret=interpret, **block_sizes)


def _pallas_gpu(platform: str, **block_sizes) -> Callable:
    from jengine.pallas_kernels.gpu import ragged_paged_attention_gpu

    interpret = platform not in _GPU_PLATFORMS
    return functools.partial(ragged_paged_attention_gpu, interpret=interpret, **block_sizes)


ATTENTION_BACKENDS = {b.name: b for b in (
    AttentionBackend("reference", (), _reference),
    AttentionBackend("cpu", ("cpu",), _cpu, cpu_attention.available, cpu_attention.require),
    AttentionBackend("pallas_tpu", ("tpu",), _pallas_tpu),
    AttentionBackend("pallas_gpu", _GPU_PLATFORMS, _pallas_gpu),
)}
BACKENDS = ("auto", *ATTENTION_BACKENDS)


def resolve_backend(backend: str, platform: str) -> str:
    """`auto` -> the platform's backend; any other known name is returned as given (`cpu` only
    when its native library is built, else a `RuntimeError` naming the fix)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend != "auto":
        ATTENTION_BACKENDS[backend].require()
        return backend
    picked = next((b for b in ATTENTION_BACKENDS.values() if platform in b.auto_on), None)
    if picked is None:
        raise ValueError(f"no attention backend for platform {platform!r}")
    if not picked.available():
        logging.getLogger("jengine").warning(
            "the native CPU attention kernel is not built; using the slower 'reference' backend "
            "(reinstall jengine with a C++ compiler present: `pip install -e .`)")
        return "reference"
    return picked.name


def attention_fn(backend: str, platform: str | None = None, **block_sizes) -> Callable:
    """The attention function of `backend` on `platform` (default: JAX's default backend).

    `block_sizes` go to the kernel (`block_q`, `pages_per_chunk` for TPU; `block_q`,
    `num_kv_splits`, `num_warps`, `num_stages` for GPU; `block_q`, `isa` for cpu).
    """
    platform = platform or jax.default_backend()
    return ATTENTION_BACKENDS[resolve_backend(backend, platform)].kernel(platform, **block_sizes)


def shard_for_context_mesh(fn: Callable, axis: str = "tp") -> Callable:
    """`fn` under `shard_over_heads` when traced inside `jax.set_mesh(mesh)` with more than one
    device on `axis`; `fn` itself otherwise (one device, or no mesh in context)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or dict(mesh.shape).get(axis, 1) == 1:
        return fn
    return shard_over_heads(fn, mesh, axis)


def shard_write_for_context_mesh(write: Callable, *, kv_replicated: bool,
                                 axis: str = "tp") -> Callable:
    """A KV write `write(cache, layer, slot_mapping, new)` per `axis` shard in `shard_map` when
    traced inside `jax.set_mesh(mesh)` with more than one device on `axis` (the FFI write is
    opaque to the partitioner, which would gather the whole cache for it); `write` otherwise.

    The cache is split on its kv-head axis like `new` [T, K, D], or replicated (`kv_replicated`,
    the explicit head-map layout), when every shard writes its whole copy.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or dict(mesh.shape).get(axis, 1) == 1:
        return write
    cache_spec = PartitionSpec() if kv_replicated else PartitionSpec(None, axis)
    new_spec = PartitionSpec() if kv_replicated else PartitionSpec(None, axis, None)
    rep = PartitionSpec()
    return jax.shard_map(write, mesh=mesh, in_specs=(cache_spec, rep, rep, new_spec),
                         out_specs=cache_spec, check_vma=False)


def shard_over_heads(fn: Callable, mesh: Mesh | AbstractMesh, axis: str = "tp") -> Callable:
    """Runs `fn` once per `axis` shard on its own query heads (a Pallas call is opaque to the
    SPMD partitioner, which would otherwise gather every head onto every device).

    q is split on heads. With `kv_head_map=None` the kv heads (and the cache's head axis) are
    split too, and each shard pairs its heads by contiguous groups; with a map (kv heads
    replicated, q heads padded to a multiple of the axis size) the cache is whole on every
    shard and each shard reads its slice of the map.
    """
    size = mesh.shape[axis]

    def sharded(q, k_cache, v_cache, layer, token_seq, positions, page_table, *, sm_scale,
                sliding_window=None, soft_cap=None, kv_head_map=None, k_scale=None,
                v_scale=None, sinks=None):
        head_map = None if kv_head_map is None else jnp.asarray(kv_head_map, jnp.int32)
        window = jnp.asarray(
            jnp.iinfo(jnp.int32).max if sliding_window is None else sliding_window, jnp.int32
        )
        cache_spec = PartitionSpec() if head_map is not None else PartitionSpec(None, axis)
        local_heads = q.shape[1] // size
        scales = () if k_scale is None else (k_scale, v_scale)  # split like the caches
        sink = () if sinks is None else (sinks,)  # split like the q heads

        def local(q, k_cache, v_cache, layer, token_seq, positions, page_table, window, *rest):
            local_scales = dict(zip(("k_scale", "v_scale")[:len(scales)], rest, strict=False))
            if sink:
                local_scales["sinks"] = rest[len(scales)]
            local_map = None
            if head_map is not None:  # this shard's slice of the q -> kv head map
                start = jax.lax.axis_index(axis) * local_heads
                local_map = jax.lax.dynamic_slice_in_dim(rest[-1], start, local_heads)
            return fn(q, k_cache, v_cache, layer, token_seq, positions, page_table,
                      sm_scale=sm_scale, sliding_window=window, soft_cap=soft_cap,
                      kv_head_map=local_map, **local_scales)

        heads, rep = PartitionSpec(None, axis, None), PartitionSpec()
        extra = () if head_map is None else (head_map,)
        return jax.shard_map(
            local, mesh=mesh,
            in_specs=(heads, cache_spec, cache_spec) + (rep,) * 5 + (cache_spec,) * len(scales)
            + (PartitionSpec(axis),) * len(sink) + (rep,) * len(extra),
            out_specs=heads, check_vma=False,
        )(q, k_cache, v_cache, layer, token_seq, positions, page_table, window, *scales, *sink,
          *extra)

    return sharded
