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
from jengine.cli.info import cmd_info
from jengine.engine_flags import engine_parent, make_engine


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
    """`jengine serve`'s own flags; the names are vLLM's where vLLM has the same thing. Their
    defaults are None (not given): the preset's `server` section, else `ServerConfig`, decides."""
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="the model, as --model (vLLM's `serve MODEL`)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, metavar="N",
                   help="the same as --mesh tp=N")
    p.add_argument("--seed", type=int, help="seed of the requests that set none")
    p.add_argument("--host", help="default 127.0.0.1")
    p.add_argument("--port", type=int, help="default 8000")
    p.add_argument("--api-key")
    p.add_argument("--grpc-port", type=int)
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="names the model answers to; the first is the one reported")
    p.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                   help="with --enable-lora: PEFT LoRA adapters served as models NAME")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    p.add_argument("--chat-template", help="a Jinja chat template (its text, or a file)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests send their own chat_template")
    p.add_argument("--root-path", help="the path prefix behind a proxy")
    p.add_argument("--allowed-origins", type=_names, help="CORS origins (default all)")
    p.add_argument("--allowed-methods", type=_names, help="default all")
    p.add_argument("--allowed-headers", type=_names, help="default all")
    p.add_argument("--allow-credentials", action="store_true")
    p.add_argument("--ssl-keyfile")
    p.add_argument("--ssl-certfile")
    p.add_argument("--require-warm", action="store_true",
                   help="exit with an error instead of compiling a step program that "
                   "`jengine compile` (same flags) has not stored")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="log each request at DEBUG instead of INFO")
    p.add_argument("--uvicorn-log-level",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility: tool_choice auto always works")
    p.add_argument("--tool-call-parser", help="hermes | llama3_json | mistral | pythonic | "
                   "qwen3_coder | deepseek_v3 | auto (the model's call format)")
    p.add_argument("--reasoning-parser", help="deepseek_r1 | qwen3 | granite | auto")
    p.add_argument("--batch-dir", help="where /v1/files and /v1/batches keep their files and "
                   "store, across restarts (default ~/.cache/jengine/batches)")
    p.add_argument("--web-ui", action=argparse.BooleanOptionalAction,
                   help="the chat page at / (default on; --no-web-ui: / is a 404)")
    media = p.add_argument_group("image inputs (vision models)")
    media.add_argument("--allowed-local-media-path", metavar="DIR",
                       help="file: image URLs may read files under DIR (default: none)")
    media.add_argument("--allow-remote-media", action="store_true", default=None,
                       help="fetch http(s) image URLs (default off)")
    media.add_argument("--max-image-bytes", type=int, help="default 20 MiB")
    media.add_argument("--media-fetch-timeout", type=float, metavar="S",
                       help="seconds for one remote image (default 10)")
    limits = p.add_argument_group("limits on one request")
    limits.add_argument("--max-queue", type=int,
                        help="requests waiting for a first token before 503 (default 1024)")
    limits.add_argument("--max-n", type=int, help="default 128")
    limits.add_argument("--max-body-bytes", type=int, help="default 4 MiB")
    limits.add_argument("--default-max-tokens", type=int,
                        help="chat requests without max_tokens (default: to the context's end)")
    limits.add_argument("--max-tokens-per-request", type=int,
                        help="n x max_tokens x prompts (default 65536)")
    limits.add_argument("--request-timeout", type=float,
                        help="abort a generation request after this many seconds (default "
                        "600; 0: never)")
    limits.add_argument("--limit-concurrency", type=int, metavar="N",
                        help="open connections; a request on one past N gets 503 (default "
                        "2048; 0: no bound)")
    limits.add_argument("--timeout-keep-alive", type=float, metavar="S",
                        help="close a connection without a whole request header S seconds "
                        "after it opened or its last response ended (default 5)")
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
        if args.mesh is not None:
            raise ValueError("give --tensor-parallel-size or --mesh, not both")
        if tp < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1, got {tp}")
        args.mesh = f"tp={tp}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jengine", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    engine = engine_parent()

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
    conv.add_argument("--quantization", default="none", choices=["none", "int8", "w8a16"],
                      help="store the projections as int8 + per-channel scales (~1/4 of f32); "
                      "engines then load them as stored")
    conv.add_argument("--quantize-lm-head", action="store_true",
                      help="with --quantization: the lm_head too")
    conv.add_argument("--smoothing-alpha", type=float, default=None,
                      help="with --quantization int8: SmoothQuant migration strength folded "
                      "into the weights before quantizing (0: none; default: "
                      "model.smoothing_alpha's)")

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
    sv.add_argument("--served-model", nargs="+", metavar="NAME",
                    help="model name(s) to request, prompt i the (i mod n)th (default: the "
                         "first listed); several spread a run over LoRA adapters")
    sv.add_argument("--concurrency", type=int, default=8)
    sv.add_argument("--num-prompts", type=int, default=32)
    sv.add_argument("--output-len", type=int, default=128)
    sv.add_argument("--temperature", type=float, default=0.0, help="of every request (0: greedy)")
    sv.add_argument("--output-json")
    sk = bsub.add_parser("soak", help="hold a local server under mixed load; sample its RSS and "
                         "KV pages, check it returns to idle")
    sk.add_argument("--url", default="http://127.0.0.1:8000", help="a loopback URL only")
    sk.add_argument("--api-key")
    sk.add_argument("--served-model", help="model name to request (default: the first listed)")
    sk.add_argument("--pid", type=int, help="the server's process id, whose RSS is sampled")
    sk.add_argument("--start", action="store_true",
                    help="start `jengine serve` on 127.0.0.1 at the --url's port, stop it after")
    sk.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="with --start: one more argument for `jengine serve` (repeatable)")
    sk.add_argument("--duration", type=float, default=3600.0, help="seconds of load")
    sk.add_argument("--concurrency", type=int, default=16)
    sk.add_argument("--interval", type=float, default=30.0, help="seconds between samples")
    sk.add_argument("--max-requests", type=int, default=1_000_000,
                    help="stop starting requests after this many")
    sk.add_argument("--request-timeout", type=float, default=300.0)
    sk.add_argument("--csv", help="write the samples here")
    sk.add_argument("--output-json")
    return parser


