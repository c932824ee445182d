"""The native W8A8 kernel (jengine.cpu_kernels.int8_matmul) against XLA:CPU's int8
dot (jengine.models.quant, what `--quantization int8` runs otherwise), at SmolLM2's projection
shapes and its tied output head, for a range of row counts. Same process, alternating calls,
the fastest of several timings each; prints ms and GOP/s.

    PYTHONPATH=. python -P experiments/int8_matmul_bench.py [--rows 1 8 32 64 256 512]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jengine.cpu_kernels import int8_matmul as cpu_matmul
from jengine.models import quant

SHAPES = {  # name: (K, N, w^T)
    "qkv 576x960": (576, 960, False), "o 576x576": (576, 576, False),
    "gate_up 576x3072": (576, 3072, False), "down 1536x576": (1536, 576, False),
    "k 576x192": (576, 192, False), "lm_head^T 49152x576": (576, 49152, True),
}


def _times(fns, *args, reps: int) -> list[float]:
    """The fastest of `reps` timings of each fn, the fns called in turn (so a burst of noise
    from the shared machine hits both)."""
    for fn in fns:
        jax.block_until_ready(fn(*args))
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    print(f"kernel isa: {cpu_matmul.int8_isa()}")
    rng = np.random.default_rng(0)
    print(f"{'shape':22s} {'rows':>5s} {'xla ms':>8s} {'native ms':>9s} {'ratio':>6s} "
          f"{'xla GOP/s':>9s} {'native GOP/s':>12s}")
    for name, (k, n, tw) in SHAPES.items():
        wf = jnp.asarray(rng.standard_normal((n, k) if tw else (k, n)), jnp.float32)
        w = quant.quantize_weight(wf, (1,) if tw else (0,), "int8")
        eq = "te,ve->tv" if tw else "tk,kn->tn"
        xla = jax.jit(lambda x, w=w, eq=eq: quant.einsum(eq, x, w))

        def native(x, w=w, tw=tw):
            xq, sx = quant.quantize_rows(x)
            return cpu_matmul.int8_matmul(xq, sx, w.q, w.scale, transpose_w=tw)

        native = jax.jit(native)
        for r in args.rows:
            x = jnp.asarray(rng.standard_normal((r, k)), jnp.float32)
            np.testing.assert_array_equal(np.asarray(xla(x)), np.asarray(native(x)))
            reps = max(5, args.reps // max(1, r // 64))
            a, b = _times([xla, native], x, reps=reps)
            ops = 2 * r * k * n / 1e9
            print(f"{name:22s} {r:5d} {a * 1e3:8.3f} {b * 1e3:9.3f} {a / b:6.2f} "
                  f"{ops / a:9.0f} {ops / b:12.0f}", flush=True)


if __name__ == "__main__":
    main()
