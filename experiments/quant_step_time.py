"""Decode step time per quantization mode, in one process and one run, as ratios to `none`.

Each mode is an `EngineCore` of the `cpu` preset (bundled SmolLM2, float32, the CPU attention
kernel and layer layout) compiled for just the decode shapes measured: `--decodes` sequences
with `--context` tokens cached, one new token each (`step_batch.synthetic_batch`). A figure is
the median wall time of `Runner.execute` (host prep, device step, fetch) over `--reps` calls;
modes alternate for `--rounds` rounds and each figure is the median over rounds, so load from
other jobs on the machine falls on every mode alike.

    python experiments/quant_step_time.py [--modes none int8 w8a16] [--decodes 1 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# A probe run from a source tree: its sibling probes and scripts/ (spec_bench) import however
# it is started (`python -P` leaves the script's own folder off sys.path).
sys.path[:0] = [str(Path(__file__).resolve().parent),
                str(Path(__file__).resolve().parents[1] / "scripts")]

from step_batch import synthetic_batch  # noqa: E402

from jengine.config import load_config  # noqa: E402
from jengine.core.engine_core import EngineCore  # noqa: E402
from jengine.runtime.step_io import SamplingRows  # noqa: E402

PAGE = 16


def build(mode: str, decodes: list[int], context: int) -> EngineCore:
    pages = -(-context // PAGE)
    cfg = load_config(
        "cpu", quantization=mode, max_model_len=context, max_num_seqs=max(decodes),
        max_num_batched_tokens=max(decodes), token_buckets=tuple(decodes),
        seq_buckets=tuple(decodes), page_buckets=(pages,),
        kv_cache_memory=f"{(max(decodes) * pages + 2) * 800}KiB",  # >= every page measured
    )
    return EngineCore(cfg, progress=False)


def step_ms(core: EngineCore, batch, reps: int, rows: SamplingRows | None = None) -> float:
    """The median of `reps` timed steps of `batch` (plain sampling unless `rows`)."""
    rows = rows or SamplingRows.empty(batch.num_seqs)
    core.runner.execute(batch, rows)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        core.runner.execute(batch, rows)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["none", "int8", "w8a16"])
    ap.add_argument("--decodes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cores = {mode: build(mode, args.decodes, args.context) for mode in args.modes}
    batches = {n: synthetic_batch(n, 1, args.context - 1, PAGE) for n in args.decodes}
    runs = {(mode, n): [] for mode in args.modes for n in args.decodes}
    for _ in range(args.rounds):
        for mode, core in cores.items():
            for n, batch in batches.items():
                runs[mode, n].append(step_ms(core, batch, args.reps))
    med = {key: statistics.median(v) for key, v in runs.items()}
    base = args.modes[0]
    print(f"medians over {args.rounds} rounds of {args.reps}-call medians, context "
          f"{args.context}")
    print("| decodes | " + " | ".join(f"{m} ms" for m in args.modes) + " | "
          + " | ".join(f"{m} / {base}" for m in args.modes[1:]) + " |")
    print("|---|" + "---|" * (2 * len(args.modes) - 1))
    for n in args.decodes:
        cells = [f"{med[m, n]:.1f}" for m in args.modes]
        ratios = [f"{med[m, n] / med[base, n]:.2f}x" for m in args.modes[1:]]
        print(f"| {n} | " + " | ".join(cells + ratios) + " |")


if __name__ == "__main__":
    main()
