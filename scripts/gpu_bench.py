"""The GPU benchmarks, in one call that fits a device lease: each section in its own subprocess
with its own time limit (a failure or hang costs only that section), each appending JSON lines to
OUT/gpu_session.jsonl, then a markdown table to OUT/gpu_bench.md (and stdout).

  attention   decode attention alone (bf16, 64 sequences x 2,048 cached tokens): the reference
              (XLA's gather) against the Pallas GPU kernel at 1 / 4 / 8 / 16 kv splits
  throughput  Llama-3-8B shapes with random bf16 weights made on the device: offline
              generation at C = 1, 32, 256 concurrent requests (128 prompt + 128 new tokens),
              with pallas_gpu (and fp8 weights at C = 1, 32); `--plan` picks other runs
  hf          the peer in the same run: HF transformers `generate` (torch bf16, sdpa, static
              batch) at the same shapes and C

The correctness checks are the pytest suite tests/accelerator; scripts/gpu_session.py runs it
and then this script.

    python3 scripts/gpu_bench.py --out "$OUT"                    # on the GPU machine
    python3 scripts/gpu_bench.py --out /tmp/x --section hf       # one section
    python scripts/gpu_bench.py --out /tmp/x --dry               # anywhere: tiny shapes
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "accelerator")]

SECTIONS = {"attention": 60, "throughput": 220, "hf": 80}
BATCH, CONTEXT, ITERS = 64, 2048, 20  # decode attention alone
PROMPT_LEN, NEW_TOKENS = 128, 128
CONCURRENCY = (1, 32, 256)
QUANT_PARITY = ("fp8", "w8a16", "int8")  # weight modes checked against bf16 on a tiny model
KV_MEMORY = "24GiB"  # 196k tokens of Llama-3-8B's bf16 KV; C = 256 needs 65k
LLAMA3_8B = {  # Llama-3.1-8B's config.json, less what the engine ignores
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}


def shrink_for_dry_run() -> None:
    """Tiny shapes, so that every code path runs on a CPU (Pallas in interpret mode)."""
    global PROMPT_LEN, NEW_TOKENS, CONCURRENCY, KV_MEMORY, BATCH, CONTEXT, ITERS
    PROMPT_LEN, NEW_TOKENS, CONCURRENCY, KV_MEMORY = 16, 6, (1, 4), "64MiB"
    BATCH, CONTEXT, ITERS = 2, 64, 2
    LLAMA3_8B.update(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    for name in SECTIONS:
        SECTIONS[name] *= 4


class Log:
    """JSON lines to OUT/gpu_session.jsonl and stdout."""

    def __init__(self, out: Path, section: str):
        self.path, self.section = out / "gpu_session.jsonl", section

    def __call__(self, **row) -> None:
        row = {"section": self.section, **row}
        line = json.dumps(row, default=str)
        print(line, flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")


# --- decode attention ------------------------------------------------------------------------


def _timed(fn, batch, iters: int) -> float:
    fn(*batch).block_until_ready()  # compile + warm
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn(*batch).block_until_ready()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_attention(log: Log) -> None:
    """Decode attention alone, bf16: the reference (XLA's gather) and the Pallas GPU kernel
    at 1 / 4 / 8 / 16 kv splits, BATCH sequences x CONTEXT cached tokens."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from ragged_batch import make_batch

    from jengine.pallas_kernels import ragged_paged_attention, ragged_paged_attention_gpu

    rng = np.random.default_rng(0)
    interpret = jax.default_backend() != "gpu"
    for heads, kv_heads, head_dim in ((9, 3, 64), (32, 8, 128)):
        batch = make_batch(rng, [(CONTEXT, 1)] * BATCH, num_heads=heads, num_kv=kv_heads,
                           head_dim=head_dim, page_size=16, dtype=jnp.bfloat16)
        kw = dict(sm_scale=head_dim ** -0.5, sliding_window=None, soft_cap=None)
        ref_s = _timed(jax.jit(functools.partial(ragged_paged_attention, **kw)), batch, ITERS)
        row = {"check": "decode_time", "batch": BATCH, "context": CONTEXT, "heads": heads,
               "kv_heads": kv_heads, "head_dim": head_dim, "reference_ms": ref_s * 1e3}
        for splits in (1, 4, 8, 16):
            fn = jax.jit(functools.partial(ragged_paged_attention_gpu, block_q=1,
                                           num_kv_splits=splits, interpret=interpret, **kw))
            row[f"pallas_gpu_split{splits}_ms"] = _timed(fn, batch, ITERS) * 1e3
        kv_bytes = 2 * BATCH * CONTEXT * kv_heads * head_dim * 2
        best = min(v for k, v in row.items() if k.startswith("pallas"))
        row["pallas_best_GBps"] = kv_bytes / (best * 1e-3) / 1e9
        log(**row)


BENCH_SCHEDULER = ("scheduler: {max_num_seqs: 256, max_num_batched_tokens: 2048,\n"
                   "            token_buckets: [8, 32, 256, 2048], page_buckets: [32]}\n")


def _engine_8b(root: Path, backend: str, kv_memory: str, layout: str = "stacked",
               quant: str = "none", scheduler: str = BENCH_SCHEDULER):
    """An engine at Llama-3-8B shapes with random bf16 weights made on the device
    (`load_format="dummy"`: only the config and a tokenizer are on disk); its core, through the
    engine contract, and the seconds the engine took to build. `scheduler`: the preset's
    scheduler section (scripts/gpu_step_profile.py's dry run builds one bucket)."""
    from tiny_models import save_tokenizer

    from jengine import Engine

    path = root / "llama3-8b-random"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(LLAMA3_8B))
    save_tokenizer(path, LLAMA3_8B["vocab_size"])
    preset = root / f"bench-{layout}.yaml"
    preset.write_text(f"model: {{max_model_len: 512, layer_layout: {layout}}}\n" + scheduler)
    t = time.perf_counter()
    engine = Engine(str(path), config=str(preset), load_format="dummy", dtype="bfloat16",
                    attention_backend=backend, kv_cache_memory=kv_memory,
                    enable_prefix_caching=False, quantization=quant, progress=False)
    return engine.core, time.perf_counter() - t


