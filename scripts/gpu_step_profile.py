"""Where a decode step's time goes on a GPU, and every step program as the GPU gets it: one call
that fits a device lease (under 10 minutes), checked on a CPU before any GPU time is spent.

  profile  gpu_bench's engine (Llama-3-8B shapes, random bf16 weights, pallas_gpu, per-layer
           weights) at C = 1, 32, 256 running requests: TRACE_STEPS decode steps under
           jax.profiler. Each device op's time goes to the named scope it was traced under
           (read from the compiled programs' HLO metadata): GEMMs (`proj`, `lm_head`),
           attention, KV write, norms, sampling, rope, other; between step programs the
           device's idle time (the host gap), and the host<->device copies per step (H2D: the
           step's inputs; D2H: syncs). Then the dump below, from the same engine.
  dump     every step program lowered for CUDA by `jax.export` (StableHLO text,
           DIR/<program>.cuda.mlir, with its count of case / if / while ops), and on a GPU the
           optimized HLO XLA compiled (DIR/<module>.cuda.hlo.txt). On a CPU the programs come
           from a runner built for the GPU around the same weights (fused, as a GPU loads them).

Writes OUT/gpu_step_profile.jsonl, OUT/gpu_step_profile.md (the table) and OUT/traces/ (the
xplane files, for xprof or TensorBoard).

    python3 scripts/gpu_step_profile.py --out "$OUT"                  # on the GPU machine
    python scripts/gpu_step_profile.py --out /tmp/p --dry             # anywhere: tiny shapes
    python scripts/gpu_step_profile.py --out /tmp/p --dump /tmp/p/programs   # the programs only
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import gpu_bench  # noqa: E402 - scripts/gpu_bench.py: the engine, shapes and dry-run sizes

SECTIONS = {"profile": 480, "dump": 240}  # seconds; the default run is `profile` alone
WARM_STEPS, TRACE_STEPS = 3, 10
DRY_SCHEDULER = ("scheduler: {max_num_seqs: 4, max_num_batched_tokens: 16, token_buckets: [16],"
                 " seq_buckets: [4], page_buckets: [32]}\n")
# Named scope (a path component of an op's op_name) -> category, first match wins.
CATEGORIES = (("attention", "attention"), ("kv_write", "kv_write"), ("norm", "norms"),
              ("sample", "sampling"), ("lm_head", "gemm"), ("proj", "gemm"), ("rope", "rope"))
COLUMNS = ("gemm", "attention", "kv_write", "norms", "sampling", "rope", "other")
CONTROL_FLOW = re.compile(r"stablehlo\.(case|if|while)\b")
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=.*?op_name="([^"]*)"', re.M)


class Log(gpu_bench.Log):
    """gpu_bench's JSON lines, in this script's own file (gpu_bench's table reads its own)."""

    def __init__(self, out: Path, section: str):
        super().__init__(out, section)
        self.path = out / "gpu_step_profile.jsonl"


def engine(dry: bool):
    """gpu_bench's 8B-shaped engine core (one bucket in the dry run: three programs)."""
    scheduler = DRY_SCHEDULER if dry else gpu_bench.BENCH_SCHEDULER
    return gpu_bench._engine_8b(Path(tempfile.mkdtemp()), "pallas_gpu", gpu_bench.KV_MEMORY,
                                "unstacked", scheduler=scheduler)


# --- profile ---------------------------------------------------------------------------------


def op_scopes(programs) -> dict[tuple[str, str], str]:
    """(HLO module, instruction) -> the op_name (named-scope path) it was traced under."""
    scopes = {}
    for program in programs:
        text = program.as_text()
        module = re.search(r"HloModule\s+([^\s,]+)", text).group(1)
        for name, op_name in _INSTRUCTION.findall(text):
            scopes[(module, name)] = op_name
    return scopes


def category(op_name: str, op: str) -> str:
    parts = op_name.split("/")
    for scope, name in CATEGORIES:
        if scope in parts:
            return name
    return "gemm" if any(k in op.lower() for k in ("gemm", "cublas", "dot")) else "other"


def trace_split(trace_dir: Path, scopes: dict[tuple[str, str], str]) -> dict:
    """Per traced step program: ms per category, device busy ms, the idle gap before the next
    step program, host<->device copies, and the ops that took longest."""
    from jax.profiler import ProfileData

    files = sorted(trace_dir.rglob("*.xplane.pb"))
    data = ProfileData.from_file(str(files[-1]))
    planes = [p for p in data.planes if p.name.startswith("/device:")]
    planes = planes or [p for p in data.planes if p.name == "/host:CPU"]  # the dry run
    runs: dict = collections.defaultdict(list)  # run_id -> [(start, end, category, op)]
    copies: collections.Counter = collections.Counter()
    for plane in planes:
        for line in plane.lines:
            for ev in line.events:
                stats = dict(ev.stats)
                name = ev.name.lower()
                if "memcpy" in name:
                    kind = ("d2h" if "dtoh" in name or "d2h" in name
                            else "h2d" if "htod" in name or "h2d" in name else "other")
                    copies[kind] += 1
                    continue
                module = str(stats.get("hlo_module", ""))
                if "step" not in module:
                    continue
                op = str(stats.get("hlo_op", ev.name))
                cat = category(scopes.get((module, op), ""), op)
                start = ev.start_ns
                runs[stats.get("run_id")].append((start, start + ev.duration_ns, cat, op))
    if list(runs) == [None]:  # a tracer without run ids: a run starts at each first op
        runs = _runs_by_first_op(runs[None])
    ordered = sorted(runs.values(), key=lambda evs: min(e[0] for e in evs))
    n = max(len(ordered), 1)
    per_cat, per_op = collections.Counter(), collections.Counter()
    for evs in ordered:
        for start, end, cat, op in evs:
            per_cat[cat] += end - start
            per_op[op] += end - start
    gaps = [min(e[0] for e in b) - max(e[1] for e in a) for a, b in zip(ordered, ordered[1:])]
    row = {"programs_traced": len(ordered), "device_ms": sum(per_cat.values()) / n / 1e6}
    row.update({f"{c}_ms": per_cat[c] / n / 1e6 for c in COLUMNS})
    row.update(host_gap_ms=statistics.mean(gaps) / 1e6 if gaps else None,
               host_gap_max_ms=max(gaps) / 1e6 if gaps else None,
               h2d_per_step=copies["h2d"] / n, d2h_per_step=copies["d2h"] / n,
               top_ops={op: round(ns / n / 1e6, 4) for op, ns in per_op.most_common(8)})
    return row


def _runs_by_first_op(events: list[tuple]) -> dict[int, list[tuple]]:
    """Events of several runs of one program split into runs: each starts where the op that
    began the first run appears again."""
    events = sorted(events)
    first, runs = events[0][3], {}
    for event in events:
        if event[3] == first:
            runs[len(runs)] = []
        runs[len(runs) - 1].append(event)
    return runs


def profile_at(core, c: int, rng, trace_dir: Path) -> dict:
    """C requests prefilled and decoding, then TRACE_STEPS decode steps traced."""
    import jax

    from jengine.sampling_params import SamplingParams

    vocab = gpu_bench.LLAMA3_8B["vocab_size"]
    params = SamplingParams(max_tokens=WARM_STEPS + TRACE_STEPS + 4, temperature=0,
                            ignore_eos=True)
    for i in range(c):
        core.add_request(f"c{c}-{i}", rng.integers(0, vocab, gpu_bench.PROMPT_LEN).tolist(),
                         params)
    started: set[str] = set()
    while len(started) < c:  # every prompt prefilled
        started.update(o.request_id for o in core.step() if o.outputs[0].token_ids)
    for _ in range(WARM_STEPS):
        core.step()
    walls = []
    with jax.profiler.trace(str(trace_dir)):
        for _ in range(TRACE_STEPS):
            t = time.perf_counter()
            core.step()
            walls.append(time.perf_counter() - t)
    while core.has_unfinished:
        core.step()
    split = trace_split(trace_dir, op_scopes(core.runner.compiled_programs()))
    return {"step_ms": statistics.median(walls) * 1e3, **split}


def run_profile(log: Log, out: Path, dump_dir: Path, dry: bool) -> None:
    import jax
    import numpy as np

    deadline = time.monotonic() + SECTIONS["profile"] - 90  # the dump after it
    core, build_s = engine(dry)
    log(event="engine_ready", engine_s=round(build_s, 1), device=str(jax.devices()[0]),
        programs=core.runner.programs_built)
    rng = np.random.default_rng(0)
    for c in gpu_bench.CONCURRENCY:
        if time.monotonic() > deadline:
            log(concurrency=c, skipped="out of time")
            continue
        try:
            log(concurrency=c, **profile_at(core, c, rng, out / "traces" / f"c{c}"))
        except Exception as e:  # noqa: BLE001 - recorded; the next C goes on
            log(concurrency=c, error=f"{type(e).__name__}: {e}"[:2000])
            traceback.print_exc()
    dump(log, core.runner, dump_dir)


# --- dump ------------------------------------------------------------------------------------


def gpu_runner(runner):
    """`runner` on a GPU; on a CPU a runner built for the GPU at its shapes: random bf16 weights
    per layer, fused as a GPU loads them (the CPU engine's own may be packed for its kernels)."""
    import jax.numpy as jnp

    from jengine.models import family_module
    from jengine.models.fused import can_fuse, fuse_projections
    from jengine.models.layers import random_params, unstack_layers

    if not runner.cfg.branches:
        return runner
    cfg = dataclasses.replace(runner.cfg, platform="gpu")
    network = family_module(cfg)
    params = unstack_layers(random_params(network.param_specs(cfg), jnp.bfloat16),
                            network.layer_keys, cfg.num_layers)
    if can_fuse(params, cfg, network):
        params = fuse_projections(params, cfg)
    return runner.for_platform("gpu", "pallas_gpu", params)


def program_name(shape: tuple[int, int, int], variant) -> str:
    flags = [f.name for f in dataclasses.fields(variant) if getattr(variant, f.name)]
    return f"step_T{shape[0]}_S{shape[1]}_P{shape[2]}_{'_'.join(flags) or 'plain'}"


def dump(log: Log, runner, out: Path) -> None:
    """Each step program lowered for CUDA, and on a GPU the HLO XLA compiled for it."""
    out.mkdir(parents=True, exist_ok=True)
    compiled_here = not runner.cfg.branches  # a GPU: the engine's own compiled programs
    runner = gpu_runner(runner)
    for shape, variant in runner.warmup_programs():
        name = program_name(shape, variant)
        try:
            text = runner.export(shape, variant, ("cuda",)).mlir_module()
        except Exception as e:  # noqa: BLE001 - recorded; the next program goes on
            log(program=name, error=f"{type(e).__name__}: {e}"[:2000])
            continue
        (out / f"{name}.cuda.mlir").write_text(text)
        log(program=name, mlir_kib=len(text) // 1024,
            control_flow=sorted(set(CONTROL_FLOW.findall(text))))
    if compiled_here:
        for program in runner.compiled_programs():
            text = program.as_text()
            module = re.search(r"HloModule\s+([^\s,]+)", text).group(1)
            (out / f"{module}.cuda.hlo.txt").write_text(text)


def run_dump(log: Log, out: Path, dump_dir: Path, dry: bool) -> None:
    core, _ = engine(dry)
    dump(log, core.runner, dump_dir)


# --- driver ----------------------------------------------------------------------------------


def table(out: Path) -> str:
    path = out / "gpu_step_profile.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    lines = ["## Decode step split (ms per step; Llama-3-8B shapes, bf16, pallas_gpu)", "",
             "| C | step (host) | device | " + " | ".join(COLUMNS) + " | host gap | gap max | "
             "H2D/step | D2H/step |", "|---" * (len(COLUMNS) + 7) + "|"]
    for r in rows:
        if "step_ms" in r:
            cells = [r["step_ms"], r["device_ms"], *(r[f"{c}_ms"] for c in COLUMNS),
                     r["host_gap_ms"], r["host_gap_max_ms"], r["h2d_per_step"],
                     r["d2h_per_step"]]
            lines.append(f"| {r['concurrency']} | " + " | ".join(
                "-" if v is None else f"{v:.3f}" for v in cells) + " |")
        elif "concurrency" in r:
            lines.append(f"| {r['concurrency']} | {r.get('error') or r.get('skipped')} |")
    tops = [r for r in rows if "top_ops" in r]
    if tops:
        lines += ["", "## Longest ops per step (ms)", ""]
        lines += [f"- C = {r['concurrency']}: {json.dumps(r['top_ops'])}" for r in tops]
    programs = [r for r in rows if "program" in r]
    if programs:
        lines += ["", "## Step programs lowered for CUDA", ""]
        lines += [f"- {r['program']}: "
                  f"{(r.get('error') or '')[:300] or r['control_flow'] or 'no case/if/while'}"
                  for r in programs]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dump", type=Path, default=None, metavar="DIR",
                        help="where the programs go (default OUT/programs); alone: dump only")
    parser.add_argument("--section", default=None, help="profile (default) or dump")
    parser.add_argument("--dry", action="store_true", help="tiny shapes (a CPU check)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    section = args.section or ("dump" if args.dump else "profile")
    if section not in SECTIONS:
        parser.error(f"unknown section {section!r}; expected one of {list(SECTIONS)}")
    dump_dir = args.dump or args.out / "programs"
    if args.dry:
        gpu_bench.shrink_for_dry_run()
        global TRACE_STEPS, WARM_STEPS
        TRACE_STEPS, WARM_STEPS = 2, 1
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        runner = run_profile if section == "profile" else run_dump
        runner(Log(args.out, section), args.out, dump_dir, args.dry)
        return 0
    t = time.perf_counter()
    cmd = [sys.executable, __file__, "--out", str(args.out), "--dump", str(dump_dir),
           "--section", section, "--child", *(["--dry"] if args.dry else [])]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    limit = SECTIONS[section] * (4 if args.dry else 1)
    try:
        rc = subprocess.run(cmd, env=env, timeout=limit).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    Log(args.out, section)(event="section_done", rc=rc, seconds=round(time.perf_counter() - t))
    text = table(args.out)
    (args.out / "gpu_step_profile.md").write_text(text)
    print(text)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
