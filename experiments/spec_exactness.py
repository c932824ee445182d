"""Whether speculation leaves greedy output exactly as plain decoding makes it: tokens and each
token's logprob, to the bit, on spec_bench's edit and free prompts, one prompt at a time, each
`--rounds` times on the same two engines (prefix caching on: from the second run a prompt finds
its pages cached, the case where session 23's switch to the cache's copies parted the texts).

    PYTHONPATH=scripts:. python -P experiments/spec_exactness.py [--dtype bfloat16] [--config cpu]
        [--max-tokens 128] [--method ngram | draft --draft-model DIR] [--k K] [--rounds 2]
        [--verify-all]  # the cost model off: every proposal (every draft round) is verified
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# A probe run from a source tree: its sibling probes and scripts/ (spec_bench) import however
# it is started (`python -P` leaves the script's own folder off sys.path).
sys.path[:0] = [str(Path(__file__).resolve().parent),
                str(Path(__file__).resolve().parents[1] / "scripts")]

from spec_bench import EDITS, FREE, render  # noqa: E402

from jengine import Engine, SamplingParams  # noqa: E402


def first_difference(a: list, b: list) -> int | None:
    """The first position where a and b differ (one ending first counts), None if equal."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--config", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--method", default="ngram", choices=["ngram", "draft"])
    ap.add_argument("--draft-model", help="the draft model of --method draft")
    ap.add_argument("--k", type=int, help="num_speculative_tokens (default: the method's)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--verify-all", action="store_true",
                    help="turn the cost model off: verify every proposal")
    args = ap.parse_args()
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, logprobs=1)
    kw = dict(config=args.config, dtype=args.dtype, progress=False,
              enable_prefix_caching=not args.no_prefix_caching)
    plain = Engine(**kw)
    spec = Engine(**kw, speculative=args.method, num_speculative_tokens=args.k,
                  draft_model=args.draft_model)
    if args.verify_all:
        spec.core.scheduler.speculator.step_costs = None
    print("| prompt | round | tokens | first token difference | first logprob difference "
          "| accepted / proposed |")
    print("|---|---|---|---|---|---|")
    prompts = [(f"edit {i}", p) for i, p in enumerate(EDITS)]
    prompts += [(f"free {i}", p) for i, p in enumerate(FREE)]
    for r in range(args.rounds):
        for name, prompt in prompts:
            before = spec.stats()
            a, b = (e.generate([render(e, prompt)], sp)[0].outputs[0] for e in (plain, spec))
            after = spec.stats()
            lp_a = [lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids)]
            lp_b = [lp[t].logprob for lp, t in zip(b.logprobs, b.token_ids)]
            accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
            proposed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
            print(f"| {name} | {r} | {len(a.token_ids)} | "
                  f"{first_difference(a.token_ids, b.token_ids)} | "
                  f"{first_difference(lp_a, lp_b)} | {accepted} / {proposed} |", flush=True)


if __name__ == "__main__":
    main()