def _generate(core, prompts: list[list[int]], new_tokens: int, tag: str) -> dict:
    """Runs the prompts together to completion; wall, TTFT and decode figures."""
    from jengine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    built = core.compiles_since_ready
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(f"{tag}-{i}", p, params)
    first, counts, steps = {}, {}, 0
    while core.has_unfinished:
        outs = core.step()
        steps += 1
        now = time.perf_counter()
        for out in outs:
            n = len(out.outputs[0].token_ids)
            if n and out.request_id not in first:
                first[out.request_id] = now - t0
            counts[out.request_id] = counts.get(out.request_id, 0) + n
    wall = time.perf_counter() - t0
    total = sum(counts.values())
    last_first = max(first.values())
    decode_tokens = total - len(prompts)
    return {
        "wall_s": round(wall, 3),
        "tokens": total,
        "tok_per_s": round(total / wall, 1),
        "ttft_median_s": round(statistics.median(first.values()), 4),
        "decode_tok_per_s": round(decode_tokens / max(wall - last_first, 1e-9), 1),
        "tpot_ms": round((wall - last_first) / max(new_tokens - 1, 1) * 1e3, 2),
        "steps": steps,
        "programs_compiled_in_run": core.compiles_since_ready - built,
    }


def run_throughput(log: Log, plan: list[tuple[str, str, int, str]] | None = None) -> None:
    import jax
    import numpy as np

    root = Path(tempfile.mkdtemp())
    deadline = time.monotonic() + SECTIONS["throughput"] - 25
    rng = np.random.default_rng(0)
    plan = plan or (
        [("pallas_gpu", "unstacked", c, "none") for c in CONCURRENCY]
        + [("pallas_gpu", "unstacked", c, "fp8") for c in CONCURRENCY[:2]]
    )
    core, backend = None, None
    for name, layout, c, quant in plan:
        want = (name, layout, quant)
        if time.monotonic() > deadline:
            log(backend=name, layout=layout, quant=quant, concurrency=c, skipped="out of time")
            continue
        try:
            if backend != want:
                del core
                core = None
                t = time.perf_counter()
                core, weights_s = _engine_8b(root, name, KV_MEMORY, layout, quant)
                backend = want
                log(
                    backend=name,
                    layout=layout,
                    quant=quant,
                    event="engine_ready",
                    engine_s=round(weights_s, 1),
                    start_s=round(time.perf_counter() - t, 1),
                    num_pages=core.stats().kv_pages_total,
                    device=str(jax.devices()[0]),
                )
            vocab = LLAMA3_8B["vocab_size"]
            warm = [rng.integers(0, vocab, PROMPT_LEN).tolist() for _ in range(c)]
            t = time.perf_counter()
            _generate(core, warm, 3, f"warm{c}")  # compiles this C's programs
            compile_s = time.perf_counter() - t
            prompts = [rng.integers(0, vocab, PROMPT_LEN).tolist() for _ in range(c)]
            row = _generate(core, prompts, NEW_TOKENS, f"run{c}")
            log(
                backend=name,
                layout=layout,
                quant=quant,
                concurrency=c,
                prompt_len=PROMPT_LEN,
                new_tokens=NEW_TOKENS,
                warmup_s=round(compile_s, 1),
                **row,
            )
        except Exception as e:  # noqa: BLE001 - recorded; the plan goes on
            log(
                backend=name,
                layout=layout,
                quant=quant,
                concurrency=c,
                error=f"{type(e).__name__}: {e}"[:2000],
            )
            traceback.print_exc()
            core, backend = None, None


# --- the HF peer -----------------------------------------------------------------------------


