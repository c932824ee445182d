"""Times prefill attention as the runner drives it, before and after a change, in one run.

One layer call of `jengine.models.attention.attend` (K/V write + attention, the cache donated
as in the step) on SmolLM2-135M's attention shapes (9 q heads, 3 kv heads, head_dim 64, page
16, a 30-layer f32 cache), with the step inputs built by `Runner.host_inputs` for the CPU
preset's buckets (T <= 512, S = 64, pages 16-128), so the bucket padding is the runner's own.
Cases: one 512-token chunk over 1000 cached tokens (pages bucket 128), and one 1500-token
prompt prefilled in 512-token chunks (three calls, summed). "x 30" is the step's attention
(30 layers), not measured whole.

Each tree runs in its own subprocess against its own jengine, the two alternating for
`--rounds` rounds (a shared machine's load drifts); each number is the median over rounds of
`--reps`-call medians.

    git worktree add /tmp/jengine-before <commit>   # the tree to compare against
    python experiments/prefill_bench.py --before /tmp/jengine-before [--reps 5 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HEADS, KV_HEADS, HEAD_DIM, PAGE, LAYERS = 9, 3, 64, 16, 30
CASES = {
    "512-token chunk over 1000 cached": [(1000, 512)],
    "1500-token prompt, 512-token chunks": [(0, 512), (512, 512), (1024, 476)],
}
BACKENDS = ("reference", "cpu")


def measure(backend: str, reps: int) -> dict[str, float]:
    """ms per case (sum over its chunks) of one jitted layer call, in this process's jengine."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jengine.models import ModelConfig
    from jengine.models.attention import attend
    from jengine.models.config import RopeConfig
    from jengine.runtime.buckets import Buckets
    from jengine.runtime.runner import Runner
    from jengine.runtime.step_io import SamplingRows
    from jengine.scheduling.batch import ScheduledBatch

    cfg = ModelConfig(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=2048, rms_norm_eps=1e-5, rope=RopeConfig(),
        attention_backend=backend,
    )
    num_pages = 1 + 1536 // PAGE
    # Only the runner's cache and padding are used; one array tells it its device.
    runner = Runner(cfg, {"device": jnp.zeros(())}, num_pages=num_pages, page_size=PAGE,
                    buckets=Buckets.default(512, 64, 128), kv_cache_dtype=jnp.float32)
    rng = np.random.default_rng(0)
    pages = rng.permutation(np.arange(1, num_pages)).astype(np.int32)  # one prompt's pages
    kv = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype), runner.kv)
    runner.kv = None  # one cache in memory

    def layer_call(q, k, v, kv, md):
        return attend(q, k, v, kv, jnp.int32(1), md, sm_scale=HEAD_DIM ** -0.5,
                      sliding_window=None, soft_cap=None, backend=backend)

    call = jax.jit(layer_call, donate_argnums=3)
    out = {}
    for case, chunks in CASES.items():
        total = 0.0
        for cached, n in chunks:
            end = cached + n
            positions = np.arange(cached, end, dtype=np.int32)
            table = pages[None, : -(-end // PAGE)]
            batch = ScheduledBatch(
                seq_ids=[0], token_ids=np.zeros(n, np.int32), positions=positions,
                slot_mapping=table[0, positions // PAGE] * PAGE + positions % PAGE,
                q_lens=np.array([n], np.int32), kv_lens=np.array([end], np.int32),
                page_table=table, sample=np.ones(1, bool),
            )
            host, _ = runner.host_inputs(batch, SamplingRows.empty(1))
            md = jax.device_put(host).attention_metadata()
            t = md.token_ids.shape[0]
            q = jnp.asarray(rng.normal(size=(t, HEADS, HEAD_DIM)), jnp.float32)
            k, v = (jnp.asarray(rng.normal(size=(t, KV_HEADS, HEAD_DIM)), jnp.float32)
                    for _ in range(2))
            attn, kv = call(q, k, v, kv, md)  # compile
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                attn, kv = jax.block_until_ready(call(q, k, v, kv, md))
                times.append(time.perf_counter() - start)
            total += statistics.median(times)
        out[case] = 1e3 * total
    return out


def run_tree(tree: Path, reps: int) -> dict[str, dict[str, float]]:
    """`measure` for every backend in a subprocess whose jengine is `tree`'s."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    result = subprocess.run(
        [sys.executable, __file__, "--measure", "--reps", str(reps)],
        env=env, check=True, capture_output=True, text=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required="--measure" not in sys.argv,
                        help="a jengine tree (worktree) to compare against")
    parser.add_argument("--after", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps({b: measure(b, args.reps) for b in BACKENDS}))
        return
    runs = {"before": [], "after": []}
    for _ in range(args.rounds):
        for name in runs:
            runs[name].append(run_tree(getattr(args, name), args.reps))
    import jax

    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs; ms per layer call (x 30: the step)")
    print("| case | backend | before | after | after / before |")
    print("|---|---|---|---|---|")
    for case in CASES:
        for backend in BACKENDS:
            b, a = (statistics.median(r[backend][case] for r in runs[name]) for name in runs)
            print(f"| {case} | {backend} | {b:.1f} ms (x 30: {30 * b / 1e3:.2f} s) | "
                  f"{a:.1f} ms (x 30: {30 * a / 1e3:.2f} s) | {a / b:.3f}x |")


if __name__ == "__main__":
    main()
