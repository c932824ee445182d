"""The `jengine` command: serve | generate | chat | convert | compile | info | bench.

Generated text goes to stdout; progress and logs go to stderr. Bad input ends with a one-line
`jengine: error: ...` and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from converters.errors import ModelLoadError

ENGINE_FLAGS = (
    "model", "config", "mesh", "dtype", "attention_backend", "kv_cache_dtype", "max_model_len",
    "max_num_seqs", "max_num_batched_tokens", "page_size", "kv_cache_memory",
    "enable_prefix_caching", "coordinator", "num_processes", "process_id", "seed",
)


def _engine_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("engine")
    g.add_argument("--model", help="HF dir, .gguf file, converted checkpoint or cached hub id "
                   "(default: the bundled SmolLM2-135M-Instruct)")
    g.add_argument("--config", help="YAML preset name (configs/) or path")
    g.add_argument("--mesh", default="tp=1", help="device mesh, e.g. tp=8 or dp=2,tp=4")
    g.add_argument("--cpu-devices", type=int, metavar="N",
                   help="on a CPU-only machine, split the host into N fake devices (for trying "
                   "--mesh without accelerators; no speed-up)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--attention-backend", default="auto",
                   choices=["auto", "reference", "cpu", "pallas_tpu", "pallas_gpu"])
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="KV cache element type (auto: the model dtype); sizes the page pool")
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", default="2GiB")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--coordinator", metavar="HOST:PORT",
                   help="multi-host: process 0's address for jax.distributed")
    g.add_argument("--num-processes", type=int, default=1, help="multi-host: process count")
    g.add_argument("--process-id", type=int, default=0,
                   help="multi-host: this process's rank (0 schedules and serves)")
    return p


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)


def _names(text: str) -> list[str]:
    """A list flag: a JSON list (vLLM's form, '["*"]') or comma-separated names."""
    text = text.strip()
    if text.startswith("["):
        try:
            names = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return names
    return [n.strip() for n in text.split(",") if n.strip()]


def _serve_flags(p: argparse.ArgumentParser) -> None:
    """`jengine serve`'s own flags; the names are vLLM's where vLLM has the same thing."""
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="the model, as --model (vLLM's `serve MODEL`)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, metavar="N",
                   help="the same as --mesh tp=N")
    p.add_argument("--seed", type=int, help="seed of the requests that set none")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key")
    p.add_argument("--grpc-port", type=int)
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="names the model answers to; the first is the one reported")
    p.add_argument("--chat-template", help="a Jinja chat template (its text, or a file)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests send their own chat_template")
    p.add_argument("--root-path", default="", help="the path prefix behind a proxy")
    p.add_argument("--allowed-origins", type=_names, default=["*"], help="CORS origins")
    p.add_argument("--allowed-methods", type=_names, default=["*"])
    p.add_argument("--allowed-headers", type=_names, default=["*"])
    p.add_argument("--allow-credentials", action="store_true")
    p.add_argument("--ssl-keyfile")
    p.add_argument("--ssl-certfile")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="log each request at DEBUG instead of INFO")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility: tool_choice auto always works")
    p.add_argument("--tool-call-parser", choices=["hermes"],
                   help="accepted for vLLM compatibility: calls are <tool_call>{json}</tool_call>")
    limits = p.add_argument_group("limits on one request")
    limits.add_argument("--max-queue", type=int, default=1024,
                        help="requests waiting for a first token before 503")
    limits.add_argument("--max-n", type=int, default=128)
    limits.add_argument("--max-body-bytes", type=int, default=4 * 2**20)
    limits.add_argument("--default-max-tokens", type=int,
                        help="chat requests without max_tokens (default: to the context's end)")
    limits.add_argument("--max-tokens-per-request", type=int, default=65536,
                        help="n x max_tokens x prompts")
    limits.add_argument("--request-timeout", type=float,
                        help="abort a generation request after this many seconds (default "
                        "600; 0: never)")
    limits.add_argument("--drain-timeout", type=float,
                        help="seconds in-flight requests get to finish after SIGTERM")


