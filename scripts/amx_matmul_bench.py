"""SmolLM2's bf16 projections, all 30 layers in one jitted program, by each kernel that can run
them: XLA:CPU's bf16 dot, the native small-row kernel (cpu_matmul.small_matmul, f32 rows) and
the AMX kernel over packed weights (cpu_matmul.amx_matmul). Every layer has weights of its own
(212 MB in all), so they stream from memory as in a decode step; each layer's input depends on
the previous layer's output, so the dots run in order. Same process, the programs called in
turn; prints the fastest of several timings in ms and the rate in GFLOP/s. `--baseline` adds
the AMX kernel of another build of the library (a copy of `_cpu_kernels*.so` from before a
change), timed in turn with this tree's in the same process. `--int8` adds the `int8` (W8A8)
projections: XLA's int8 dot and rescale (quant.einsum) against the AMX-INT8 kernel
(cpu_int8.amx_int8_matmul), both quantizing each row of x first. `--packed ISA...` adds the
packed-bf16 kernel off AMX (packed_bf16.packed_matmul, the same packed weights, each named
path forced) and the f32 model's projections as an f32 engine runs them (f32 weights: the
small-row kernel up to 32 rows, XLA's f32 dot above), so bf16 without AMX and f32 are timed in
one run; `--rounds` repeats the whole table and prints each cell's median over the rounds.

    PYTHONPATH=. python -P scripts/amx_matmul_bench.py [--rows 1 8 32 64 512] [--reps 7]
        [--baseline /tmp/old_cpu_kernels.so] [--int8] [--packed avx512_bf16 avx512 avx2]
        [--rounds 3]
"""

from __future__ import annotations

import argparse
import ctypes
import time

import jax
import jax.numpy as jnp
import numpy as np

from jengine.cpu_kernels import int8_matmul as cpu_int8
from jengine.cpu_kernels import matmul as cpu_matmul
from jengine.cpu_kernels import packed_bf16
from jengine.models import matmul, quant

E, F, KV, LAYERS = 576, 1536, 192, 30
SHAPES = {"wq": (E, E), "wk": (E, KV), "wv": (E, KV), "wo": (E, E), "w_gate": (E, F),
          "w_up": (E, F), "w_down": (F, E)}


def _layers(dot):
    """All layers' projections of x [R, E] (bf16) through `dot(x, name, layer)` -> f32."""
    def run(x, weights):
        for layer in weights:
            q, k, v = (dot(x, layer[n], n) for n in ("wq", "wk", "wv"))
            h = (q + jnp.tile(k + v, (1, E // KV))).astype(jnp.bfloat16)
            x = (x + dot(h, layer["wo"], "wo")).astype(jnp.bfloat16)
            g = dot(x, layer["w_gate"], "w_gate") * dot(x, layer["w_up"], "w_up")
            x = (x + dot(g.astype(jnp.bfloat16), layer["w_down"], "w_down")).astype(jnp.bfloat16)
        return x
    return jax.jit(run)


def _baseline_dot(path: str, threads: int):
    """amx_matmul's call, on the AMX target of the library at `path` (registered under a name
    of its own, so both builds serve one process)."""
    target = "jengine_amx_matmul_baseline"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(ctypes.CDLL(path).JengineAmxMatmul),
                                platform="cpu")

    def dot(x, w, name):
        n = SHAPES[name][1]
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
        return call(x, w, n=np.int64(n), max_threads=np.int32(threads))
    return dot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 512])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="the AMX kernel's max_threads")
    ap.add_argument("--baseline",
                    help="another build of the kernel library (_cpu_kernels*.so) to time beside")
    ap.add_argument("--int8", action="store_true", help="also the int8 (W8A8) projections")
    ap.add_argument("--packed", nargs="*", default=[], choices=packed_bf16.ISAS,
                    help="also the packed-bf16 kernel on these forced paths, and f32")
    ap.add_argument("--rounds", type=int, default=1, help="tables to time; medians printed")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    plain = [{n: jnp.asarray(rng.standard_normal(s, np.float32) * 0.04).astype(jnp.bfloat16)
              for n, s in SHAPES.items()} for _ in range(LAYERS)]
    packed = [{n: jnp.asarray(cpu_matmul.amx_tiles(np.asarray(w))) for n, w in layer.items()}
              for layer in plain]
    runs = {
        "xla": (_layers(lambda x, w, n: jnp.dot(x, w, preferred_element_type=jnp.float32)),
                plain),
        "small_matmul": (_layers(lambda x, w, n: cpu_matmul.small_matmul(
            x.astype(jnp.float32), w)), plain),
        "amx": (_layers(lambda x, w, n: cpu_matmul.amx_matmul(
            x, w, SHAPES[n][1], max_threads=args.threads)), packed),
    }
    if args.baseline:
        runs["amx baseline"] = (_layers(_baseline_dot(args.baseline, args.threads)), packed)
    if args.int8:
        qw = [{n: quant.quantize_weight(w, (0,), "int8") for n, w in layer.items()}
              for layer in plain]
        qpacked = [{n: (jnp.asarray(cpu_int8.amx_int8_tiles(np.asarray(w.q))), w.scale)
                    for n, w in layer.items()} for layer in qw]

        def amx_int8(x, w, n):
            xq, sx = quant.quantize_rows(x)
            return cpu_int8.amx_int8_matmul(xq, sx, *w, SHAPES[n][1], max_threads=args.threads)
        runs["xla int8"] = (_layers(lambda x, w, n: quant.einsum("tk,kn->tn", x, w)), qw)
        runs["amx int8"] = (_layers(amx_int8), qpacked)
    if args.packed:
        wide = [{n: w.astype(jnp.float32) for n, w in layer.items()} for layer in plain]
        runs["f32"] = (_layers(lambda x, w, n: matmul.dot(
            "te,ef->tf", x.astype(jnp.float32), w, "native")), wide)
    for isa in args.packed:
        runs[f"packed {isa}"] = (_layers(lambda x, w, n, isa=isa: packed_bf16.packed_matmul(
            x, w, SHAPES[n][1], isa=isa, max_threads=args.threads)), packed)
    flop_per_row = 2 * LAYERS * sum(k * n for k, n in SHAPES.values())
    print(f"| rows | {' | '.join(runs)} |")
    print("|---" * (len(runs) + 1) + "|")
    xs = {rows: jnp.asarray(rng.standard_normal((rows, E), np.float32)).astype(jnp.bfloat16)
          for rows in args.rows}
    timed = {rows: {} for rows in args.rows}  # rows -> run -> best time of each round
    for _ in range(args.rounds):
        for rows, x in xs.items():
            names = [n for n in runs if n != "small_matmul" or rows <= 64]
            for n in names:
                fn, w = runs[n]
                jax.block_until_ready(fn(x, w))
            best = dict.fromkeys(names, float("inf"))
            for _ in range(args.reps):
                for n in names:
                    fn, w = runs[n]
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(x, w))
                    best[n] = min(best[n], time.perf_counter() - t0)
            for n, t in best.items():
                timed[rows].setdefault(n, []).append(t)
    for rows in args.rows:
        med = {n: float(np.median(t)) for n, t in timed[rows].items()}
        cells = [f"{1e3 * med[n]:.1f} ms ({rows * flop_per_row / med[n] / 1e9:.0f})"
                 if n in med else "-" for n in runs]
        print(f"| {rows} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
