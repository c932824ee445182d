"""Structured outputs on SmolLM2 at temperature 0.7: validity over many samples per case, the
cost of filling grammar masks, and the step-time cost of constrained rows.

    python experiments/structured_check.py [--n 50] [--overhead-requests 16] [--overhead-tokens 48]

Per case (tests/structured_cases.py: JSON schemas with nested objects, arrays with min/max items,
enums, integer ranges, $ref/$defs, anyOf, string patterns; regexes for email, ISO date and phone
numbers; a choice) it prints how many samples finished with "stop" and with "length", and how
many of the "stop" ones parse and validate (must be all). Then it times decode steps of a batch
of equal-length requests, all unconstrained vs. half JSON-schema constrained.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from structured_cases import CASES, run_cases  # noqa: E402

from jengine import Engine, SamplingParams  # noqa: E402
from jengine.sampling_params import StructuredOutputs  # noqa: E402

# Never finishes within --overhead-tokens: 200 digits need ~400 tokens.
LONG_ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "minItems": 200, "maxItems": 200}


class MaskTimer:
    """Wraps the engine's mask builder to time every fill."""

    def __init__(self, engine: Engine):
        self.masks = engine.core._masks
        self.build = self.masks.build
        self.seconds: list[float] = []
        self.rows: list[int] = []
        self.masks.build = self._timed

    def _timed(self, seqs, sample):
        t0 = time.perf_counter()
        out = self.build(seqs, sample)
        if out is not None:
            self.seconds.append(time.perf_counter() - t0)
            self.rows.append(sum(1 for s, b in zip(seqs, sample) if b and s.matcher is not None))
        return out

    def report(self) -> str:
        if not self.seconds:
            return "no constrained steps"
        ms = sorted(s * 1e3 for s in self.seconds)
        rows = sum(self.rows) / len(self.rows)
        return (f"mask fill per step: mean {sum(ms) / len(ms):.3f} ms, p50 {ms[len(ms) // 2]:.3f} "
                f"ms, max {ms[-1]:.3f} ms over {len(ms)} steps (mean {rows:.1f} constrained rows)")


def step_time(engine: Engine, requests: int, tokens: int, constrained: int) -> float:
    """Mean seconds per engine step while `requests` equal-length requests decode together."""
    core = engine.core
    free = SamplingParams(max_tokens=tokens, temperature=0.7, ignore_eos=True, seed=1)
    bound = SamplingParams(max_tokens=tokens, temperature=0.7, seed=1,
                           structured_outputs=StructuredOutputs(json=LONG_ARRAY))
    params = [bound] * constrained + [free] * (requests - constrained)
    prompt = "List two hundred digits as a JSON array."
    steps, start = core.num_steps, time.perf_counter()
    outs = engine.generate([prompt] * requests, params)
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs), "unequal token counts"
    return (time.perf_counter() - start) / (core.num_steps - steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50, help="samples per case")
    ap.add_argument("--config", default="test")
    ap.add_argument("--overhead-requests", type=int, default=16)
    ap.add_argument("--overhead-tokens", type=int, default=48)
    args = ap.parse_args()
    engine = Engine(config=args.config, progress=False)
    engine.core.grammars  # noqa: B018 - builds the backend and the mask buffer
    timer = MaskTimer(engine)
    print(f"{'case':<12} {'stop':>5} {'length':>6} {'valid':>6}  seconds")
    failures = 0
    for case in CASES:
        t0 = time.perf_counter()
        [tally] = run_cases(engine, [case], args.n)
        failures += tally.stop - tally.valid
        print(f"{case.name:<12} {tally.stop:>5} {tally.length:>6} {tally.valid:>6}  "
              f"{time.perf_counter() - t0:.1f}", flush=True)
        for text in tally.bad:
            print(f"    INVALID: {text!r}")
    print(timer.report())
    r, t = args.overhead_requests, args.overhead_tokens
    step_time(engine, r, 8, r // 2)  # compile the mask variant of these shapes first
    base = step_time(engine, r, t, 0)
    half = step_time(engine, r, t, r // 2)
    print(f"step time, {r} requests x {t} tokens: unconstrained {base * 1e3:.1f} ms, half "
          f"JSON-schema constrained {half * 1e3:.1f} ms ({(half / base - 1) * 100:+.1f}%)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
