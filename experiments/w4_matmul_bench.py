"""One question: how long does a SmolLM2 layer stack's 4-bit projections take per call, by
path (each forced), against the weight dequantized to bf16 for XLA's dot (AMX where the CPU
has it; `xla_f32`: to f32), at decode and prefill row counts? Medians of interleaved
repeats, one process.

    PYTHONPATH=. python -P experiments/w4_matmul_bench.py [--rows 1 8 32 64 512] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jengine.cpu_kernels import w4_matmul as w4

# SmolLM2-135M's projections (K, N): q, k/v, o, gate/up, down; 30 layers.
SHAPES = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
LAYERS = 30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 512])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--isas", nargs="+", default=["avx512", "avx512_vnni", "xla_bf16"])
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    weights = []
    for k, n in SHAPES * LAYERS:  # each layer its own weights: a step streams them all
        q = rng.integers(0, 16, (k, n)).astype(np.uint8)
        s = rng.uniform(0.001, 0.05, (k // 32, n)).astype(np.float32)
        m = rng.uniform(-0.4, 0.0, (k // 32, n)).astype(np.float32)
        weights.append((tuple(jnp.asarray(a) for a in w4.pack(q, s, m)), n))

    def program(isa):
        def run(xs, packs):  # weights as arguments: as constants XLA folds the dequantize
            outs = []
            for (_, n), packed, x in zip(weights, packs, xs * LAYERS):
                if isa in ("xla_bf16", "xla_f32"):
                    dtype = jnp.bfloat16 if isa == "xla_bf16" else jnp.float32
                    wd = w4.dequantize(*packed, n, dtype)
                    outs.append(jnp.dot(x.astype(dtype), wd,
                                        preferred_element_type=jnp.float32)[0, 0])
                else:
                    outs.append(w4.w4_matmul(x, *packed, n, isa=isa)[0, 0])
            return jnp.stack(outs).sum()
        return jax.jit(run)

    progs = {isa: program(isa) for isa in args.isas}
    for r in args.rows:
        xs = [jnp.asarray(rng.standard_normal((r, k)).astype(np.float32)) for k, _ in SHAPES]
        times = {isa: [] for isa in progs}
        packs = [p for p, _ in weights]
        for f in progs.values():
            f(xs, packs).block_until_ready()
        for _ in range(args.reps):
            for isa, f in progs.items():
                t = time.perf_counter()
                f(xs, packs).block_until_ready()
                times[isa].append(time.perf_counter() - t)
        cells = "  ".join(f"{isa} {statistics.median(v) * 1e3:8.2f} ms" for isa, v in times.items())
        print(f"rows {r:4d}: {cells}", flush=True)


if __name__ == "__main__":
    main()
