"""Decode step time of the plain program against the `features` one (every sampling feature
folded in, neutral where unused: `jengine.runtime.step_io.Variant`), in one process.

The same `cpu`-preset `EngineCore` as experiments/quant_step_time.py (bundled SmolLM2, float32),
`--decodes` sequences with `--context` tokens cached; a figure is the median wall time of
`Runner.execute` over `--reps` calls, the two variants alternating for `--rounds` rounds.

    python -P experiments/variant_step_time.py [--decodes 1 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

# A probe run from a source tree: its sibling probes and scripts/ (spec_bench) import however
# it is started (`python -P` leaves the script's own folder off sys.path).
sys.path[:0] = [str(Path(__file__).resolve().parent),
                str(Path(__file__).resolve().parents[1] / "scripts")]

from quant_step_time import build, step_ms  # noqa: E402
from step_batch import synthetic_batch  # noqa: E402

from jengine.runtime.step_io import SamplingRows, Variant  # noqa: E402

PAGE = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decodes", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    core = build("none", args.decodes, args.context)
    variants = {"plain": Variant(), "features": Variant(features=True)}
    runs = {(name, n): [] for name in variants for n in args.decodes}
    for _ in range(args.rounds):
        for n in args.decodes:
            batch = synthetic_batch(n, 1, args.context - 1, PAGE)
            for name, variant in variants.items():
                rows = SamplingRows.for_variant(n, batch.num_tokens, variant)
                runs[name, n].append(step_ms(core, batch, args.reps, rows))
    med = {key: statistics.median(v) for key, v in runs.items()}
    print(f"medians over {args.rounds} rounds of {args.reps}-call medians, context "
          f"{args.context}")
    print("| decodes | plain ms | features ms | features / plain |\n|---|---|---|---|")
    for n in args.decodes:
        print(f"| {n} | {med['plain', n]:.1f} | {med['features', n]:.1f} | "
              f"{med['features', n] / med['plain', n]:.2f}x |")


if __name__ == "__main__":
    main()
