"""Whether n-gram speculation leaves greedy output exactly as plain decoding makes it: tokens and
each token's logprob, to the bit, on spec_bench's edit prompts (the text speculation verifies
most of), one prompt at a time, prefix caching off.

    PYTHONPATH=scripts:. python -P scripts/spec_exactness.py [--dtype bfloat16] [--config cpu]
                                                           [--max-tokens 128] [--k 3]
"""

from __future__ import annotations

import argparse

from spec_bench import EDITS, render

from jengine import Engine, SamplingParams


def first_difference(a: list, b: list) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--config", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    args = ap.parse_args()
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, logprobs=1)
    kw = dict(config=args.config, dtype=args.dtype, progress=False, enable_prefix_caching=False)
    plain = Engine(**kw)
    spec = Engine(**kw, speculative="ngram", num_speculative_tokens=args.k)
    print("| prompt | tokens | first token difference | first logprob difference | accepted |")
    print("|---|---|---|---|---|")
    for i, prompt in enumerate(EDITS):
        before = spec.stats().spec_num_accepted_tokens
        a, b = (e.generate([render(e, prompt)], sp)[0].outputs[0] for e in (plain, spec))
        lp_a = [lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids)]
        lp_b = [lp[t].logprob for lp, t in zip(b.logprobs, b.token_ids)]
        print(f"| edit {i} | {len(a.token_ids)} | {first_difference(a.token_ids, b.token_ids)} | "
              f"{first_difference(lp_a, lp_b)} | "
              f"{spec.stats().spec_num_accepted_tokens - before} |")


if __name__ == "__main__":
    main()
