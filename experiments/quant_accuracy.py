"""Accuracy of each quantization mode against the unquantized model, in one run.

For every mode (default: int8 smoothed, int8 unsmoothed, int8 with the lm_head, w8a16; `/int8`
after a mode: over an int8 KV cache) beside `none` (the model dtype, its KV cache too):
- perplexity of a fixed public-domain text (`scripts/data/pride_and_prejudice_ch1-3.txt`:
  chapters 1-3 of Jane Austen's *Pride and Prejudice*, 1813), in independent windows of
  `--window` tokens;
- mean KL(unquantized || quantized) of the next-token distributions at every window position,
  and how often the two argmaxes agree there (teacher forced: both read the same text);
- greedy decoding of `--prompts` prompts (24-token slices of the text at evenly spaced
  offsets) for `--new-tokens` tokens through the engine (scheduler, paged cache, sampler):
  the share of generated tokens equal to the unquantized run's at the same position, and the
  mean number of tokens before the first difference.

Every model is an `EngineCore` of this tree (weights loaded, quantized, laid out as served);
the window logits come from the model's own forward over the engine's params.

    python experiments/quant_accuracy.py [--model PATH] [--modes int8 int8@0 int8+head w8a16]
    python experiments/quant_accuracy.py --modes none/int8 int8/int8   # an int8 KV cache
    python experiments/quant_accuracy.py --modes none/fp8 --attention-backend reference  # fp8 KV
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jengine.config import load_config
from jengine.core.engine_core import EngineCore
from jengine.models import AttentionMetadata, KVCache, family_module
from jengine.models.quant import weight_bytes
from jengine.sampling_params import SamplingParams

TEXT = Path(__file__).resolve().parents[1] / "scripts" / "data" / "pride_and_prejudice_ch1-3.txt"
PAGE = 16
PROMPT_LEN = 24


def build(model: str | None, mode: str, num_prompts: int, new_tokens: int,
          attention_backend: str | None = None) -> EngineCore:
    """`mode` is a quantization mode, with `+head` to quantize the lm_head too, `@A` for
    int8 smoothing strength A (`int8@0`: no smoothing; default: the config's) and `/KV` for
    the KV cache dtype (`none/int8`: unquantized weights over an int8 KV cache); the attention
    backend is the preset's unless given (an fp8 cache needs one other than `cpu`)."""
    mode, _, kv_cache_dtype = mode.partition("/")
    mode, _, alpha = mode.partition("@")
    quantization, _, head = mode.partition("+")
    smoothing = {"smoothing_alpha": float(alpha)} if alpha else {}
    max_len = PROMPT_LEN + new_tokens
    cfg = load_config(
        "cpu", model=model, quantization=quantization, quantize_lm_head=bool(head), **smoothing,
        max_model_len=max_len, kv_cache_memory="256MiB", max_num_seqs=num_prompts,
        max_num_batched_tokens=256, token_buckets=(num_prompts, 256), seq_buckets=(num_prompts,),
        page_buckets=(-(-max_len // PAGE),), kv_cache_dtype=kv_cache_dtype or None,
        attention_backend=attention_backend,
    )
    return EngineCore(cfg, progress=False)


def window_logits(core: EngineCore, windows: np.ndarray):
    """Yields float32 logits [W, V] of each window [N, W], each a fresh sequence (own pages)."""
    cfg = core.model_config
    forward = jax.jit(lambda p, kv, md: family_module(cfg).forward(p, cfg, kv, md,
                                                                   all_logits=True))
    width = windows.shape[1]
    pages = -(-width // PAGE)
    positions = np.arange(width, dtype=np.int32)
    table = np.arange(1, pages + 1, dtype=np.int32)[None]  # page 0 is the scratch page
    kv = KVCache.zeros(cfg, pages + 1, PAGE, core.kv_cache_dtype)
    for ids in windows:
        md = AttentionMetadata(
            token_ids=jnp.asarray(ids, jnp.int32), positions=jnp.asarray(positions),
            slot_mapping=jnp.asarray(table[0, positions // PAGE] * PAGE + positions % PAGE),
            token_seq=jnp.zeros(width, jnp.int32), page_table=jnp.asarray(table),
            logits_indices=jnp.asarray([width - 1], jnp.int32),
        )
        logits, kv = forward(core.runner.params, kv, md)
        yield logits


@jax.jit
def compare(ref_logits, logits, targets):
    """Per position: NLL of the next token under both, KL(ref || quantized), argmax agreement."""
    ref = jax.nn.log_softmax(ref_logits[:-1], axis=-1)  # [W-1, V]
    out = jax.nn.log_softmax(logits[:-1], axis=-1)
    pick = targets[1:, None]
    kl = jnp.sum(jnp.exp(ref) * (ref - out), axis=-1)
    agree = jnp.argmax(ref, -1) == jnp.argmax(out, -1)
    return (-jnp.take_along_axis(ref, pick, 1)[:, 0], -jnp.take_along_axis(out, pick, 1)[:, 0],
            kl, agree)


def greedy(core: EngineCore, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    states = [core.add_request(f"acc-{i}", p, params) for i, p in enumerate(prompts)]
    while core.has_unfinished:
        core.step()
    return [list(s.samples[0].seq.output_ids) for s in states]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--modes", nargs="+", default=["int8", "int8@0", "int8+head", "w8a16"])
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--attention-backend", help="default: the cpu preset's (fp8 KV: reference)")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    start = time.perf_counter()
    cores = {mode: build(args.model, mode, args.prompts, args.new_tokens,
                         args.attention_backend)
             for mode in ["none", *args.modes]}
    tokenizer = cores["none"].tokenizer
    ids = np.asarray(tokenizer(TEXT.read_text(), add_special_tokens=False).input_ids, np.int32)
    num = len(ids) // args.window
    windows = ids[: num * args.window].reshape(num, args.window)
    stats = {mode: [] for mode in args.modes}
    ref_nll = []
    streams = {mode: window_logits(core, windows) for mode, core in cores.items()}
    for window in windows:
        ref = next(streams["none"])
        for mode in args.modes:
            nll_ref, nll, kl, agree = compare(ref, next(streams[mode]), jnp.asarray(window))
            stats[mode].append((np.asarray(nll), np.asarray(kl), np.asarray(agree)))
        ref_nll.append(np.asarray(nll_ref))
    offsets = np.linspace(0, len(ids) - PROMPT_LEN, args.prompts).astype(int)
    prompts = [ids[o:o + PROMPT_LEN].tolist() for o in offsets]
    outputs = {mode: greedy(core, prompts, args.new_tokens) for mode, core in cores.items()}
    ref_ppl = float(np.exp(np.concatenate(ref_nll).mean()))
    rows = {"none": {"perplexity": ref_ppl,
                     "weights_MiB": weight_bytes(cores["none"].runner.params) / 2**20}}
    for mode in args.modes:
        nll, kl, agree = (np.concatenate(parts) for parts in zip(*stats[mode]))
        same = np.asarray(outputs[mode]) == np.asarray(outputs["none"])  # [prompts, tokens]
        first_diff = np.where(same.all(1), same.shape[1], np.argmin(same, axis=1))
        rows[mode] = {
            "perplexity": float(np.exp(nll.mean())),
            "perplexity_change": float(np.exp(nll.mean())) / ref_ppl - 1,
            "mean_kl": float(kl.mean()),
            "next_token_agreement": float(agree.mean()),
            "greedy_agreement": float(same.mean()),
            "greedy_tokens_before_first_difference": float(first_diff.mean()),
            "weights_MiB": weight_bytes(cores[mode].runner.params) / 2**20,
        }
    result = {
        "model": cores["none"].model.source, "dtype": cores["none"].dtype,
        "text_tokens_scored": int(windows.size - num), "window": args.window,
        "prompts": args.prompts, "new_tokens": args.new_tokens,
        "seconds": time.perf_counter() - start, "modes": rows,
    }
    print(json.dumps(result, indent=1))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))
    print("| mode | perplexity | vs none | mean KL | next-token agree | greedy agree "
          "| tokens to 1st diff | weights MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in rows.items():
        if mode == "none":
            print(f"| none ({result['dtype']}) | {r['perplexity']:.3f} | | | | | "
                  f"| {r['weights_MiB']:.0f} |")
            continue
        print(f"| {mode} | {r['perplexity']:.3f} | {100 * r['perplexity_change']:+.2f}% "
              f"| {r['mean_kl']:.4f} | {100 * r['next_token_agreement']:.1f}% "
              f"| {100 * r['greedy_agreement']:.1f}% "
              f"| {r['greedy_tokens_before_first_difference']:.1f} / {args.new_tokens} "
              f"| {r['weights_MiB']:.0f} |")


if __name__ == "__main__":
    main()
