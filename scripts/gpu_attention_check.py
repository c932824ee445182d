"""GPU check of the Pallas Triton attention kernel: correctness against the reference, then decode
attention time against the reference at batch 64 x 2k context. Needs only jax (with CUDA) and
numpy; runs in well under 5 minutes on one GPU.

    python scripts/gpu_attention_check.py              # on a GPU machine
    python scripts/gpu_attention_check.py --interpret  # anywhere: tiny shapes, interpret mode

Prints one JSON line per check and exits non-zero if any correctness check fails.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jengine.pallas_kernels import (  # noqa: E402
    quantize_rows,
    ragged_paged_attention,
    ragged_paged_attention_gpu,
)


def emit(row: dict) -> None:
    """One result line (scripts/gpu_session.py replaces this to log them)."""
    print(json.dumps(row), flush=True)


def make_batch(rng, seqs, *, num_heads, num_kv, head_dim, page_size, dtype, spare_pages=4):
    """A ragged batch over shuffled pages: `seqs` is (kv_len, q_len) per sequence; the query
    tokens are the last q_len positions. Unwritten cache slots hold random values too."""
    pages_per_seq = [-(-kv // page_size) for kv, _ in seqs]
    num_pages = 1 + sum(pages_per_seq) + spare_pages
    width = max(pages_per_seq)
    pool = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((len(seqs), width), np.int32)
    start = 0
    for i, n in enumerate(pages_per_seq):
        table[i, :n] = pool[start:start + n]
        start += n
    cache_shape = (1, num_kv, num_pages, page_size, head_dim)
    k = jnp.asarray(rng.normal(size=cache_shape), dtype)
    v = jnp.asarray(rng.normal(size=cache_shape), dtype)
    token_seq = np.concatenate([np.full(q, i) for i, (_, q) in enumerate(seqs)]).astype(np.int32)
    positions = np.concatenate([np.arange(kv - q, kv) for kv, q in seqs]).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(len(token_seq), num_heads, head_dim)), dtype)
    return (q, k, v, jnp.int32(0), jnp.asarray(token_seq), jnp.asarray(positions),
            jnp.asarray(table))


def _cases(interpret: bool, wide: bool):
    """(dtype, tol, heads, kv heads, head dim, int8 KV, soft-cap) per kernel configuration."""
    if interpret:  # ~5 s per kernel call in interpret mode: one
        return [(jnp.float32, 2e-4, 9, 3, 64, False, None)]
    cases = [(dtype, tol, h, kv, 64, False, None)
             for dtype, tol in ((jnp.float32, 2e-4), (jnp.bfloat16, 3e-2))
             for h, kv in ((8, 8), (9, 3), (16, 2))]
    if wide:  # Llama-3-8B's heads, a soft-capped model, an int8 cache
        cases += [(jnp.bfloat16, 3e-2, 32, 8, 128, False, None),
                  (jnp.float32, 2e-4, 32, 8, 128, False, None),
                  (jnp.bfloat16, 3e-2, 8, 8, 64, False, 20.0),
                  (jnp.bfloat16, 3e-2, 32, 8, 128, True, None),
                  (jnp.float32, 2e-4, 9, 3, 64, True, None)]
    return cases


def correctness(args, rng, wide: bool = False):
    """The kernel against the reference on a ragged batch (decodes, prefill chunks, kv len 1,
    page boundaries) for each case and three (window, splits, block_q) settings; `wide` adds
    Llama-3-8B's head shape, soft-cap and an int8 cache."""
    ok = True
    kernel = functools.partial(ragged_paged_attention_gpu, interpret=args.interpret)
    seqs = [(37, 1), (5, 5), (64, 16), (1, 1), (20, 1), (33, 9)]
    for dtype, tol, num_heads, num_kv, head_dim, kv_int8, cap in _cases(args.interpret, wide):
        batch = make_batch(rng, seqs, num_heads=num_heads, num_kv=num_kv, head_dim=head_dim,
                           page_size=16, dtype=dtype)
        scales = {}
        if kv_int8:
            (kq, ks), (vq, vs) = quantize_rows(batch[1]), quantize_rows(batch[2])
            batch = (batch[0], kq, vq, *batch[3:])
            scales = dict(k_scale=ks, v_scale=vs)
        for window, splits, block_q in ((None, 1, 16), (24, 1, 4), (None, 4, 1)):
            kw = dict(sm_scale=head_dim ** -0.5, sliding_window=window, soft_cap=cap, **scales)
            # XLA's default precision rounds f32 dots to tf32 on a GPU (3e-4 off float64 on
            # the H200); the kernel's f32 dots are exact, so the oracle must be too.
            with jax.default_matmul_precision("highest"):
                ref = jax.jit(functools.partial(ragged_paged_attention, **kw))(*batch)
            out = jax.jit(functools.partial(kernel, block_q=block_q, num_kv_splits=splits,
                                            **kw))(*batch)
            diff = out.astype(jnp.float32) - ref.astype(jnp.float32)
            err = float(jnp.max(jnp.abs(diff)))
            rel = float(jnp.linalg.norm(diff) / jnp.linalg.norm(ref.astype(jnp.float32)))
            passed = err <= tol and bool(jnp.all(jnp.isfinite(out)))
            ok &= passed
            emit({"check": "correctness", "dtype": jnp.dtype(dtype).name, "heads": num_heads,
                  "kv_heads": num_kv, "head_dim": head_dim, "kv_int8": kv_int8,
                  "soft_cap": cap, "window": window, "splits": splits, "block_q": block_q,
                  "max_abs_err": err, "rel_err": rel, "tol": tol, "ok": passed})
    return ok


