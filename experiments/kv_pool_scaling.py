"""Decode step time vs KV page-pool size: the stacked cache is updated in place (scan carry,
donated), so growing the pool 4x and 16x must leave the step time flat (within noise).

    python experiments/kv_pool_scaling.py [--pages 200 800 3200] [--batch 32] [--context 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from converters import load_source
from converters.placement import to_device_params
from jengine.models import AttentionMetadata, KVCache, family_module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, nargs="+", default=[200, 800, 3200])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    loaded = load_source(None, progress=False)
    cfg, fam = loaded.config, family_module(loaded.config)
    params = to_device_params(loaded.params)
    step = jax.jit(lambda p, kv, md: fam.forward(p, cfg, kv, md), donate_argnums=1)
    b, ps = args.batch, args.page_size
    per_seq = args.context // ps
    for num_pages in args.pages:
        kv = KVCache.zeros(cfg, num_pages, ps, jnp.float32)
        rng = np.random.default_rng(0)
        table = rng.integers(1, min(num_pages, 1 + b * per_seq), size=(b, per_seq))
        md = AttentionMetadata(
            token_ids=jnp.zeros((b,), jnp.int32),
            positions=jnp.full((b,), args.context - 1, jnp.int32),
            slot_mapping=jnp.asarray(table[:, -1] * ps + ps - 1, jnp.int32),
            token_seq=jnp.arange(b, dtype=jnp.int32),
            page_table=jnp.asarray(table, jnp.int32),
            logits_indices=jnp.arange(b, dtype=jnp.int32),
        )
        logits, kv = step(params, kv, md)
        jax.block_until_ready(logits)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            logits, kv = step(params, kv, md)
            jax.block_until_ready(logits)
            times.append(time.perf_counter() - t0)
        mib = 2 * kv.k.nbytes / 2**20
        print(f"pages {num_pages:6d} ({mib:8.0f} MiB cache): "
              f"median step {1e3 * statistics.median(times):7.1f} ms")


if __name__ == "__main__":
    main()
