"""`jengine bench throughput`: the offline engine on N prompts, optionally beside HF transformers.

Prompts are chat-templated requests of about `--input-len` tokens; every request generates
exactly `--output-len` tokens (EOS ignored) so both sides do the same work. The HF baseline runs
`generate` in static batches with left padding on the same prompt ids (it needs torch; install
the test extra), in the same process and run, and the result reports the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from jengine.engine_flags import make_engine

_TOPICS = (
    "the history of astronomy", "how bridges carry load", "the water cycle", "medieval trade",
    "how compilers work", "the biology of sleep", "volcanoes", "the invention of paper",
)


def make_prompts(tokenizer, num: int, input_len: int, chat: bool) -> list[list[int]]:
    """`num` distinct prompts of exactly `input_len` token ids (chat-templated if `chat`)."""
    prompts = []
    filler = ("Please explain it step by step, with examples and the key facts a student "
              "should remember. ")
    for i in range(num):
        # ~20 tokens a filler: enough of them for any input_len (the ids are cut to size).
        text = f"Request {i}: tell me about {_TOPICS[i % len(_TOPICS)]}. " + filler * max(
            20, input_len // 10)
        if chat:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        ids = list(tokenizer(text, add_special_tokens=False).input_ids)
        if chat:  # keep the template's tail (assistant header) and trim the message body
            tail = tokenizer.apply_chat_template(
                [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True
            )
            tail_ids = list(tokenizer(tail.split("x")[-1], add_special_tokens=False).input_ids)
            ids = ids[: input_len - len(tail_ids)] + tail_ids
        else:
            ids = ids[:input_len]
        prompts.append(ids)
    return prompts


def run_engine(engine, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    from jengine.sampling_params import SamplingParams

    core = engine.core
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    host0, device0, steps0 = core.host_seconds, core.device_seconds, core.num_steps
    start = time.perf_counter()
    states = [core.add_request(f"bench-{i}", p, params) for i, p in enumerate(prompts)]
    step_times = []
    while core.has_unfinished:
        t0 = time.perf_counter()
        core.step()
        step_times.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - start
    generated = sum(s.num_generated for s in states)
    ttft = [s.first_token_time - s.arrival for s in states]
    tpot = [
        (s.finish_time - s.first_token_time) / max(1, s.num_generated - 1) for s in states
    ]
    return {
        "output_tokens": generated,
        "seconds": elapsed,
        "output_tok_per_s": generated / elapsed,
        "ttft_median_s": statistics.median(ttft),
        "tpot_median_s": statistics.median(tpot),
        "steps": len(step_times),
        "step_median_ms": 1e3 * statistics.median(step_times),
        "recompiles": core.compiles_since_ready,
        # Host work between device steps (schedule, batch building, postprocess, detokenize).
        "host_ms_per_step": 1e3 * (core.host_seconds - host0) / (core.num_steps - steps0),
        "device_ms_per_step": 1e3 * (core.device_seconds - device0) / (core.num_steps - steps0),
    }


def run_hf(model_source: str, prompts: list[list[int]], output_len: int, dtype: str,
           batch_size: int, pad_id: int) -> dict[str, Any]:
    import os

    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    if model_source.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_source), gguf_file=os.path.basename(model_source),
            dtype=torch_dtype,
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_source, dtype=torch_dtype)
    model.eval()
    start = time.perf_counter()
    generated = 0
    for b in range(0, len(prompts), batch_size):
        chunk = prompts[b : b + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                min_new_tokens=output_len, do_sample=False, pad_token_id=pad_id,
            )
        generated += (out.shape[1] - width) * len(chunk)
    elapsed = time.perf_counter() - start
    return {"output_tokens": generated, "seconds": elapsed, "output_tok_per_s": generated / elapsed,
            "dtype": dtype, "batch_size": batch_size}


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    engine = make_engine(args, warmup=True)  # compiles are not what a throughput run times
    prompts = make_prompts(engine.tokenizer, args.num_prompts, args.input_len, args.chat)
    print(f"bench: {len(prompts)} prompts x {args.input_len} tokens -> {args.output_len} new",
          file=sys.stderr)
    result: dict[str, Any] = {
        "model": engine.core.model.source,
        "num_prompts": len(prompts),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "jengine": run_engine(engine, prompts, args.output_len),
    }
    pad = engine.tokenizer.pad_token_id
    pad = engine.core.model.eos_token_ids[0] if pad is None else pad
    ours = result["jengine"]["output_tok_per_s"]
    for dtype in args.hf_baseline:
        hf = run_hf(args.hf_model or engine.core.model.source, prompts, args.output_len,
                    dtype, args.hf_batch_size, pad)
        result[f"hf_{dtype}"] = hf
        result[f"ratio_vs_hf_{dtype}"] = ours / hf["output_tok_per_s"]
    return result
