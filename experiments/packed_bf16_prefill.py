"""SmolLM2 with AMX hidden (the AMD EPYC's kernel choices on an AMX Xeon), f32 against bf16 on the
packed-bf16 kernel: `auto`'s path (on a CPU whose VDPBF16PS issues slowly, FMA over the widened
pairs: `packed_bf16.dp_bf16_pays`) and VDPBF16PS forced. A 1,500-token prompt's prefill (one
token out) and decode at 1 / 8 / 32 / 64 streams (median time per output token), the engines
interleaved, each figure the median over rounds. Ratios only (a shared machine).
Run: python experiments/packed_bf16_prefill.py [rounds]"""

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from jengine import Engine, SamplingParams, cpu_info
from jengine.bench.throughput import run_engine
from jengine.cpu_kernels import packed_bf16

CPU = Path(__file__).parents[1] / "configs" / "cpu.yaml"
# name -> (dtype, the packed kernel's isa: None for what `auto` picks)
VARIANTS = {"f32 native": ("float32", None), "bf16 packed auto": ("bfloat16", None),
            "bf16 packed VDPBF16PS": ("bfloat16", "avx512_bf16")}
STREAMS = (1, 8, 32, 64)


def engine(tmp: Path, name: str, dtype: str) -> Engine:
    preset = yaml.safe_load(CPU.read_text())
    preset["model"].update(dtype=dtype, matmul_backend="native")
    preset["cache"]["kv_cache_memory"] = "1GiB"
    path = tmp / f"{name.replace(' ', '_')}.yaml"
    path.write_text(yaml.safe_dump(preset))
    # A store of compiled programs of its own: the store's key does not hold the packed kernel's
    # forced path, so the two bf16 engines would otherwise load each other's programs.
    os.environ["XDG_CACHE_HOME"] = str(tmp / name.replace(" ", "_"))
    return Engine(config=str(path), progress=False, enable_prefix_caching=False)


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    rng = np.random.default_rng(0)
    long_ids = rng.integers(100, 40000, 1500).tolist()
    short = [rng.integers(100, 40000, 32).tolist() for _ in range(max(STREAMS))]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    auto_isa = packed_bf16.best_isa

    times: dict[tuple[str, str], list[float]] = {}
    with cpu_info.hiding("amx_bf16", "amx_tile", "amx_int8"), tempfile.TemporaryDirectory() as d:
        print("auto picks", packed_bf16.best_isa(), flush=True)
        engines = {}
        for name, (dtype, isa) in VARIANTS.items():
            packed_bf16.best_isa = (lambda isa=isa: isa) if isa else auto_isa
            engines[name] = engine(Path(d), name, dtype)
            engines[name].generate([long_ids], one)  # compiles the prefill buckets
        for r in range(rounds):
            for name, e in engines.items():
                packed_bf16.best_isa = (lambda isa=VARIANTS[name][1]: isa) \
                    if VARIANTS[name][1] else auto_isa
                t = time.perf_counter()
                e.generate([long_ids], one)
                times.setdefault((name, "prefill 1500"), []).append(time.perf_counter() - t)
                for n in STREAMS:
                    res = run_engine(e, short[:n], 32)
                    times.setdefault((name, f"decode x{n}"), []).append(res["tpot_median_s"])
            print(f"round {r + 1} done", flush=True)
    packed_bf16.best_isa = auto_isa
    kinds = ["prefill 1500"] + [f"decode x{n}" for n in STREAMS]
    print("| | " + " | ".join(VARIANTS) + " |")
    print("|---" * (len(VARIANTS) + 1) + "|")
    for kind in kinds:
        base = statistics.median(times["f32 native", kind])
        cells = [f"{1e3 * (m := statistics.median(times[name, kind])):.1f} ms "
                 f"({base / m:.2f}x)" for name in VARIANTS]
        print(f"| {kind} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
