"""A 1,500-token prompt's prefill on SmolLM2 with AMX hidden (the EPYC's kernel choices on an
AMX Xeon): bf16 on the packed-bf16 kernel (`native`), bf16 on XLA's dots (`xla`), and f32
(`native`), interleaved, best of each. Ratios only (a shared machine); XLA's own bf16 dot still
runs on the AMX tiles here, so the `xla` bf16 row is faster than an EPYC's would be.
Run: python experiments/packed_bf16_prefill.py [rounds]"""

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from jengine import Engine, SamplingParams, cpu_info

CPU = Path(__file__).parents[1] / "configs" / "cpu.yaml"
VARIANTS = {"bf16 packed kernel": ("bfloat16", "native"), "bf16 XLA dot": ("bfloat16", "xla"),
            "f32 native": ("float32", "native")}


def engine(tmp: Path, name: str, dtype: str, backend: str) -> Engine:
    preset = yaml.safe_load(CPU.read_text())
    preset["model"].update(dtype=dtype, matmul_backend=backend)
    path = tmp / f"{backend}-{dtype}.yaml"
    path.write_text(yaml.safe_dump(preset))
    return Engine(config=str(path), progress=False, enable_prefix_caching=False)


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    ids = np.random.default_rng(0).integers(100, 40000, 1500).tolist()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    best = {}
    with cpu_info.hiding("amx_bf16", "amx_tile", "amx_int8"), tempfile.TemporaryDirectory() as d:
        engines = {name: engine(Path(d), name, *v) for name, v in VARIANTS.items()}
        for e in engines.values():
            e.generate([ids], params)  # compiles the prefill buckets
        for _ in range(rounds):
            for name, e in engines.items():
                t = time.perf_counter()
                e.generate([ids], params)
                best[name] = min(best.get(name, 1e9), time.perf_counter() - t)
    base = best["f32 native"]
    for name, t in best.items():
        print(f"{name:20s} {t:6.3f} s  {t / base:.2f}x f32")


if __name__ == "__main__":
    main()