def run_hf(log: Log) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        **{k: v for k, v in LLAMA3_8B.items() if k not in ("model_type", "architectures")}
    )
    t = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).eval()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    log(
        peer="hf_transformers",
        event="model_ready",
        seconds=round(time.perf_counter() - t, 1),
        torch=torch.__version__,
        transformers=transformers.__version__,
        attn=model.config._attn_implementation,
    )
    gen = torch.Generator(device=device).manual_seed(0)
    deadline = time.monotonic() + SECTIONS["hf"] - 15
    for c in CONCURRENCY:
        if time.monotonic() > deadline:
            log(peer="hf_transformers", concurrency=c, skipped="out of time")
            continue
        ids = torch.randint(0, config.vocab_size, (c, PROMPT_LEN), device=device, generator=gen)
        kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm
            sync()
            t = time.perf_counter()
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, **kw)
            sync()
        wall = time.perf_counter() - t
        new = (out.shape[1] - PROMPT_LEN) * c
        log(
            peer="hf_transformers",
            concurrency=c,
            wall_s=round(wall, 3),
            tokens=new,
            tok_per_s=round(new / wall, 1),
        )


# --- driver ----------------------------------------------------------------------------------


def table(out: Path) -> str:
    rows = [
        json.loads(line)
        for line in (out / "gpu_session.jsonl").read_text().splitlines()
        if line.strip()
    ]
    lines = []
    lines += ["## Decode attention time (bf16, ms)", ""]
    for r in rows:
        if r.get("check") == "decode_time":
            parts = ", ".join(
                f"{k.removeprefix('pallas_gpu_').removesuffix('_ms')} {v:.3f}"
                for k, v in r.items()
                if k.endswith("_ms")
            )
            lines.append(
                f"- {r['batch']} x {r['context']}, {r['heads']}/{r['kv_heads']} heads, "
                f"D {r['head_dim']}: {parts}; best {r['pallas_best_GBps']:.0f} GB/s"
            )
    lines += [
        "",
        f"## Throughput, Llama-3-8B shapes, random bf16 weights, {PROMPT_LEN} prompt "
        f"+ {NEW_TOKENS} new tokens per request",
        "",
        "| server | C | tok/s | decode tok/s | TPOT ms | TTFT median s | wall s | "
        "compiles in run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "concurrency" in r and "tok_per_s" in r:
            who = (f"jengine {r['backend']} {r.get('layout', 'stacked')} {r.get('quant', '')}"
                   if r.get("backend") else r.get("peer"))
            lines.append(
                f"| {who} | {r['concurrency']} | {r['tok_per_s']} | "
                f"{r.get('decode_tok_per_s', '-')} | {r.get('tpot_ms', '-')} | "
                f"{r.get('ttft_median_s', '-')} | {r['wall_s']} | "
                f"{r.get('programs_compiled_in_run', '-')} |"
            )
        elif "concurrency" in r:
            lines.append(
                f"| {r.get('backend') or r.get('peer')} | {r['concurrency']} | "
                f"{r.get('error') or r.get('skipped')} | | | | | |"
            )
    errors = [r for r in rows if "error" in r]
    if errors:
        lines += ["", "## Errors", ""] + [f"- {json.dumps(r)[:600]}" for r in errors]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--section", default="all",
                        help=f"all, or a comma list of {', '.join(SECTIONS)}")
    parser.add_argument("--limit", action="append", default=[], metavar="SECTION=SECONDS",
                        help="a section's time limit (default: SECTIONS)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dry", action="store_true", help="tiny shapes (a CPU check)")
    parser.add_argument(
        "--plan",
        default=None,
        help="throughput runs backend:layout:C[:quantization], e.g. "
        "pallas_gpu:unstacked:1,pallas_gpu:unstacked:32:fp8,reference:stacked:32",
    )
    args = parser.parse_args()
    if args.dry:
        shrink_for_dry_run()
    for item in args.limit:
        name, seconds = item.split("=")
        SECTIONS[name] = float(seconds)
    sections = list(SECTIONS) if args.section == "all" else args.section.split(",")
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        plan = (
            [
                (b, layout, int(c), (q or ["none"])[0])
                for b, layout, c, *q in (item.split(":") for item in args.plan.split(","))
            ]
            if args.plan
            else None
        )
        runners = {
            "attention": run_attention,
            "throughput": functools.partial(run_throughput, plan=plan),
            "hf": run_hf,
        }
        runners[sections[0]](Log(args.out, sections[0]))
        return 0
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for section in sections:
        t = time.perf_counter()
        cmd = [sys.executable, __file__, "--out", str(args.out), "--section", section, "--child",
               *(f"--limit={k}={v}" for k, v in SECTIONS.items()),
               *(["--plan", args.plan] if args.plan else []), *(["--dry"] if args.dry else [])]
        try:
            rc = subprocess.run(cmd, env=env, timeout=SECTIONS[section]).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        Log(args.out, section)(
            event="section_done", rc=rc, seconds=round(time.perf_counter() - t, 1)
        )
    text = table(args.out)
    (args.out / "gpu_bench.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
