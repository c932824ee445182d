"""XLA:CPU's f32 dot by row count: what a step of a few query tokens costs against a step of one.

One jitted program of `--layers` [K x N] projections (SmolLM2's 576 x 1536 by default), each
followed by tanh so every product is materialised; rows M = 1, 2, 4, 8, 16, 64, 512. Reports
the median wall time per program, the ratio to M = 1, the weight bytes per second and the
GFLOP/s, cases alternating for `--reps` rounds. Speculative verification runs k + 1 rows per
sequence, so this ratio is what it must earn back (docs/engine.md, "Speculative decoding").

    python scripts/small_row_dots.py [--layers 20 --reps 7]
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
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    weights = [jnp.asarray(rng.standard_normal((args.k, args.n), np.float32))
               for _ in range(args.layers)]

    @jax.jit
    def program(x, ws):
        return sum(jnp.sum(jnp.tanh(x @ w)) for w in ws)

    inputs = {m: jnp.asarray(rng.standard_normal((m, args.k), np.float32)) for m in args.rows}
    for x in inputs.values():
        program(x, weights).block_until_ready()
    times: dict[int, list[float]] = {m: [] for m in args.rows}
    for _ in range(args.reps):
        for m, x in inputs.items():
            start = time.perf_counter()
            program(x, weights).block_until_ready()
            times[m].append(time.perf_counter() - start)
    nbytes = args.layers * args.k * args.n * 4
    base = statistics.median(times[args.rows[0]])
    print("| rows | ms | vs 1 row | weight GB/s | GFLOP/s |")
    print("|---|---|---|---|---|")
    for m, ts in times.items():
        t = statistics.median(ts)
        flops = 2 * m * args.k * args.n * args.layers
        print(f"| {m} | {1e3 * t:.2f} | {t / base:.2f}x | {nbytes / t / 1e9:.1f} | "
              f"{flops / t / 1e9:.1f} |")


if __name__ == "__main__":
    main()
