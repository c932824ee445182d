"""Time to first token of one long prompt: jengine against an HF transformers forward, one run.

jengine: `Engine.generate` of one prompt of `--tokens` random ids with `max_tokens=1` on the
`cpu` preset (chunked prefill as served; its programs compiled by a first, untimed request).
HF: one forward of the same ids (`logits_to_keep=1`, what a first token needs) for each of
`--hf-dtypes`, torch on the same number of threads as XLA's pool. The cases alternate for
`--reps` rounds (a shared machine's load drifts); medians.

    python -P scripts/ttft_vs_hf.py --hf-dir DIR [--tokens 1500 --reps 3] [--dtypes auto bfloat16]

DIR is the default model as an HF directory (FACTS.md says how to export one from the GGUF).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--config", default="cpu")
    ap.add_argument("--hf-dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--dtypes", nargs="+", default=["auto"],
                    help="jengine's model dtypes, each its own engine (e.g. auto bfloat16)")
    args = ap.parse_args()

    import numpy as np
    import torch
    import transformers

    from jengine import Engine, SamplingParams

    torch.set_num_threads(os.cpu_count() or 1)
    rng = np.random.default_rng(0)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engines = {}
    for dt in args.dtypes:
        engines[dt] = Engine(config=args.config, dtype=dt, progress=False)
        engines[dt].generate([rng.integers(100, 40000, args.tokens).tolist()], one)  # compiles
    models = {dt: transformers.AutoModelForCausalLM.from_pretrained(
        args.hf_dir, dtype=getattr(torch, dt)) for dt in args.hf_dtypes}
    names = {dt: "jengine" if dt == "auto" else f"jengine {dt}" for dt in engines}
    times: dict[str, list[float]] = {**{names[dt]: [] for dt in engines},
                                     **{f"hf {dt}": [] for dt in models}}
    for _ in range(args.reps):
        ids = rng.integers(100, 40000, args.tokens).tolist()  # new ids: no prefix-cache hit
        for dt, engine in engines.items():
            start = time.perf_counter()
            engine.generate([ids], one)
            times[names[dt]].append(time.perf_counter() - start)
        for dt, model in models.items():
            with torch.no_grad():
                start = time.perf_counter()
                model(torch.tensor([ids]), logits_to_keep=1)
                times[f"hf {dt}"].append(time.perf_counter() - start)
    base = statistics.median(times[names[args.dtypes[0]]])
    print(f"one {args.tokens}-token prompt to its first token, medians of {args.reps}")
    print(f"| | seconds | vs {names[args.dtypes[0]]} |")
    print("|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.2f} ({', '.join(f'{t:.2f}' for t in ts)}) | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
