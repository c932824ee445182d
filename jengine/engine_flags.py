"""The engine flag group that every engine-building command shares, and flags -> `Engine`.

Kept apart from `jengine.cli.main` so that the benchmarks and the server build engines from parsed
flags without importing the command-line module (nothing imports `jengine.cli.main`).
"""

from __future__ import annotations

import argparse

ENGINE_FLAGS = (
    "model", "config", "mesh", "dtype", "attention_backend", "kv_cache_dtype", "quantization",
    "quantize_lm_head", "load_format", "speculative", "num_speculative_tokens", "draft_model",
    "max_model_len", "max_num_seqs", "max_num_batched_tokens", "page_size", "kv_cache_memory",
    "enable_prefix_caching", "coordinator", "num_processes", "process_id", "seed",
    "task", "pooling", "normalize", "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras",
    "limit_mm_per_prompt",
)


def engine_parent() -> argparse.ArgumentParser:
    """The engine flag group of every command that builds an engine. Defaults are None (not
    given): the preset, then the config dataclasses, decide, so an explicit flag always wins."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("engine")
    g.add_argument("--model", help="HF dir, .gguf file, converted checkpoint or cached hub id "
                   "(default: the bundled SmolLM2-135M-Instruct)")
    g.add_argument("--config", help="YAML preset name (configs/) or path")
    g.add_argument("--mesh", help="device mesh, e.g. tp=8 or dp=2,tp=4 (default tp=1)")
    g.add_argument("--cpu-devices", type=int, metavar="N",
                   help="on a CPU-only machine, split the host into N fake devices (for trying "
                   "--mesh without accelerators; no speed-up)")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--attention-backend",
                   choices=["auto", "reference", "cpu", "pallas_tpu", "pallas_gpu"])
    g.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16", "int8", "fp8"],
                   help="KV cache element type (auto: the model dtype); sizes the page pool. "
                   "int8 / fp8 (e4m3): one f32 scale per token and kv head, 1.88x bf16's "
                   "tokens at head dim 64; int8 on every attention backend, fp8 on reference, "
                   "pallas_gpu and pallas_tpu")
    g.add_argument("--quantization", choices=["none", "int8", "w8a16", "fp8", "w4a16", "auto"],
                   help="int8: int8 weights and activations (W8A8); w8a16: int8 weights only; "
                   "fp8: e4m3 weights (GPU/TPU); w4a16: 4-bit weights with a scale and min "
                   "per 32 (the output head int8); auto: a GGUF's own precision (Q4_x -> "
                   "w4a16, Q8_0 -> w8a16, else none). Quantized at load time from any source "
                   "(default none)")
    g.add_argument("--quantize-lm-head", action=argparse.BooleanOptionalAction,
                   help="with --quantization: the output head (a tied embedding too) as well; "
                   "saves its bytes and its float dot for ~1 point of perplexity (default off)")
    g.add_argument("--load-format", choices=["auto", "dummy"],
                   help="dummy: random weights of the model's shapes (only its config and "
                   "tokenizer are read), for timing; default auto (the source's weights)")
    g.add_argument("--speculative", choices=["ngram", "draft"],
                   help="speculative decoding: ngram = prompt lookup, verified in the same step "
                   "(outputs unchanged); draft = a smaller model of the same tokenizer "
                   "(--draft-model) drafts greedily. Default off")
    g.add_argument("--num-speculative-tokens", type=int, metavar="K",
                   help="tokens proposed per decode step, 1-15 (default: 15 for ngram, "
                   "3 for draft)")
    g.add_argument("--draft-model", help="the draft model of --speculative draft")
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--max-num-seqs", type=int, help="default 64")
    g.add_argument("--max-num-batched-tokens", type=int, help="default 512")
    g.add_argument("--page-size", type=int, help="default 16")
    g.add_argument("--kv-cache-memory", help="default 2GiB")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   help="default on")
    g.add_argument("--task", choices=["generate", "embed", "score"],
                   help="embed / score: serve pooled final hidden states (/v1/embeddings, "
                   "/v1/rerank, /v1/score) and refuse generation (default generate)")
    g.add_argument("--pooling", choices=["last", "mean", "cls"],
                   help="with --task embed/score: how token states become one vector (default: "
                   "the model's sentence-transformers modules.json, else last)")
    g.add_argument("--normalize", action=argparse.BooleanOptionalAction,
                   help="with --task embed/score: L2-normalise vectors (default: the model's "
                   "modules.json lists Normalize; without one, on)")
    g.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve LoRA adapters over the model (docs/lora.md)")
    g.add_argument("--max-loras", type=int, metavar="N",
                   help="with --enable-lora: adapters in one step, the device slots (default 4)")
    g.add_argument("--max-lora-rank", type=int, metavar="R",
                   help="with --enable-lora: the highest adapter rank (default 64)")
    g.add_argument("--max-cpu-loras", type=int, metavar="M",
                   help="with --enable-lora: adapters kept read on the host (default: "
                   "--max-loras)")
    g.add_argument("--limit-mm-per-prompt", metavar="image=N",
                   help="vision models: the most images one prompt may hold (default image=4)")
    g.add_argument("--coordinator", metavar="HOST:PORT",
                   help="multi-host: process 0's address for jax.distributed")
    g.add_argument("--num-processes", type=int, help="multi-host: process count (default 1)")
    g.add_argument("--process-id", type=int,
                   help="multi-host: this process's rank (0 schedules and serves)")
    return p


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine keywords among `args` (None where a flag was not given)."""
    return {k: getattr(args, k) for k in ENGINE_FLAGS if hasattr(args, k)}


def make_engine(args: argparse.Namespace, *, warmup: bool = False):
    """An `Engine` from parsed flags (`warmup`: build every bucket's program up front)."""
    from jengine.engine import Engine  # JAX starts here, after the flags are checked

    kwargs = engine_kwargs(args)
    return Engine(kwargs.pop("model"), warmup=warmup, **kwargs)
