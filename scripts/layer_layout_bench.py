"""Stacked (`lax.scan`) against unstacked (a loop over per-layer arrays) layer weights on CPU.

The median wall time of one real engine step (`Runner.execute`: host prep, device step, fetch)
on the bundled SmolLM2, both layouts in one process with their steps interleaved, for decode
batches of 1, 8, 32 and 64 sequences at 256 cached tokens and for one 512-token prefill chunk
over 1,000 cached tokens; then, for each layout in its own process with an empty compilation
cache, the cold compile time of every bucket of the `cpu` preset (`EngineCore` warm-up).

    python scripts/layer_layout_bench.py [--reps 15] [--backend cpu] [--kv-cache-dtype auto]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from step_batch import synthetic_batch

LAYOUTS = ("stacked", "unstacked")
DECODES = (1, 8, 32, 64)
CONTEXT = 256
# The step timings need only these of the cpu preset's buckets (8 programs per layout).
TIMING_BUCKETS = {"token_buckets": (8, 32, 64, 512), "seq_buckets": (8, 32, 64),
                  "page_buckets": (16, 128)}


def _core(layout: str, backend: str, kv_dtype: str, **buckets):
    from jengine.config import load_config
    from jengine.core import EngineCore

    cfg = load_config("cpu", layer_layout=layout, attention_backend=backend,
                      kv_cache_dtype=kv_dtype, kv_cache_memory="1GiB", **buckets)
    return EngineCore(cfg, progress=False)


def _compile(layout: str, backend: str, kv_dtype: str) -> dict:
    start = time.perf_counter()
    core = _core(layout, backend, kv_dtype)
    return {"start_s": time.perf_counter() - start, "warmup_s": core.warmup_seconds,
            "programs": len(core.runner.buckets.shapes())}


def _timings(reps: int, backend: str, kv_dtype: str) -> dict[str, dict[str, float]]:
    """Both layouts in one process, their steps interleaved, so load on the machine hits both
    alike."""
    from jengine.runner import SamplingRows

    cores = {layout: _core(layout, backend, kv_dtype, **TIMING_BUCKETS) for layout in LAYOUTS}
    page = cores["stacked"].runner.page_size
    cases = [(f"decode x{n}", synthetic_batch(n, 1, CONTEXT - 1, page)) for n in DECODES]
    cases.append(("prefill 512 over 1000", synthetic_batch(1, 512, 1000, page)))
    out: dict[str, dict[str, float]] = {layout: {} for layout in LAYOUTS}
    for name, batch in cases:
        rows = SamplingRows.empty(batch.num_seqs)
        times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        for rep in range(reps + 1):
            for layout, core in cores.items():
                t0 = time.perf_counter()
                core.runner.execute(batch, rows)
                if rep:  # the first call of each is a warm-up
                    times[layout].append(time.perf_counter() - t0)
        for layout in LAYOUTS:
            out[layout][name] = 1e3 * statistics.median(times[layout])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--skip-compile", action="store_true", help="step timings only")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_compile(args.child, args.backend, args.kv_cache_dtype)))
        return
    rows = _timings(args.reps, args.backend, args.kv_cache_dtype)
    for layout in () if args.skip_compile else LAYOUTS:
        with tempfile.TemporaryDirectory() as cache:  # a cold compilation cache
            env = dict(os.environ, XDG_CACHE_HOME=cache)
            out = subprocess.run(
                [sys.executable, __file__, "--child", layout, "--backend", args.backend,
                 "--kv-cache-dtype", args.kv_cache_dtype],
                env=env, check=True, capture_output=True, text=True).stdout
            rows[layout].update(json.loads(out.strip().splitlines()[-1]))
    print(f"backend {args.backend}, kv cache {args.kv_cache_dtype}, medians of {args.reps}")
    print("| | stacked | unstacked | unstacked / stacked |")
    print("|---|---|---|---|")
    for key, a in rows["stacked"].items():
        b = rows["unstacked"][key]
        unit = "" if key == "programs" else (" s" if key.endswith("_s") else " ms")
        print(f"| {key} | {a:.1f}{unit} | {b:.1f}{unit} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
