"""Two values of one engine setting, step against step on CPU (A/B in one process).

The median wall time of one real engine step (`Runner.execute`: host prep, device step, fetch)
on the bundled SmolLM2, both settings in one process with their steps interleaved, for decode
batches of 1, 8, 32 and 64 sequences at 256 cached tokens and for one 512-token prefill chunk
over 1,000 cached tokens; then, for each value in its own process with an empty compilation
cache, the cold compile time of every bucket of the `cpu` preset (`EngineCore` warm-up).

    python experiments/step_ab.py --key layer_layout --values stacked unstacked [--reps 15]
    python experiments/step_ab.py --key attention_backend --values reference cpu --skip-compile
    python experiments/step_ab.py --key kv_cache_dtype --values float32 bfloat16
    python experiments/step_ab.py --key matmul_backend --values xla native --decodes 1 2 4 8 16
    python experiments/step_ab.py --key matmul_backend --values native amx --set dtype=bfloat16

Any key of `load_config` works (`attention_backend`, `layer_layout`, `matmul_backend`, ...);
`--set KEY=VALUE` fixes others for both sides.
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
from pathlib import Path

# A probe run from a source tree: its sibling probes and scripts/ (spec_bench) import however
# it is started (`python -P` leaves the script's own folder off sys.path).
sys.path[:0] = [str(Path(__file__).resolve().parent),
                str(Path(__file__).resolve().parents[1] / "scripts")]

from step_batch import synthetic_batch  # noqa: E402

DECODES = (1, 8, 32, 64)
CONTEXT = 256
# The step timings need only these of the cpu preset's buckets (8 programs per layout).
TIMING_BUCKETS = {"token_buckets": (1, 8, 32, 64, 512), "seq_buckets": (1, 8, 32, 64),
                  "page_buckets": (16, 128)}


def _core(settings: dict, **buckets):
    from jengine.config import load_config
    from jengine.core.engine_core import EngineCore

    cfg = load_config("cpu", kv_cache_memory="1GiB", **settings, **buckets)
    return EngineCore(cfg, progress=False)


def _compile(settings: dict) -> dict:
    start = time.perf_counter()
    core = _core(settings)
    return {"start_s": time.perf_counter() - start, "warmup_s": core.warmup_seconds,
            "programs": len(core.runner.buckets.shapes())}


def _timings(reps: int, sides: dict[str, dict], decodes=DECODES) -> dict[str, dict[str, float]]:
    """Both sides in one process, their steps interleaved, so load on the machine hits both
    alike."""
    from jengine.runtime.step_io import SamplingRows

    buckets = dict(TIMING_BUCKETS, token_buckets=tuple(sorted({*decodes, 512})),
                   seq_buckets=tuple(sorted({*decodes, *TIMING_BUCKETS["seq_buckets"]})))
    cores = {name: _core(settings, **buckets) for name, settings in sides.items()}
    page = next(iter(cores.values())).runner.page_size
    cases = [(f"decode x{n}", synthetic_batch(n, 1, CONTEXT - 1, page)) for n in decodes]
    cases.append(("prefill 512 over 1000", synthetic_batch(1, 512, 1000, page)))
    out: dict[str, dict[str, float]] = {side: {} for side in sides}
    for name, batch in cases:
        rows = SamplingRows.empty(batch.num_seqs)
        times: dict[str, list[float]] = {side: [] for side in sides}
        for rep in range(reps + 1):
            for side, core in cores.items():
                t0 = time.perf_counter()
                core.runner.execute(batch, rows)
                if rep:  # the first call of each is a warm-up
                    times[side].append(time.perf_counter() - t0)
        for side in sides:
            out[side][name] = 1e3 * statistics.median(times[side])
    return out


def _value(text: str):
    return {"true": True, "false": False}.get(text.lower(), text)


def settings(items: list[str]) -> dict:
    """`--set KEY=VALUE` items as `load_config` keywords (true / false as booleans)."""
    return {k: _value(v) for k, v in (item.split("=", 1) for item in items)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--key", required=True, help="the setting to compare, e.g. matmul_backend")
    ap.add_argument("--values", nargs=2, required=True, metavar=("A", "B"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting for both sides (default attention_backend=cpu)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--decodes", type=int, nargs="+", default=DECODES,
                    help="decode batch sizes to time (each its own token bucket)")
    ap.add_argument("--skip-compile", action="store_true", help="step timings only")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    common = {"attention_backend": "cpu"}
    common.update(settings(args.set))
    sides = {value: {**common, args.key: _value(value)} for value in args.values}
    if args.child:
        print(json.dumps(_compile(sides[args.child])))
        return
    rows = _timings(args.reps, sides, tuple(args.decodes))
    for value in () if args.skip_compile else args.values:
        with tempfile.TemporaryDirectory() as cache:  # a cold compilation cache
            env = dict(os.environ, XDG_CACHE_HOME=cache)
            cmd = [sys.executable, __file__, "--child", value, "--key", args.key, "--values",
                   *args.values, *(f"--set={item}" for item in args.set)]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            rows[value].update(json.loads(out.strip().splitlines()[-1]))
    a_name, b_name = args.values
    print(f"{args.key}: {a_name} vs {b_name}; {common}; medians of {args.reps}")
    print(f"| | {a_name} | {b_name} | {b_name} / {a_name} |")
    print("|---|---|---|---|")
    for key, a in rows[a_name].items():
        b = rows[b_name][key]
        unit = "" if key == "programs" else (" s" if key.endswith("_s") else " ms")
        print(f"| {key} | {a:.1f}{unit} | {b:.1f}{unit} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
