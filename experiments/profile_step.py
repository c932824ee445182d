"""Where one engine step's time goes on CPU: a profiler trace of real steps, split by part.

Builds the engine on the `cpu` preset (bundled SmolLM2), runs a decode batch of S sequences at
C cached tokens (and optionally a prefill chunk) under `jax.profiler.trace`, which writes a
perfetto trace (`perfetto_trace.json.gz`, open it in ui.perfetto.dev). XLA:CPU records one event
per executed thunk, named after its HLO instruction; each instruction is mapped to a part of
the model through the compiled module's metadata (the named scopes in the model code):

    gemm        the q/k/v/o and MLP projections
    attention   paged attention (the native kernel's custom call, or the reference's gather)
    kv_write    writing this step's K/V into the pages
    norm_rope   RMS norms and rotary embeddings
    lm_head     the final norm's output times the (tied) embedding
    sampling    everything after the logits
    other       embedding gather, residual adds, layout copies

The host gap is the step's wall time (dispatch to tokens on the host) minus the span of its
thunks: input preparation, transfers and dispatch. Thunks may overlap on XLA's threads, so
parts are shares of the summed thunk time.

    python experiments/profile_step.py [--seqs 64] [--context 256] [--steps 5] [--trace-dir DIR]
                                   [--kv-cache-dtype auto|float32|bfloat16|int8]
                                   [--set quantization=int8 ...]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

# A probe run from a source tree: its sibling probes import however it is started
# (`python -P` leaves the script's own folder off sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parent))

PARTS = ("gemm", "attention", "kv_write", "norm_rope", "lm_head", "sampling", "other")


def _part(op_name: str, text: str) -> str:
    if "jengine_paged_attention" in text or "/attention" in op_name:
        return "attention"
    if "jengine_kv_write" in text or "/kv_write" in op_name:
        return "kv_write"
    if "/sample" in op_name:
        return "sampling"
    if "/lm_head" in op_name:
        return "lm_head"
    if "/norm" in op_name or "/rope" in op_name:
        return "norm_rope"
    if "/proj" in op_name or re.match(r"\s*%?[\w.\-]+ = \S+ dot\(", text):
        return "gemm"  # XLA drops the metadata of some small dots it rewrites
    return "other"


def instruction_parts(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> part, for every instruction of the entry and fused computations
    (a fusion takes the part of the first op inside it that names one, else its own)."""
    parts: dict[str, str] = {}
    fused: dict[str, str] = {}
    computation = None
    for line in hlo_text.splitlines():
        head = re.match(r"\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and "=" not in line.split("{")[0]:
            computation = head.group(1)
            continue
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
        if not m:
            continue
        op = re.search(r'op_name="([^"]*)"', line)
        # A conditional's thunk spans the branch's own thunks, which the trace also has.
        nested = re.search(r"=\s.*\bconditional\(", line)  # tuple types hold spaces
        part = "nested" if nested else _part(op.group(1) if op else "", line)
        parts[m.group(1)] = part
        if computation and part not in ("other", "nested"):
            fused.setdefault(computation, part)
        call = re.search(r"calls=%?([\w.\-]+)", line)
        if call and parts[m.group(1)] == "other" and call.group(1) in fused:
            parts[m.group(1)] = fused[call.group(1)]
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=0, help="one chunk of N tokens instead")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--config", default="cpu")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    choices=["auto", "float32", "bfloat16", "int8"])
    ap.add_argument("--trace-dir")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="another engine setting, e.g. quantization=int8 (step_ab.py's parsing)")
    ap.add_argument("--min-bucket", type=int, default=1,
                    help="pad to at least this many tokens (8: the pre-2026-12-01 CPU default)")
    args = ap.parse_args()

    from step_ab import settings
    from step_batch import synthetic_batch

    from jengine.config import load_config
    from jengine.core.engine_core import EngineCore
    from jengine.runtime.step_io import SamplingRows

    # Only the buckets these steps use, so start-up compiles 8 programs, not the preset's 28.
    small = tuple(b for b in (1, 8) if b >= args.min_bucket)
    core = EngineCore(load_config(args.config, token_buckets=(*small, 64, 512),
                                  seq_buckets=(*small, 64),
                                  page_buckets=(16, 128), kv_cache_dtype=args.kv_cache_dtype,
                                  **settings(args.set)),
                      progress=False)
    runner = core.runner
    if args.prefill:
        batch = synthetic_batch(1, args.prefill, args.context, runner.page_size)
    else:
        batch = synthetic_batch(args.seqs, 1, args.context - 1, runner.page_size)
    rows = SamplingRows.empty(batch.num_seqs)
    runner.execute(batch, rows)
    hlo = runner.program(batch, rows).as_text()
    parts = instruction_parts(hlo)

    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="jengine-trace-")
    walls = []
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(args.steps):
            start = time.perf_counter()
            runner.execute(batch, rows)
            walls.append(time.perf_counter() - start)
    path = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)[0]
    with gzip.open(path) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    thunks = [e for e in events if e.get("ph") == "X"
              and str(e.get("args", {}).get("hlo_module", "")).startswith("jit_step")
              and "hlo_op" in e.get("args", {})]
    by_run = collections.defaultdict(list)
    for e in thunks:
        by_run[e["args"].get("run_id")].append(e)
    spans = [max(e["ts"] + e["dur"] for e in es) - min(e["ts"] for e in es)
             for es in by_run.values()]
    total, unnamed = collections.Counter(), collections.Counter()
    for e in thunks:
        part = parts.get(e["args"]["hlo_op"], "other")
        if part == "nested":
            continue
        total[part] += e["dur"]
        if part == "other":
            unnamed[e["args"]["hlo_op"]] += e["dur"]
    busy = sum(total.values())
    wall_ms = 1e3 * statistics.median(walls)
    span_ms = statistics.median(spans) / 1e3
    what = (f"prefill {args.prefill} over {args.context}" if args.prefill
            else f"decode {args.seqs} x {args.context}")
    print(f"{what}, kv cache {core.kv_cache_dtype}: step {wall_ms:.1f} ms (median of "
          f"{args.steps}), thunk span {span_ms:.1f} ms, host gap {wall_ms - span_ms:.1f} ms; "
          f"trace: {path}")
    print("| part | ms per step | share of thunk time |")
    print("|---|---|---|")
    runs = max(len(by_run), 1)
    for part in PARTS:
        print(f"| {part} | {total[part] / 1e3 / runs:.1f} | {100 * total[part] / busy:.0f}% |")
    top = ", ".join(f"{op} {us / 1e3 / runs:.1f} ms" for op, us in unnamed.most_common(3))
    print(f"largest in other: {top}")


if __name__ == "__main__":
    main()
