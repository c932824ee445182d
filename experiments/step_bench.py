"""Whole engine steps on CPU, this tree against another (e.g. before a change), in one run.

Each tree runs in its own subprocess against its own jengine, with that tree's defaults for the
`cpu` preset (attention backend, layer layout, buckets: every one of them is compiled, as
`jengine serve` would), on the bundled SmolLM2. A case is the median wall time of
`Runner.execute` (host prep, device step, fetch) on a synthetic batch (`step_batch.py`):
decodes of 1 / 8 / 32 / 64 sequences at 256 cached tokens, one 512-token chunk over 1,000
cached tokens, and one 1,500-token prompt prefilled in chunks of 512 (the three steps summed:
its time to first token without the scheduler). Trees alternate for `--rounds` rounds; each
figure is the median over rounds.

    git worktree add /tmp/jengine-before <commit>
    python experiments/step_bench.py --before /tmp/jengine-before [--reps 7 --rounds 2]
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

HERE = Path(__file__).resolve().parent
DECODES = (1, 8, 32, 64)
CONTEXT = 256


def measure(reps: int) -> dict[str, float]:
    from step_batch import synthetic_batch

    from jengine.config import load_config
    from jengine.core.engine_core import EngineCore
    from jengine.runtime.step_io import SamplingRows

    core = EngineCore(load_config("cpu"), progress=False)
    runner, page = core.runner, core.runner.page_size
    cases = {f"decode x{n} at {CONTEXT}": [synthetic_batch(n, 1, CONTEXT - 1, page)]
             for n in DECODES}
    cases["512-token chunk over 1000 cached"] = [synthetic_batch(1, 512, 1000, page)]
    cases["1500-token prompt (3 chunks)"] = [synthetic_batch(1, n, c, page)
                                             for c, n in ((0, 512), (512, 512), (1024, 476))]
    out = {"programs": len(runner.buckets.shapes())}
    for name, batches in cases.items():
        total = 0.0
        for batch in batches:
            rows = SamplingRows.empty(batch.num_seqs)
            runner.execute(batch, rows)
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                runner.execute(batch, rows)
                times.append(time.perf_counter() - start)
            total += statistics.median(times)
        out[name] = 1e3 * total
    return out


def run_tree(tree: Path, reps: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{HERE}")
    result = subprocess.run([sys.executable, str(HERE / "step_bench.py"), "--child",
                             "--reps", str(reps)], env=env, cwd=tree, check=True,
                            capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=False, help="the tree to compare against")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.reps)))
        return
    trees = {"before": args.before, "after": HERE.parent} if args.before else {"after": HERE.parent}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            runs[name].append(run_tree(tree.resolve(), args.reps))
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for name, rs in runs.items()}
    names = list(trees)
    print(f"medians over {args.rounds} rounds of {args.reps}-call medians")
    print("| case | " + " | ".join(names) + (" | after / before |" if args.before else " |"))
    print("|---|" + "---|" * (len(names) + bool(args.before)))
    for key in med["after"]:
        cells = [f"{med[n][key]:.0f}" + ("" if key == "programs" else " ms") for n in names]
        ratio = f" | {med['after'][key] / med['before'][key]:.2f}x" if args.before else ""
        print(f"| {key} | " + " | ".join(cells) + ratio + " |")


if __name__ == "__main__":
    main()