def _serve_aliases(args: argparse.Namespace) -> None:
    """Folds vLLM's spellings into jengine's: `serve MODEL` and `-tp N`."""
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and args.model != tag:
            raise ValueError(f"the model is given twice: {tag!r} and --model {args.model!r}")
        args.model = tag
    tp = getattr(args, "tensor_parallel_size", None)
    if tp is not None:
        if args.mesh != "tp=1":
            raise ValueError("give --tensor-parallel-size or --mesh, not both")
        if tp < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1, got {tp}")
        args.mesh = f"tp={tp}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jengine", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    engine = _engine_parent()

    gen = sub.add_parser("generate", parents=[engine], help="complete one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _sampling_flags(gen)

    chat = sub.add_parser("chat", parents=[engine], help="interactive chat on stdin")
    _sampling_flags(chat)

    info = sub.add_parser("info", help="describe a model without loading the engine")
    info.add_argument("model", nargs="?")

    conv = sub.add_parser("convert", help="HF dir or GGUF -> jengine (Orbax) checkpoint")
    conv.add_argument("src")
    conv.add_argument("out")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    conv.add_argument("--overwrite", action="store_true")

    sub.add_parser("compile", parents=[engine], help="compile every step bucket ahead of time")

    serve = sub.add_parser("serve", parents=[engine], help="OpenAI-compatible HTTP server")
    _serve_flags(serve)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    tp = bsub.add_parser("throughput", parents=[engine], help="offline engine throughput")
    tp.add_argument("--num-prompts", type=int, default=64)
    tp.add_argument("--input-len", type=int, default=100)
    tp.add_argument("--output-len", type=int, default=128)
    tp.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    tp.add_argument("--hf-baseline", nargs="+", choices=["float32", "bfloat16"], default=[],
                    help="also time HF transformers generate on the same prompts, in these "
                    "dtypes (needs torch)")
    tp.add_argument("--hf-batch-size", type=int, default=32)
    tp.add_argument("--hf-model", metavar="DIR",
                    help="the HF baseline's model (default: the engine's source; for a GGUF, "
                    "recent transformers keep the weights packed and run its dequantizing "
                    "kernels, so pass an HF directory of the same weights for a plain baseline)")
    tp.add_argument("--output-json")
    pc = bsub.add_parser("prefix-cache", parents=[engine],
                         help="shared system prompt and multi-turn chat, cache off vs on")
    pc.add_argument("--system-len", type=int, default=1000)
    pc.add_argument("--num-requests", type=int, default=32)
    pc.add_argument("--conversations", type=int, default=8)
    pc.add_argument("--turns", type=int, default=4)
    pc.add_argument("--output-len", type=int, default=32)
    pc.add_argument("--output-json")
    sv = bsub.add_parser("serve", help="load an OpenAI-compatible server (ours or a peer's)")
    sv.add_argument("--url", default="http://127.0.0.1:8000")
    sv.add_argument("--api-key")
    sv.add_argument("--served-model", help="model name to request (default: the first listed)")
    sv.add_argument("--concurrency", type=int, default=8)
    sv.add_argument("--num-prompts", type=int, default=32)
    sv.add_argument("--output-len", type=int, default=128)
    sv.add_argument("--output-json")
    return parser


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ENGINE_FLAGS if hasattr(args, k)}


def _make_engine(args: argparse.Namespace, *, warmup: bool = False):
    from jengine.engine import Engine

    kwargs = engine_kwargs(args)
    return Engine(kwargs.pop("model"), warmup=warmup, **kwargs)


