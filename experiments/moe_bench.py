"""Time of one sparse MoE MLP layer on this machine's default device, per compute strategy.

Strategies (all exact): `gather` and `dense` (jengine/models/moe.py) and `ragged`: the token
copies sorted by expert and run through `jax.lax.ragged_dot` (one grouped matmul per weight).
Random float32 weights of X experts [E, F], top-k routing of T tokens; a figure is the median
wall time of `--reps` jitted calls after one warm-up, strategies alternating per token count.

    python -P experiments/moe_bench.py [--experts 64] [--top-k 8] [--embed 1024] [--width 384]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jengine.models import moe


def ragged(h, p, experts, weights):
    """Sort the T*k token copies by expert, grouped matmuls, weighted scatter-add back."""
    t, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat)
    rows = h[order // k]  # [T*k, E]
    sizes = jnp.bincount(flat, length=p["we_gate"].shape[0])
    gate = jax.lax.ragged_dot(rows, p["we_gate"], sizes)
    up = jax.lax.ragged_dot(rows, p["we_up"], sizes)
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, p["we_down"], sizes)  # [T*k, E]
    out = out * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(h).at[order // k].add(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--embed", type=int, default=1024)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    x, k, e, f = args.experts, args.top_k, args.embed, args.width
    rng = np.random.default_rng(0)
    p = {n: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[1]), jnp.float32) for n, s in
         (("we_gate", (x, e, f)), ("we_up", (x, e, f)), ("we_down", (x, f, e)))}
    fns = {
        "gather": jax.jit(moe._gather_experts),
        "dense": jax.jit(lambda h, p, ex, w: moe._dense_experts(h, p, ex, w, x)),
        "ragged": jax.jit(ragged),
    }
    print(f"X={x} k={k} E={e} F={f} on {jax.devices()[0].platform}: median ms per layer")
    print(f"{'T':>5s} " + " ".join(f"{n:>9s}" for n in fns))
    for t in args.tokens:
        h = jnp.asarray(rng.standard_normal((t, e)), jnp.float32)
        ex = jnp.asarray(np.stack([rng.choice(x, k, replace=False) for _ in range(t)]), jnp.int32)
        w = jnp.asarray(rng.uniform(size=(t, k)), jnp.float32)
        outs, times = {}, {n: [] for n in fns}
        for name, fn in fns.items():
            outs[name] = np.asarray(fn(h, p, ex, w))
        for _ in range(args.reps):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn(h, p, ex, w).block_until_ready()
                times[name].append(1e3 * (time.perf_counter() - start))
        for name in fns:
            np.testing.assert_allclose(outs[name], outs["dense"], rtol=2e-3, atol=2e-3)
        print(f"{t:5d} " + " ".join(f"{statistics.median(times[n]):9.2f}" for n in fns))


if __name__ == "__main__":
    main()
