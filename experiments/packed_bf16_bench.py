"""GFLOP/s of a bf16 projection off AMX: the packed-bf16 kernel's paths (csrc/packed_bf16.cc)
against XLA:CPU's bf16 dot, its f32 dot and the small-row kernel, at SmolLM2's shapes; and the
fused SwiGLU against two packed dots and XLA's activation. Ratios only (a shared machine).
Run: python experiments/packed_bf16_bench.py [M ...]. XLA:CPU's own bf16 dot runs on the AMX
tiles where the CPU has them (jengine's `cpu_info.hiding` does not reach it, nor did
ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16), so on an AMX Xeon its column is not an EPYC's."""

import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jengine.cpu_kernels import matmul as cpu_matmul
from jengine.cpu_kernels import packed_bf16


def best(f, *args, reps=7):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    rng = np.random.default_rng(0)
    for m in [int(a) for a in sys.argv[1:]] or (1, 8, 64, 512):
        for k, n in ((576, 1536), (1536, 576), (576, 49152)):
            w = rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16)
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            tiles = jnp.asarray(cpu_matmul.amx_tiles(w))
            wb, wf, xf = jnp.asarray(w), jnp.asarray(w, jnp.float32), x.astype(jnp.float32)
            flop = 2 * m * k * n / 1e9
            row = {
                "xla_bf16": best(jax.jit(lambda a, b: jnp.dot(
                    a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)), x, wb),
                "xla_f32": best(jax.jit(jnp.dot), xf, wf),
            }
            if m <= 64:  # the small-row kernel: the bf16 weight as stored, f32 x
                row["small_row"] = best(jax.jit(lambda a, b: cpu_matmul.small_matmul(
                    a, b).astype(jnp.bfloat16)), xf, wb)
            for isa in packed_bf16.ISAS:
                f = jax.jit(lambda a, t, isa=isa, n=n: packed_bf16.packed_matmul(
                    a, t, n, out_dtype=jnp.bfloat16, isa=isa))
                row[isa] = best(f, x, tiles)
            print(f"M={m:4d} K={k:5d} N={n:6d} " + " ".join(
                f"{name} {flop / t:6.1f}" for name, t in row.items()), flush=True)

    k, n = 576, 1536
    for m in [int(a) for a in sys.argv[1:]] or (64, 512):
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        g, u = (jnp.asarray(cpu_matmul.amx_tiles(
            rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16))) for _ in range(2))

        def unfused(a, g, u):
            gate, up = (packed_bf16.packed_matmul(a, t, n, out_dtype=jnp.bfloat16)
                        for t in (g, u))
            return jax.nn.silu(gate.astype(jnp.float32)).astype(jnp.bfloat16) * up

        fused = best(jax.jit(lambda a, g, u: packed_bf16.packed_swiglu(a, g, u, n)), x, g, u)
        print(f"swiglu M={m}: fused / unfused time {fused / best(jax.jit(unfused), x, g, u):.2f}")


if __name__ == "__main__":
    main()