def _sampling(args: argparse.Namespace):
    from jengine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    params = _sampling(args)  # validate before loading anything
    engine = _make_engine(args)
    prompt = args.prompt
    if args.chat:
        prompt = engine.render_chat([{"role": "user", "content": prompt}])
    first = None
    for delta in engine.stream(prompt, params):
        first = first or time.perf_counter()
        sys.stdout.write(delta.outputs[0].text if delta.outputs else "")
        sys.stdout.flush()
    sys.stdout.write("\n")
    for core in getattr(engine.core, "replicas", [engine.core]):
        print(f"jengine: first token {(first or start) - start:.1f}s after the engine began "
              f"({core.phase_summary()})", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling(args)
    engine = _make_engine(args)
    messages: list[dict] = []
    print("jengine chat: type a message, Ctrl-D to quit", file=sys.stderr)
    for line in sys.stdin:
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply = ""
        for delta in engine.stream(engine.render_chat(messages), params):
            text = delta.outputs[0].text if delta.outputs else ""
            reply += text
            sys.stdout.write(text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from converters.source import load_source

    loaded = load_source(args.model, progress=True)
    cfg = loaded.config
    info = {
        "source": loaded.source,
        "format": loaded.kind,
        "architecture": cfg.model_type,
        "family": cfg.family,
        "parameters": cfg.num_params,
        "dtype": str(next(iter(loaded.params.values())).dtype),
        "layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "heads": f"{cfg.num_heads} q / {cfg.num_kv_heads} kv, head_dim {cfg.head_dim}",
        "vocab_size": cfg.vocab_size,
        "context_length": cfg.max_position_embeddings,
        "sliding_window": cfg.sliding_window,
        "tied_embeddings": cfg.tie_word_embeddings,
        "chat_template": bool(getattr(loaded.tokenizer, "chat_template", None)),
    }
    for k, v in info.items():
        print(f"{k:16} {v}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from converters.checkpoint import save_checkpoint
    from converters.source import load_source

    start = time.perf_counter()
    loaded = load_source(args.src, dtype=args.dtype, progress=True)
    out = save_checkpoint(loaded, args.out, overwrite=args.overwrite)
    print(f"converted {loaded.source} -> {out} in {time.perf_counter() - start:.1f}s",
          file=sys.stderr)
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    from jengine.executables import ExecutableStore, default_store_dir

    start = time.perf_counter()
    engine = _make_engine(args, warmup=True)
    shapes = engine.core.runner.buckets.shapes()
    entries = ExecutableStore(default_store_dir()).entries()
    size = sum(p.stat().st_size for p in entries) / 2**20
    print(f"built {len(shapes)} step programs in {time.perf_counter() - start:.1f}s "
          f"(warm-up {engine.core.warmup_seconds:.1f}s); store: {default_store_dir()} holds "
          f"{len(entries)} programs, {size:.1f} MiB", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from jengine.server.app import serve

    return serve(args)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "serve":
        from jengine.bench_serve import run_serve_bench

        result = run_serve_bench(args)
    elif args.bench_command == "prefix-cache":
        from jengine.bench_prefix import run_prefix_bench

        result = run_prefix_bench(args)
    else:
        from jengine.bench import run_throughput

        result = run_throughput(args)
    print(json.dumps(result, indent=1))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


COMMANDS = {
    "generate": cmd_generate, "chat": cmd_chat, "info": cmd_info, "convert": cmd_convert,
    "compile": cmd_compile, "serve": cmd_serve, "bench": cmd_bench,
}


def _keep_stdout_for_output() -> None:
    """Native libraries (gloo's connection messages in multi-process runs) print to fd 1; point
    fd 1 at stderr and keep the real stdout for generated text only."""
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(real_stdout, "w", buffering=1)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "cpu_devices", None):
        import jax  # must be configured before the backend starts

        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    if getattr(args, "num_processes", 1) > 1:
        _keep_stdout_for_output()
    try:
        _serve_aliases(args)
        if getattr(args, "process_id", 0):
            _make_engine(args)  # a follower: runs process 0's steps until process 0 exits
            return 0
        return COMMANDS[args.command](args)
    except (ValueError, ModelLoadError, FileNotFoundError) as e:
        print(f"jengine: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
