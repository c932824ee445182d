"""Step times of greedy and sampled batches: what the step's tail (lm_head rows, argmax, draw)
costs per batch shape. Builds the `cpu` preset's engine on the bundled SmolLM2 with only the
buckets these batches use, then times `runner.execute` (dispatch to tokens on the host) of

    prefill46     one sequence's 46-token prefill (a chat prompt) in the T = 64 bucket
    prefill512    one 512-token chunk
    decode40x256  40 decodes at 256 cached tokens (a 64-row bucket, 24 rows padding)
    decode64x256  64 decodes at 256 cached tokens

each greedy (temperature 0) and sampled (temperature 0.7, no top-k/top-p), median of --reps.
To compare trees, run it from each with its own PYTHONPATH:

    PYTHONPATH=TREE python -P experiments/sampled_steps.py [--reps 11] [--set dtype=bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

# A probe run from a source tree: its sibling probes import however it is started
# (`python -P` leaves the script's own folder off sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--set", action="append", default=["dtype=bfloat16"], metavar="KEY=VALUE")
    args = ap.parse_args()

    from step_ab import settings
    from step_batch import synthetic_batch

    import jengine
    from jengine.config import load_config
    from jengine.core.engine_core import EngineCore
    from jengine.runtime.step_io import SamplingRows

    core = EngineCore(load_config("cpu", token_buckets=(1, 8, 64, 512), seq_buckets=(1, 8, 64),
                                  page_buckets=(16, 128), **settings(args.set)), progress=False)
    runner = core.runner
    cases = {"prefill46": synthetic_batch(1, 46, 0, runner.page_size),
             "prefill512": synthetic_batch(1, 512, 0, runner.page_size),
             "decode40x256": synthetic_batch(40, 1, 255, runner.page_size),
             "decode64x256": synthetic_batch(64, 1, 255, runner.page_size)}
    print(f"{jengine.__file__}, {' '.join(args.set)}")
    print("| batch | greedy ms | sampled (T 0.7) ms |")
    print("|---|---|---|")
    for name, batch in cases.items():
        cells = []
        for temperature in (0.0, 0.7):
            rows = SamplingRows.empty(batch.num_seqs)
            rows.temperature = np.full((batch.num_seqs,), temperature, np.float32)
            for _ in range(3):
                runner.execute(batch, rows)
            times = []
            for _ in range(args.reps):
                start = time.perf_counter()
                runner.execute(batch, rows)
                times.append(time.perf_counter() - start)
            cells.append(f"{1e3 * statistics.median(times):.1f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
