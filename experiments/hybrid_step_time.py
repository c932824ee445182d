"""Step time of a Gated DeltaNet hybrid (Qwen3.5 layout: 3 linear layers per attention layer)
against an attention-only model of the same widths (Qwen3), tiny random, CPU, as ratios.

Both are saved as HF checkpoints (random weights, 8 layers, hidden 256) and served by an
`EngineCore` of the `cpu` preset (float32) compiled for just the shapes measured: `--decodes`
sequences with `--context` tokens cached, one new token each, and one `--prefill`-token chunk
of a single sequence. A figure is the median wall time of `Runner.execute` over `--reps` calls;
the models alternate for `--rounds` rounds (medians of medians), so other load falls on both.

    PYTHONPATH=. python -P experiments/hybrid_step_time.py [--decodes 1 64] [--prefill 256]
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

from jengine.config import load_config  # noqa: E402
from jengine.core.engine_core import EngineCore  # noqa: E402
from jengine.runtime.step_io import SamplingRows  # noqa: E402
from jengine.scheduling.batch import ScheduledBatch  # noqa: E402

PAGE, VOCAB = 16, 4096
COMMON = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=4096, tie_word_embeddings=False)
HYBRID = dict(linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
              linear_num_key_heads=2, linear_num_value_heads=4)


def save(kind: str, root: Path) -> str:
    path = root / kind
    if kind == "hybrid":
        config, cls = transformers.Qwen3_5TextConfig(**COMMON, **HYBRID), \
            transformers.Qwen3_5ForCausalLM
    else:
        config, cls = transformers.Qwen3Config(**COMMON), transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(config)
    randomize(model, norm_offset=0.0 if kind == "hybrid" else 1.0)
    model.save_pretrained(path)
    save_tokenizer(path, VOCAB)
    return str(path)


def batch(num_seqs: int, q_len: int, cached: int, hybrid: bool) -> ScheduledBatch:
    """`num_seqs` sequences with `cached` tokens in the cache running `q_len` tokens each, on
    disjoint pages (and, for the hybrid, state slots 1..num_seqs)."""
    kv_len = cached + q_len
    pages = -(-kv_len // PAGE)
    table = 1 + np.arange(num_seqs * pages, dtype=np.int32).reshape(num_seqs, pages)
    positions = np.concatenate([np.arange(cached, kv_len, dtype=np.int32)] * num_seqs)
    seq_of = np.repeat(np.arange(num_seqs), q_len)
    slots = table[seq_of, positions // PAGE] * PAGE + positions % PAGE
    return ScheduledBatch(
        seq_ids=list(range(num_seqs)),
        token_ids=np.random.default_rng(0).integers(3, VOCAB, num_seqs * q_len).astype(np.int32),
        positions=positions, slot_mapping=slots.astype(np.int32),
        q_lens=np.full((num_seqs,), q_len, np.int32),
        kv_lens=np.full((num_seqs,), kv_len, np.int32), page_table=table,
        sample=np.ones((num_seqs,), bool),
        state_slots=np.arange(1, num_seqs + 1, dtype=np.int32) if hybrid else None)


def step_ms(core: EngineCore, b: ScheduledBatch, reps: int) -> float:
    rows = SamplingRows.empty(b.num_seqs)
    core.runner.execute(b, rows)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        core.runner.execute(b, rows)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decodes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    pages = -(-(args.context + args.prefill) // PAGE)
    cases = {f"{n} decodes": (n, 1, args.context - 1) for n in args.decodes}
    cases[f"prefill {args.prefill}"] = (1, args.prefill, 0)
    tokens = sorted({n * q for n, q, _ in cases.values()})
    seqs = sorted({n for n, _, _ in cases.values()})
    cores, batches = {}, {}
    with tempfile.TemporaryDirectory() as root:
        for kind in ("attention", "hybrid"):
            cfg = load_config("cpu", model=save(kind, Path(root)), dtype="float32",
                              max_model_len=args.context + args.prefill,
                              max_num_seqs=max(seqs), max_num_batched_tokens=max(tokens),
                              token_buckets=tuple(tokens), seq_buckets=tuple(seqs),
                              page_buckets=(pages,), enable_prefix_caching=False,
                              kv_cache_memory="256MiB")
            cores[kind] = EngineCore(cfg, progress=False)
            for name, case in cases.items():
                batches[kind, name] = batch(*case, hybrid=kind == "hybrid")
    runs = {key: [] for key in batches}
    for _ in range(args.rounds):
        for (kind, name), b in batches.items():
            runs[kind, name].append(step_ms(cores[kind], b, args.reps))
    med = {key: statistics.median(v) for key, v in runs.items()}
    print(f"medians over {args.rounds} rounds of {args.reps}-call medians")
    print("| step | attention-only ms | hybrid ms | hybrid / attention |")
    print("|---|---|---|---|")
    for name in cases:
        a, h = med["attention", name], med["hybrid", name]
        print(f"| {name} | {a:.2f} | {h:.2f} | {h / a:.2f}x |")


if __name__ == "__main__":
    main()
