"""Times the native `cpu` attention backend against the reference on SmolLM2's shapes, one run.

Decode: S sequences of `slots` cached keys each, one query token per sequence (the reference's
per-token gather). Prefill: one 512-token chunk over 1000 cached tokens; the reference runs
`blocked_paged_attention` with 32-row blocks at the runner's bound for T = 512, S = 64 (78
blocks, 16 of them real; `experiments/prefill_bench.py` times the runner's path). Also the K/V
write of 64 tokens: a plain XLA scatter (`.at[].set`), the reference `write_kv` (16-bit caches
scattered as uint16 bits) and the in-place FFI write, f32 and bf16 caches, donated.
Medians over `--reps` calls of one jitted layer call (4-layer cache, layer 1, pages shuffled).
`--isa` picks the kernel's instruction set; two or more (`--isa avx2,avx512`) time only the
kernel, each path against the first, reps interleaved so that load on a shared machine falls on
all of them alike: decode 64 x 256 and 1 x 256, and the prefill chunk, over f32, bf16 and int8
caches (int8: one f32 scale per row, widened per page like bf16). `--baseline LIB` times
another build of the kernel library (e.g. the last commit's sources compiled into a temporary
directory) beside this one on each `--isa`, reps interleaved, each ratio against its baseline.

    python scripts/cpu_attention_bench.py [--reps 20] [--isa auto | --isa avx2,avx512]
                                          [--baseline /tmp/old/_cpu_kernels.so]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jengine.cpu_kernels import attention as cpu
from jengine.cpu_kernels import library
from jengine.cpu_kernels.attention import ragged_paged_attention_cpu, write_kv_cpu
from jengine.pallas_kernels import (
    blocked_paged_attention,
    num_query_blocks,
    quantize_rows,
    query_blocks,
    ragged_paged_attention,
    write_kv,
)

HEADS, KV_HEADS, HEAD_DIM, PAGE, LAYERS = 9, 3, 64, 16, 4
SCALE = HEAD_DIM ** -0.5
BASELINE_TARGET = "jengine_paged_attention_baseline"
KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8)  # the per-path table's caches


def _median_ms(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _cache(num_pages: int, dtype, rng) -> jax.Array:
    shape = (LAYERS, KV_HEADS, num_pages, PAGE, HEAD_DIM)
    return jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dtype)


def _page_table(kv_lens: list[int], rng) -> tuple[np.ndarray, int]:
    counts = [-(-n // PAGE) for n in kv_lens]
    num_pages = sum(counts) + 1
    pool = iter(rng.permutation(np.arange(1, num_pages)))
    table = np.zeros((len(kv_lens), max(counts)), np.int32)
    for row, count in enumerate(counts):
        table[row, :count] = [next(pool) for _ in range(count)]
    return table, num_pages


def _interleaved_median_ms(calls: dict, *args, reps: int) -> dict[str, float]:
    """Median ms of each call, one rep of every call in turn."""
    for fn in calls.values():
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in calls}
    for _ in range(reps):
        for name, fn in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def _decode_inputs(num_seqs: int, slots: int, rng) -> tuple[jax.Array, tuple, int]:
    """q [S, H, D], (token_seq, positions, page_table), pool pages: one query per sequence."""
    table, num_pages = _page_table([slots] * num_seqs, rng)
    q = jnp.asarray(rng.normal(size=(num_seqs, HEADS, HEAD_DIM)), jnp.float32)
    token_seq = jnp.arange(num_seqs, dtype=jnp.int32)
    positions = jnp.full((num_seqs,), slots - 1, jnp.int32)
    return q, (token_seq, positions, jnp.asarray(table)), num_pages


def _prefill_inputs(chunk: int, cached: int, seq_bucket: int,
                    rng) -> tuple[jax.Array, jax.Array, np.ndarray, int]:
    """q [chunk, H, D], positions, page table (padded to `seq_bucket` rows), pool pages."""
    table, num_pages = _page_table([cached + chunk], rng)
    table = np.concatenate([table, np.zeros((seq_bucket - 1, table.shape[1]), np.int32)])
    q = jnp.asarray(rng.normal(size=(chunk, HEADS, HEAD_DIM)), jnp.float32)
    positions = jnp.arange(cached, cached + chunk, dtype=jnp.int32)
    return q, positions, table, num_pages


def decode_case(num_seqs: int, slots: int, reps: int, isa: str) -> dict[str, float]:
    rng = np.random.default_rng(0)
    q, args, num_pages = _decode_inputs(num_seqs, slots, rng)
    kernel = functools.partial(ragged_paged_attention_cpu, isa=isa)
    out = {}
    for name, fn in (("reference", ragged_paged_attention), ("cpu", kernel)):
        for dtype in (jnp.float32, jnp.bfloat16):
            k, v = _cache(num_pages, dtype, rng), _cache(num_pages, dtype, rng)
            call = jax.jit(lambda q, k, v, layer, *a, fn=fn: fn(q, k, v, layer, *a,
                                                                 sm_scale=SCALE))
            key = f"{name} {jnp.dtype(dtype).name}"
            out[key] = _median_ms(call, q, k, v, jnp.int32(1), *args, reps=reps)
    return out


def prefill_case(chunk: int, cached: int, seq_bucket: int, reps: int,
                 isa: str) -> dict[str, float]:
    rng = np.random.default_rng(1)
    q, positions, table, num_pages = _prefill_inputs(chunk, cached, seq_bucket, rng)
    token_seq = jnp.zeros((chunk,), jnp.int32)
    blocks, block_seq = query_blocks([chunk], chunk, num_query_blocks(chunk, seq_bucket, 32), 32)
    out = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        k, v = _cache(num_pages, dtype, rng), _cache(num_pages, dtype, rng)
        dt = jnp.dtype(dtype).name
        call = jax.jit(lambda q, k, v, layer, pos, pt, bt, bs: blocked_paged_attention(
            q, k, v, layer, pos, pt, bt, bs, sm_scale=SCALE))
        out[f"reference {dt}"] = _median_ms(
            call, q, k, v, jnp.int32(1), positions, jnp.asarray(table),
            jnp.asarray(blocks), jnp.asarray(block_seq), reps=reps)
        call = jax.jit(lambda q, k, v, layer, ts, pos, pt: ragged_paged_attention_cpu(
            q, k, v, layer, ts, pos, pt, sm_scale=SCALE, isa=isa))
        out[f"cpu {dt}"] = _median_ms(call, q, k, v, jnp.int32(1), token_seq, positions,
                                      jnp.asarray(table), reps=reps)
    return out


def write_case(num_tokens: int, num_pages: int, reps: int) -> dict[str, float]:
    rng = np.random.default_rng(2)
    slots = jnp.asarray(rng.choice(num_pages * PAGE, num_tokens, replace=False), jnp.int32)
    new = jnp.asarray(rng.normal(size=(num_tokens, KV_HEADS, HEAD_DIM)), jnp.float32)
    out = {}
    def plain(cache, layer, slots, new):  # write_kv before it scattered 16-bit caches as uint16
        at = cache.at[layer, :, slots // PAGE, slots % PAGE]
        return at.set(new.astype(cache.dtype))

    fns = (("XLA scatter", plain), ("reference write_kv", write_kv), ("cpu FFI", write_kv_cpu))
    for name, fn in fns:
        for dtype in (jnp.float32, jnp.bfloat16):
            call = jax.jit(fn, donate_argnums=0)
            cache = _cache(num_pages, dtype, rng)
            times = []
            for _ in range(reps + 1):
                start = time.perf_counter()
                cache = jax.block_until_ready(call(cache, jnp.int32(1), slots, new))
                times.append(time.perf_counter() - start)
            out[f"{name} {jnp.dtype(dtype).name}"] = 1e3 * statistics.median(times[1:])
    return out


def register_baseline(path: str) -> None:
    """Registers another build's attention handler as BASELINE_TARGET (ctypes loads each file
    with its own symbols, so both builds live in this process)."""
    lib = ctypes.CDLL(path)
    jax.ffi.register_ffi_target(BASELINE_TARGET, jax.ffi.pycapsule(lib.JenginePagedAttention),
                                platform="cpu")


def _kernel_cache(num_pages: int, dtype, rng) -> tuple:
    """(k, v, k_scale, v_scale): float caches without scales, an int8 one quantized per row."""
    if jnp.dtype(dtype) != jnp.int8:
        return _cache(num_pages, dtype, rng), _cache(num_pages, dtype, rng), None, None
    (k, k_scale), (v, v_scale) = (quantize_rows(_cache(num_pages, jnp.float32, rng))
                                  for _ in range(2))
    return k, v, k_scale, v_scale


def isa_case(paths: dict[str, tuple[str, str | None]], q: jax.Array, args: tuple, num_pages: int,
             reps: int, rng) -> dict[str, float]:
    """The kernel alone on each path (name -> (isa, FFI target; None: this build's)), f32,
    bf16 and int8 caches, reps interleaved."""
    out = {}
    for dtype in KERNEL_DTYPES:
        caches = _kernel_cache(num_pages, dtype, rng)
        calls = {name: jax.jit(lambda q, k, v, ks, vs, layer, *a, isa=isa, target=target:
                               ragged_paged_attention_cpu(q, k, v, layer, *a, sm_scale=SCALE,
                                                          k_scale=ks, v_scale=vs, isa=isa,
                                                          ffi_target=target))
                 for name, (isa, target) in paths.items()}
        times = _interleaved_median_ms(calls, q, *caches, jnp.int32(1), *args, reps=reps)
        out.update({f"{name} {jnp.dtype(dtype).name}": t for name, t in times.items()})
    return out


def compare_paths(isas: list[str], reps: int, baseline: bool) -> None:
    """One table row per case: each path's median and its ratio to its base (the first isa's,
    or with a baseline library that isa's baseline)."""
    paths, base_of = {}, {}
    for isa in isas:
        if baseline:
            paths[f"{isa} baseline"] = (isa, BASELINE_TARGET)
        paths[isa] = (isa, None)
        base_of[isa] = f"{isa} baseline" if baseline else isas[0]
    cols = [f"{name} {dt}{'' if base_of.get(name, name) == name else ' (ratio)'}"
            for dt in ("f32", "bf16", "int8") for name in paths]
    print("| case | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    rng = np.random.default_rng(3)
    cases = [(f"decode {s} x {n}", *_decode_inputs(s, n, rng), reps) for s, n in ((64, 256),
                                                                               (1, 256))]
    q, positions, table, num_pages = _prefill_inputs(512, 1000, 64, rng)
    cases.append(("prefill 512 over 1000", q, (jnp.zeros((512,), jnp.int32), positions,
                                               jnp.asarray(table)), num_pages, max(3, reps // 4)))
    for name, q, args, num_pages, case_reps in cases:
        r = isa_case(paths, q, args, num_pages, case_reps, rng)
        cells = []
        for dt in ("float32", "bfloat16", "int8"):
            for path in paths:
                t, base = r[f"{path} {dt}"], base_of.get(path, path)
                ratio = "" if base == path else f" ({t / r[f'{base} {dt}']:.2f}x)"
                cells.append(f"{t:.3f} ms{ratio}")
        print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--isa", default="auto",
                        help=f"the kernel's instruction set, or several, comma-separated, to "
                             f"compare: {', '.join(library.isas('attention'))}")
    parser.add_argument("--baseline", metavar="LIB",
                        help="another build of the kernel library (_cpu_kernels*.so) to time")
    args = parser.parse_args()
    isas = args.isa.split(",")
    unknown = [isa for isa in isas if isa not in library.isas("attention")]
    if unknown:
        parser.error(f"unknown --isa {unknown}; choose from {list(library.isas('attention'))}")
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
          f"auto = {cpu.best_isa()}, timed: {', '.join(isas)}")
    if args.baseline:
        register_baseline(args.baseline)
    if len(isas) > 1 or args.baseline:
        compare_paths(isas, args.reps, bool(args.baseline))
        return
    print("| case | " + " | ".join(["reference f32", "cpu f32", "ratio f32", "reference bf16",
                                     "cpu bf16", "ratio bf16"]) + " |")
    print("|---|---|---|---|---|---|---|")
    for seqs, slots in ((64, 256), (8, 1024), (1, 2048)):
        r = decode_case(seqs, slots, args.reps, isas[0])
        print(f"| decode {seqs} x {slots} | {r['reference float32']:.3f} ms | "
              f"{r['cpu float32']:.3f} ms | {r['cpu float32'] / r['reference float32']:.2f}x | "
              f"{r['reference bfloat16']:.3f} ms | {r['cpu bfloat16']:.3f} ms | "
              f"{r['cpu bfloat16'] / r['reference bfloat16']:.2f}x |")
    r = prefill_case(512, 1000, 64, max(3, args.reps // 4), isas[0])
    print(f"| prefill 512 over 1000, reference blocked | "
          f"{r['reference float32']:.2f} ms | {r['cpu float32']:.2f} ms | "
          f"{r['cpu float32'] / r['reference float32']:.3f}x | "
          f"{r['reference bfloat16']:.2f} ms | {r['cpu bfloat16']:.2f} ms | "
          f"{r['cpu bfloat16'] / r['reference bfloat16']:.3f}x |")
    w = write_case(64, 64 * 16 + 1, args.reps)
    for base in ("XLA scatter", "reference write_kv"):
        print(f"| K write, 64 tokens, 1025-page pool: {base} vs cpu FFI | "
              f"{w[f'{base} float32']:.3f} ms | {w['cpu FFI float32']:.3f} ms | "
              f"{w['cpu FFI float32'] / w[f'{base} float32']:.2f}x | "
              f"{w[f'{base} bfloat16']:.3f} ms | {w['cpu FFI bfloat16']:.3f} ms | "
              f"{w['cpu FFI bfloat16'] / w[f'{base} bfloat16']:.2f}x |")


if __name__ == "__main__":
    main()