def timed(fn, batch, iters):
    out = fn(*batch)
    out.block_until_ready()  # compile + warm
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn(*batch).block_until_ready()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def decode_timing(args, rng):
    batch_size, context = (2, 64) if args.interpret else (args.batch, args.context)
    iters = 2 if args.interpret else args.iters
    for num_heads, num_kv, head_dim in ((9, 3, 64), (32, 8, 128)):
        batch = make_batch(rng, [(context, 1)] * batch_size, num_heads=num_heads, num_kv=num_kv,
                           head_dim=head_dim, page_size=16, dtype=jnp.bfloat16)
        kw = dict(sm_scale=head_dim ** -0.5, sliding_window=None, soft_cap=None)
        ref_s = timed(jax.jit(functools.partial(ragged_paged_attention, **kw)), batch, iters)
        row = {"check": "decode_time", "batch": batch_size, "context": context,
               "heads": num_heads, "kv_heads": num_kv, "head_dim": head_dim,
               "reference_ms": ref_s * 1e3}
        for splits in (1, 4, 8, 16):
            fn = jax.jit(functools.partial(ragged_paged_attention_gpu, block_q=1,
                                           num_kv_splits=splits, interpret=args.interpret, **kw))
            row[f"pallas_gpu_split{splits}_ms"] = timed(fn, batch, iters) * 1e3
        kv_bytes = 2 * batch_size * context * num_kv * head_dim * 2
        best = min(v for k, v in row.items() if k.startswith("pallas"))
        row["pallas_best_GBps"] = kv_bytes / (best * 1e-3) / 1e9
        emit(row)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interpret", action="store_true",
                        help="run the kernel in interpret mode on tiny shapes (no GPU needed)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not args.interpret and jax.default_backend() != "gpu":
        print(f"no GPU (backend {jax.default_backend()}); use --interpret", file=sys.stderr)
        return 2
    print(json.dumps({"devices": [str(d) for d in jax.devices()], "jax": jax.__version__}))
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    ok = correctness(args, rng)
    decode_timing(args, rng)
    print(json.dumps({"ok": ok, "seconds": time.perf_counter() - t}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
