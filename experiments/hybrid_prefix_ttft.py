"""Prefix caching on a Gated DeltaNet hybrid (tiny random Qwen3.5, CPU): hit rate and TTFT of a
second and a third request that share a prefix with a first, with the cache on (state
snapshots at page boundaries) and off.

For each shared length L, requests A, B, C are L shared tokens + 16 of their own, one after
another; TTFT is the wall time of a `max_tokens=1` generate (prefill + one sample), median
over `--reps` fresh prefixes per L (the engines with and without the cache alternate), after
one unmeasured round that builds the step programs the lengths need. Hit rate:
`num_cached_tokens` / prompt length. A's own TTFT shows what the cut at the last full page of
every prompt costs a cold prompt.

    PYTHONPATH=. python -P experiments/hybrid_prefix_ttft.py [--lengths 32 100 500 1000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests")]

from tiny_models import randomize, save_tokenizer  # noqa: E402

from jengine import Engine, SamplingParams  # noqa: E402

VOCAB, OWN = 4096, 16
CONFIG = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=4096, tie_word_embeddings=False,
              linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
              linear_num_key_heads=2, linear_num_value_heads=4)


def save(root: Path) -> str:
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**CONFIG))
    randomize(model, norm_offset=0.0)
    model.save_pretrained(root)
    save_tokenizer(root, VOCAB)
    return str(root)


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    [out] = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    return time.perf_counter() - start, out.num_cached_tokens or 0


def measure(engine: Engine, length: int, rng: np.random.Generator) -> list[float]:
    """[A's TTFT, B's, B's cached tokens, C's, C's cached tokens]."""
    shared = rng.integers(3, VOCAB, length).tolist()
    first, _ = ttft(engine, shared + rng.integers(3, VOCAB, OWN).tolist())
    second, third = (ttft(engine, shared + rng.integers(3, VOCAB, OWN).tolist())
                     for _ in range(2))
    return [first, *second, *third]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32, 100, 500, 1000])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    runs = {}
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as root:
        path = save(Path(root))
        engines = {caching: Engine(path, config="cpu", dtype="float32", max_num_seqs=4,
                                   kv_cache_memory="256MiB", enable_prefix_caching=caching,
                                   progress=False) for caching in (True, False)}
        for engine in engines.values():
            for length in args.lengths:  # builds the programs these lengths use
                measure(engine, length, rng)
        for _ in range(args.reps):  # the two engines alternate, so other load falls on both
            for caching, engine in engines.items():
                for length in args.lengths:
                    runs.setdefault((caching, length), []).append(measure(engine, length, rng))
    rows = {key: [statistics.median(r) for r in zip(*v)] for key, v in runs.items()}
    print(f"medians of {args.reps}; TTFT in ms (prefill + one sample); prompts L + {OWN}")
    print("| shared L | hits B / C | TTFT B on / off | TTFT C on / off | TTFT A on / off |")
    print("|---|---|---|---|---|")
    for length in args.lengths:
        a, b, b_hit, c, c_hit = rows[True, length]
        a_off, b_off, _, c_off, _ = rows[False, length]
        n = length + OWN
        print(f"| {length} | {b_hit / n:.0%} / {c_hit / n:.0%} | {1e3 * b:.0f} / "
              f"{1e3 * b_off:.0f} | {1e3 * c:.0f} / {1e3 * c_off:.0f} | {1e3 * a:.0f} / "
              f"{1e3 * a_off:.0f} |")


if __name__ == "__main__":
    main()
