"""The n-gram speculation's pause settings against each other, in one process and one run.

The pauses (`jengine.scheduling.speculative`: NO_PROPOSAL_PAUSE, DECLINED_PAUSE, BACKOFF_STEPS,
MISSES_BEFORE_BACKOFF) are module constants read at each step, so one engine per `--k` value
serves every variant: each variant sets its constants, then runs
spec_bench's single-stream workload (`--workload edit` or `free`, greedy, 128 tokens), all
variants and the plain engine in turn for `--rounds` rounds; medians, tokens/s against the
plain engine, and whether the text is the plain engine's.

    python experiments/spec_pauses.py --k 15:2 --dtype bfloat16 \
        --variant shipped --variant before:BACKOFF_STEPS=16,DECLINED_PAUSE=6,NO_PROPOSAL_PAUSE=4
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

# A probe run from a source tree: its sibling probes and scripts/ (spec_bench) import however
# it is started (`python -P` leaves the script's own folder off sys.path).
sys.path[:0] = [str(Path(__file__).resolve().parent),
                str(Path(__file__).resolve().parents[1] / "scripts")]

from spec_bench import EDITS, FREE, preset, single_stream  # noqa: E402

from jengine import Engine, SamplingParams  # noqa: E402
from jengine.scheduling import speculation, speculative  # noqa: E402

PAUSES = ("NO_PROPOSAL_PAUSE", "DECLINED_PAUSE", "BACKOFF_STEPS", "MISSES_BEFORE_BACKOFF")


def parse_variant(text: str) -> tuple[str, dict[str, int]]:
    """NAME[:CONST=V,CONST=V...] -> (name, the shipped constants with these replaced)."""
    name, _, assigns = text.partition(":")
    values = {c: getattr(speculative, c) for c in PAUSES}
    for item in filter(None, assigns.split(",")):
        key, _, value = item.partition("=")
        if key not in PAUSES:
            raise SystemExit(f"unknown pause {key!r}; one of {PAUSES}")
        values[key] = int(value)
    return name, values


def apply(values: dict[str, int]) -> None:
    for key, value in values.items():
        setattr(speculative, key, value)
        if hasattr(speculation, key):  # imported by name there
            setattr(speculation, key, value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", nargs="+", default=["15:2"], help="K or K:N (ngram_min N)")
    ap.add_argument("--variant", action="append", default=[], help="NAME[:CONST=V,...]")
    ap.add_argument("--workload", choices=["edit", "free"], default="edit")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    variants = [parse_variant(v) for v in args.variant or ["shipped"]]
    prompts = EDITS if args.workload == "edit" else FREE
    sp = SamplingParams(max_tokens=128, temperature=0)
    off = Engine(config="cpu", dtype=args.dtype, progress=False, warmup=True)
    runs = {"off": (off, None)}
    for value in args.k:
        k, _, ngram_min = value.partition(":")
        engine = Engine(config=preset(int(ngram_min or 1)), dtype=args.dtype, speculative="ngram",
                        num_speculative_tokens=int(k), progress=False, warmup=True)
        for name, values in variants:
            runs[f"k={value} {name}"] = (engine, values)
    shipped = {c: getattr(speculative, c) for c in PAUSES}
    for engine, _ in runs.values():
        single_stream(engine, prompts[:1], sp)  # warm pages and programs
    rates = {name: [] for name in runs}
    outputs, counts = {}, {}
    for _ in range(args.rounds):
        for name, (engine, values) in runs.items():
            apply(values or shipped)
            before = engine.stats()
            rate, _, outs = single_stream(engine, prompts, sp)
            after = engine.stats()
            rates[name].append(rate)
            outputs[name] = outs
            counts[name] = (after.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
                            after.spec_num_draft_tokens - before.spec_num_draft_tokens,
                            after.spec_num_drafts - before.spec_num_drafts)
    apply(shipped)
    base = statistics.median(rates["off"])
    print("| engine | pauses | tok/s | vs off | rounds | accepted / proposed / verifications "
          "(last round) | greedy text |")
    print("|---|---|---|---|---|---|---|")
    for name, (_, values) in runs.items():
        rate = statistics.median(rates[name])
        pauses = ", ".join(f"{k}={v}" for k, v in (values or {}).items()) or "-"
        acc = "{} / {} / {}".format(*counts[name]) if values else "-"
        same = "same" if outputs[name] == outputs["off"] else "DIFFERENT"
        print(f"| {name} | {pauses} | {rate:.1f} | {rate / base:.2f}x | "
              f"{', '.join(f'{r:.1f}' for r in rates[name])} | {acc} | {same} |")


if __name__ == "__main__":
    main()
