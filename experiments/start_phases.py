"""Where a start's time goes, from this script's first line to the first generated token.

    python experiments/start_phases.py --config cpu           # Engine as `jengine generate` builds
    python experiments/start_phases.py --config cpu --warmup  # every bucket first, as `serve` does

Prints JSON: the import time, the engine's own start-up phases (`EngineCore.start_phases`, where
the tree has them), the time to the first token of a short greedy generation, and the sums of
JAX's compile events (tracing, lowering to MLIR, backend compile, which includes the persistent
cache's key hashing and read, and the cache read alone). Runs on trees without the executable
store too (then every program goes through JAX's events), so one script times before and after.
Set XDG_CACHE_HOME to keep the caches it fills apart from other work.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import collections  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402

EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "backend_compile",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read",
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="cpu")
    parser.add_argument("--warmup", action="store_true", help="build every bucket first")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    import jax

    seconds: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.Counter()

    def listener(event: str, duration: float, **kwargs) -> None:
        if event in EVENTS:
            seconds[EVENTS[event]] += duration
            counts[EVENTS[event]] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    from jengine import Engine, SamplingParams

    imported = time.perf_counter()
    kwargs = {"config": args.config, "progress": False}
    if "warmup" in inspect.signature(Engine).parameters:
        kwargs["warmup"] = args.warmup
    engine = Engine(**kwargs)
    built = time.perf_counter()
    first = None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    for _ in engine.stream("Hi", params):
        first = first or time.perf_counter()
    done = time.perf_counter()
    core = engine.core
    runner = core.runner
    print(json.dumps({
        "import_s": round(imported - T0, 2),
        "engine_s": round(built - imported, 2),
        "engine_phases_s": {k: round(v, 2) for k, v in getattr(core, "start_phases", {}).items()},
        "warmup_s": round(core.warmup_seconds, 2),
        "first_token_s": round(first - T0, 2),
        "total_s": round(done - T0, 2),
        "programs_loaded": getattr(runner, "programs_loaded", None),
        "programs_compiled": getattr(runner, "programs_compiled", None),
        "jax_events_s": {k: round(v, 2) for k, v in seconds.items()},
        "jax_events_n": dict(counts),
    }, indent=1))


if __name__ == "__main__":
    main()
