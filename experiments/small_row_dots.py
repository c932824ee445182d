"""XLA:CPU's f32 dot by row count: what a step of a few query tokens costs against a step of one.

One jitted program of `--layers` [K x N] projections (SmolLM2's 576 x 1536 by default), each
followed by tanh so every product is materialised; rows M = 1, 2, 4, 8, 16, 64, 512. Reports
the median wall time per program, the ratio to M = 1, the weight bytes per second and the
GFLOP/s, cases alternating for `--reps` rounds. Speculative verification runs k + 1 rows per
sequence, so this ratio is what it must earn back (docs/engine.md, "Speculative decoding").
`--backends xla native` times the same program with jengine's native small-row matmul
(`jengine.cpu_kernels.matmul`) in place of XLA's dot, both in one process, interleaved.

    python experiments/small_row_dots.py [--layers 20 --reps 7 --backends xla native]
    python experiments/small_row_dots.py --k 576 --n 49152 --layers 1 --transposed  # tied lm_head
    python experiments/small_row_dots.py --backends xla native --weight-dtypes float32 bfloat16 int8

`--weight-dtypes` stores the weights narrower: XLA then converts them to f32 in the program (what
a weight-only mode costs on XLA:CPU), the native kernel widens them in registers; an int8 case is
scaled per column after the dot, as `w8a16` does.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--n", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 512])
    ap.add_argument("--backends", nargs="+", default=["xla"], choices=["xla", "native"])
    ap.add_argument("--isa", default="auto", help="the native kernel's instruction set")
    ap.add_argument("--weight-dtypes", nargs="+", default=["float32"],
                    choices=["float32", "bfloat16", "int8"])
    ap.add_argument("--transposed", action="store_true",
                    help="weights stored [N, K], x @ w.T (a tied embedding as the output head)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    shape = (args.n, args.k) if args.transposed else (args.k, args.n)
    f32 = [rng.standard_normal(shape, np.float32) for _ in range(args.layers)]
    weights = {dt: [jnp.asarray(w).astype(dt) for w in f32] for dt in args.weight_dtypes}
    if "int8" in weights:
        weights["int8"] = [jnp.asarray(np.clip(np.round(w * 40), -127, 127).astype(np.int8))
                           for w in f32]
    scale = jnp.full((args.n,), 1 / 40, jnp.float32)

    def make(backend: str, dtype: str):
        def mm(x, w):
            if backend == "native":
                from jengine.cpu_kernels.matmul import small_matmul
                y = small_matmul(x, w, transpose_w=args.transposed, isa=args.isa)
            else:
                w = w.astype(jnp.float32)
                y = x @ w.T if args.transposed else x @ w
            return y * scale if dtype == "int8" else y
        return jax.jit(lambda x, ws: sum(jnp.sum(jnp.tanh(mm(x, w))) for w in ws))

    programs = {(b, d): make(b, d) for b in args.backends for d in args.weight_dtypes}
    inputs = {m: jnp.asarray(rng.standard_normal((m, args.k), np.float32)) for m in args.rows}
    cases = [(b, d, m) for m in args.rows for d in args.weight_dtypes for b in args.backends]
    for b, d, m in cases:
        programs[b, d](inputs[m], weights[d]).block_until_ready()
    times: dict[tuple[str, str, int], list[float]] = {c: [] for c in cases}
    for _ in range(args.reps):
        for b, d, m in cases:
            start = time.perf_counter()
            programs[b, d](inputs[m], weights[d]).block_until_ready()
            times[b, d, m].append(time.perf_counter() - start)
    first = (args.backends[0], args.weight_dtypes[0])
    print(f"| backend | weights | rows | ms | vs 1 row ({' '.join(first)}) | vs {' '.join(first)} "
          "| weight GB/s | GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    base = statistics.median(times[(*first, args.rows[0])])
    for b, d, m in cases:
        t = statistics.median(times[b, d, m])
        same = statistics.median(times[(*first, m)])
        nbytes = args.layers * args.k * args.n * np.dtype(jnp.dtype(d)).itemsize
        flops = 2 * m * args.k * args.n * args.layers
        print(f"| {b} | {d} | {m} | {1e3 * t:.2f} | {t / base:.2f}x | {t / same:.2f}x | "
              f"{nbytes / t / 1e9:.1f} | {flops / t / 1e9:.1f} |")


if __name__ == "__main__":
    main()
