"""One question: what does each kernel path of the integer modes cost per engine step, decode
and prefill, against bf16, in one process (same-run ratios under the machine's load)?

Each mode is `NAME=QUANTIZATION[:FLAG,FLAG...]`: an `EngineCore` of the `cpu` preset (bundled
SmolLM2) in `--dtype`, built and run with those CPU flags hidden (`cpu_info.hiding`), so one
Xeon with AMX runs the AMD EPYC's paths (hide amx_tile,amx_bf16,amx_int8) and the float w4a16
path (hide avx512_vnni). Steps: `--decodes` sequences of `--context` cached tokens, one new
token each, and one `--prefill`-token prompt in one step. A figure is the median over
`--rounds` alternating rounds of the median of `--reps` calls of `Runner.execute`.

    PYTHONPATH=. python -P experiments/isa_step_paths.py [--modes none=none w4=w4a16 ...]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent),
                str(Path(__file__).resolve().parents[1] / "scripts")]

from quant_step_time import PAGE, step_ms  # noqa: E402
from step_batch import synthetic_batch  # noqa: E402

from jengine import cpu_info  # noqa: E402
from jengine.config import load_config  # noqa: E402
from jengine.core.engine_core import EngineCore  # noqa: E402

NO_AMX = "amx_tile,amx_bf16,amx_int8"
DEFAULT_MODES = ["none=none", "w4a16=w4a16", "w4a16-float=w4a16:avx512_vnni", "int8=int8",
                 f"none-noamx=none:{NO_AMX}", f"int8-vnni-noamx=int8:{NO_AMX}",
                 f"int8-xla-noamx=int8:{NO_AMX},avx512_vnni"]


def build(mode: str, dtype: str, decodes: list[int], context: int, prefill: int) -> EngineCore:
    pages = -(-max(context, prefill) // PAGE)
    cfg = load_config(
        "cpu", quantization=mode, dtype=dtype, max_model_len=max(context, prefill),
        max_num_seqs=max(decodes), max_num_batched_tokens=prefill,
        token_buckets=tuple(sorted({*decodes, prefill})), seq_buckets=tuple(decodes),
        page_buckets=(pages,), kv_cache_memory=f"{(max(decodes) + 1) * (pages + 2) * 800}KiB",
    )
    return EngineCore(cfg, progress=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=DEFAULT_MODES)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--decodes", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=1500)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    modes = {}
    for spec in args.modes:
        name, rest = spec.split("=")
        quant, _, hide = rest.partition(":")
        modes[name] = (quant, tuple(f for f in hide.split(",") if f))
    batches = {f"{n} dec": synthetic_batch(n, 1, args.context - 1, PAGE) for n in args.decodes}
    batches[f"{args.prefill} pre"] = synthetic_batch(1, args.prefill, 0, PAGE)
    cores = {}
    for name, (quant, hide) in modes.items():
        with cpu_info.hiding(*hide):
            cores[name] = build(quant, args.dtype, args.decodes, args.context, args.prefill)
    runs = {(m, b): [] for m in modes for b in batches}
    for _ in range(args.rounds):
        for name, core in cores.items():
            with cpu_info.hiding(*modes[name][1]) if modes[name][1] else contextlib.nullcontext():
                for b, batch in batches.items():
                    runs[name, b].append(step_ms(core, batch, args.reps))
        print("round done", flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"ms per step, medians over {args.rounds} rounds of {args.reps}-call medians, "
          f"dtype {args.dtype}, decode context {args.context}")
    print("| mode | " + " | ".join(batches) + " |")
    print("|---|" + "---|" * len(batches))
    for name in modes:
        print(f"| {name} | " + " | ".join(f"{med[name, b]:.1f}" for b in batches) + " |")


if __name__ == "__main__":
    main()
