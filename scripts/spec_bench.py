"""Speculative decoding against plain decoding, in one process and one run (CPU preset, SmolLM2).

Two engines are built side by side, one without speculation and one per method, and every case
runs on each in turn for `--rounds` rounds (the median is reported), so that machine noise falls
on both alike. Workloads, greedy, 128 new tokens:
  edit: the model is given a passage and asked to reproduce it with one change (prompt lookup's
        best case: most of the answer is in the prompt);
  free: open-ended writing (little to look up).
Cases: one stream at a time (tokens/s and TPOT: the time between tokens after the first, from the
engine's stream), and 8 and 32 concurrent requests of the two workloads mixed (aggregate tok/s).
Outputs are compared token for token with the plain engine's.

    python scripts/spec_bench.py [--rounds 2] [--methods ngram] [--k 3 15:2] [--dtype bfloat16]
                                 [--streams]  # no --streams values: the single-stream cases only
    python scripts/spec_bench.py --methods draft --draft-model DIR  # e.g. a w8a16 convert
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from jengine import Engine, SamplingParams
from jengine.config import CONFIG_DIR

TEXT = (Path(__file__).resolve().parent / "data" / "pride_and_prejudice_ch1-3.txt").read_text()

EDITS = [
    ("Rewrite the following passage exactly as it is, but replace the name \"Bennet\" with "
     "\"Smith\" everywhere:\n\n" + TEXT[start:start + 700])
    for start in (0, 2000, 4000)
]
CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''
EDITS.append("Add a docstring to this Python function and return the whole function:\n\n" + CODE)
FREE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "Give me five ideas for a rainy Sunday afternoon, with a sentence on each.",
    "What are the pros and cons of working from home?",
]


def chat(engine: Engine, prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def render(engine: Engine, prompt: str) -> str:
    return engine.tokenizer.apply_chat_template(chat(engine, prompt), tokenize=False,
                                                add_generation_prompt=True)


def single_stream(engine: Engine, prompts: list[str], sp: SamplingParams):
    """Tokens/s (tokens over wall time) and median TPOT of each prompt run alone, in order."""
    rates, tpots, outputs = [], [], []
    for prompt in prompts:
        start = time.perf_counter()
        stamps, ids = [], []
        for delta in engine.stream(render(engine, prompt), sp):
            new = delta.outputs[0].token_ids
            if new:
                stamps.append(time.perf_counter())
                ids.extend(new)
        rates.append(len(ids) / (time.perf_counter() - start))
        if len(stamps) > 1:
            # A delta may carry several tokens (accepted proposals): time per token after the first.
            tpots.append((stamps[-1] - stamps[0]) / (len(ids) - 1))
        outputs.append(ids)
    return statistics.mean(rates), statistics.median(tpots), outputs


def concurrent(engine: Engine, prompts: list[str], sp: SamplingParams):
    start = time.perf_counter()
    outs = engine.generate([render(engine, p) for p in prompts], sp)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return n / (time.perf_counter() - start), [o.outputs[0].token_ids for o in outs]


def preset(ngram_min: int) -> str:
    """The `cpu` preset, with the n-gram proposer's shortest match set (a file when not 1)."""
    if ngram_min == 1:
        return "cpu"
    data = yaml.safe_load((CONFIG_DIR / "cpu.yaml").read_text())
    data.setdefault("speculative", {})["ngram_min"] = ngram_min
    path = Path(tempfile.mkdtemp()) / f"cpu_ngram_min{ngram_min}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--methods", nargs="+", default=["ngram"])
    ap.add_argument("--k", nargs="+", default=["3"],
                    help="num_speculative_tokens, or K:N for k = K with ngram_min N (several: "
                         "one engine per method and value)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, nargs="*", default=[8, 32])
    ap.add_argument("--draft-model", help="the draft model of method draft")
    ap.add_argument("--dtype", default="float32",
                    help="the model dtype (the preset's float32; auto or bfloat16 for the AMX "
                         "kernels, whose few-row projections cost about one row's)")
    args = ap.parse_args()
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    engines = {"off": Engine(config="cpu", dtype=args.dtype, progress=False, warmup=True)}
    for m in args.methods:
        for value in args.k:
            k, _, ngram_min = value.partition(":")
            name = m if len(args.k) == 1 else f"{m} k={k}" + (f" n>={ngram_min}" * bool(ngram_min))
            engines[name] = Engine(config=preset(int(ngram_min or 1)), dtype=args.dtype,
                                   speculative=m, num_speculative_tokens=int(k),
                                   draft_model=args.draft_model if m == "draft" else None,
                                   progress=False, warmup=True)
    cases = {"edit, 1 stream": ("single", EDITS), "free, 1 stream": ("single", FREE)}
    for n in args.streams:
        cases[f"mixed, {n} streams"] = ("concurrent", (EDITS + FREE) * (n // 8))
    results: dict[tuple[str, str], list] = {}
    outputs: dict[tuple[str, str], list] = {}
    for name, (kind, prompts) in cases.items():
        for engine in engines.values():  # warm pages and programs for this case
            (single_stream if kind == "single" else concurrent)(engine, prompts[:1], sp)
        for _ in range(args.rounds):
            for name_e, engine in engines.items():
                before = engine.stats()
                if kind == "single":
                    rate, tpot, outs = single_stream(engine, prompts, sp)
                else:
                    (rate, outs), tpot = concurrent(engine, prompts, sp), None
                after = engine.stats()
                drafts = after.spec_num_drafts - before.spec_num_drafts
                accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
                proposed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
                results.setdefault((name, name_e), []).append((rate, tpot, drafts, accepted,
                                                               proposed))
                outputs[(name, name_e)] = outs
    print("| case | engine | tok/s | TPOT ms | vs off | accepted / proposed | tokens per "
          "verify step | greedy text |")
    print("|---|---|---|---|---|---|---|---|")
    for name in cases:
        base = statistics.median(r[0] for r in results[(name, "off")])
        for name_e in engines:
            rs = results[(name, name_e)]
            rate = statistics.median(r[0] for r in rs)
            tpots = [r[1] for r in rs if r[1] is not None]
            tpot = f"{1e3 * statistics.median(tpots):.1f}" if tpots else "-"
            drafts, accepted, proposed = (sum(r[i] for r in rs) for i in (2, 3, 4))
            acc = f"{accepted} / {proposed}" if proposed else "-"
            per_step = f"{1 + accepted / drafts:.2f}" if drafts else "-"
            same = "same" if outputs[(name, name_e)] == outputs[(name, "off")] else "DIFFERENT"
            print(f"| {name} | {name_e} | {rate:.1f} | {tpot} | {rate / base:.2f}x | {acc} | "
                  f"{per_step} | {same} |")


if __name__ == "__main__":
    main()