def _sampling(args: argparse.Namespace):
    from jengine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    params = _sampling(args)  # validate before loading anything
    engine = make_engine(args)
    prompt = args.prompt
    if args.chat:
        prompt = engine.render_chat([{"role": "user", "content": prompt}])
    first = None
    for delta in engine.stream(prompt, params):
        first = first or time.perf_counter()
        sys.stdout.write(delta.outputs[0].text if delta.outputs else "")
        sys.stdout.flush()
    sys.stdout.write("\n")
    for core in engine.core.replicas:
        print(f"jengine: first token {(first or start) - start:.1f}s after the engine began "
              f"({core.phase_summary()})", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling(args)
    engine = make_engine(args)
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


def cmd_convert(args: argparse.Namespace) -> int:
    from converters.checkpoint import save_checkpoint
    from converters.source import load_source

    start = time.perf_counter()
    loaded = load_source(args.src, dtype=args.dtype, progress=True,  # Q8_0 read as int8
                         quantization=args.quantization, quantize_lm_head=args.quantize_lm_head)
    out = save_checkpoint(loaded, args.out, overwrite=args.overwrite,
                          quantization=args.quantization,
                          quantize_lm_head=args.quantize_lm_head,
                          smoothing_alpha=args.smoothing_alpha)
    print(f"converted {loaded.source} -> {out} in {time.perf_counter() - start:.1f}s",
          file=sys.stderr)
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    engine = make_engine(args, warmup=True)
    reports = engine.core.program_reports()
    for report in reports:
        sizes = [n for key, n in zip(report.keys, report.stored_bytes, strict=True)
                 if key is not None]
        stored = [n for n in sizes if n is not None]
        unstored = len(sizes) - len(stored)
        print(f"serve will load {len(stored)} step programs, {sum(stored) / 2**20:.1f} MiB "
              f"({report.compiled} compiled now, {report.loaded} stored "
              "before)" + (f"; {unstored} could not be stored and will compile at every start"
                           if unstored else ""), file=sys.stderr)
    last = reports[-1]
    held = (f"{last.store} holds {last.store_files} programs, "
            f"{last.store_bytes / 2**20:.1f} MiB in all" if last.store is not None
            else "multi-process runs keep no store")
    print(f"done in {time.perf_counter() - start:.1f}s (warm-up "
          f"{engine.core.warmup_seconds:.1f}s); {held}", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from jengine.cli.serve import cmd_serve as run

    return run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "soak":
        from jengine.bench.soak import run_soak

        result = run_soak(args)
    elif args.bench_command == "serve":
        from jengine.bench.serve import run_serve_bench

        result = run_serve_bench(args)
    elif args.bench_command == "prefix-cache":
        from jengine.bench.prefix import run_prefix_bench

        result = run_prefix_bench(args)
    else:
        from jengine.bench.throughput import run_throughput

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
    if (getattr(args, "num_processes", None) or 1) > 1:
        _keep_stdout_for_output()
    try:
        _serve_aliases(args)
        if getattr(args, "process_id", 0):
            make_engine(args)  # a follower: runs process 0's steps until process 0 exits
            return 0
        return COMMANDS[args.command](args)
    except (ValueError, ModelLoadError, FileNotFoundError) as e:
        print(f"jengine: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
