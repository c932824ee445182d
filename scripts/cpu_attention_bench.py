"""Times the native `cpu` attention backend against the reference on SmolLM2's shapes, one run.

Decode: S sequences of `slots` cached keys each, one query token per sequence (the reference's
per-token gather). Prefill: one 512-token chunk over 1000 cached tokens; the reference runs
`blocked_paged_attention` with 32-row blocks at the runner's bound for T = 512, S = 64 (78
blocks, 16 of them real; `scripts/prefill_bench.py` times the runner's path). Also the K/V write of
64 tokens: a plain XLA scatter (`.at[].set`), the reference `write_kv` (16-bit caches scattered
as uint16 bits) and the in-place FFI write, f32 and bf16 caches, donated.
Medians over `--reps` calls of one jitted layer call (4-layer cache, layer 1, pages shuffled).

    python scripts/cpu_attention_bench.py [--reps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jengine.pallas_kernels import (
    blocked_paged_attention,
    num_query_blocks,
    query_blocks,
    ragged_paged_attention,
    ragged_paged_attention_cpu,
    write_kv,
    write_kv_cpu,
)

HEADS, KV_HEADS, HEAD_DIM, PAGE, LAYERS = 9, 3, 64, 16, 4
SCALE = HEAD_DIM ** -0.5


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


def decode_case(num_seqs: int, slots: int, reps: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    table, num_pages = _page_table([slots] * num_seqs, rng)
    q = jnp.asarray(rng.normal(size=(num_seqs, HEADS, HEAD_DIM)), jnp.float32)
    token_seq = jnp.arange(num_seqs, dtype=jnp.int32)
    positions = jnp.full((num_seqs,), slots - 1, jnp.int32)
    args = (token_seq, positions, jnp.asarray(table))
    out = {}
    for name, fn in (("reference", ragged_paged_attention), ("cpu", ragged_paged_attention_cpu)):
        for dtype in (jnp.float32, jnp.bfloat16):
            k, v = _cache(num_pages, dtype, rng), _cache(num_pages, dtype, rng)
            call = jax.jit(lambda q, k, v, layer, *a, fn=fn: fn(q, k, v, layer, *a,
                                                                 sm_scale=SCALE))
            key = f"{name} {jnp.dtype(dtype).name}"
            out[key] = _median_ms(call, q, k, v, jnp.int32(1), *args, reps=reps)
    return out


def prefill_case(chunk: int, cached: int, seq_bucket: int, reps: int) -> dict[str, float]:
    rng = np.random.default_rng(1)
    table, num_pages = _page_table([cached + chunk], rng)
    table = np.concatenate([table, np.zeros((seq_bucket - 1, table.shape[1]), np.int32)])
    q = jnp.asarray(rng.normal(size=(chunk, HEADS, HEAD_DIM)), jnp.float32)
    positions = jnp.arange(cached, cached + chunk, dtype=jnp.int32)
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
            q, k, v, layer, ts, pos, pt, sm_scale=SCALE))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    print("| case | " + " | ".join(["reference f32", "cpu f32", "ratio f32", "reference bf16",
                                     "cpu bf16", "ratio bf16"]) + " |")
    print("|---|---|---|---|---|---|---|")
    for seqs, slots in ((64, 256), (8, 1024), (1, 2048)):
        r = decode_case(seqs, slots, args.reps)
        print(f"| decode {seqs} x {slots} | {r['reference float32']:.3f} ms | "
              f"{r['cpu float32']:.3f} ms | {r['cpu float32'] / r['reference float32']:.2f}x | "
              f"{r['reference bfloat16']:.3f} ms | {r['cpu bfloat16']:.3f} ms | "
              f"{r['cpu bfloat16'] / r['reference bfloat16']:.2f}x |")
    r = prefill_case(512, 1000, 64, max(3, args.reps // 4))
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
