"""`jengine bench serve --url URL`: load any OpenAI-compatible server (ours or a peer's) with
streaming chat requests at fixed concurrency, and report aggregate output tok/s, TTFT and TPOT.

Every request asks for exactly `--output-len` tokens (`ignore_eos` and `min_tokens` are sent as
vLLM-style extras, which jengine and vLLM both honour), so servers do the same work. Several
`--served-model` names spread the prompts round-robin over them (LoRA adapters served as models:
a multi-adapter batch).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any


def bench_prompt(i: int) -> str:
    """The bench's `i`th prompt (46 tokens in SmolLM2's chat template)."""
    return f"Request {i}: write a long, detailed essay about the history of science."


async def timed_request(client, model: str, prompt: str, output_len: int,
                        temperature: float) -> dict[str, float]:
    """One streaming chat request as the bench sends it; its TTFT and TPOT (seconds) and the
    tokens it got."""
    start = time.perf_counter()
    first = None
    tokens = 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=output_len,
        temperature=temperature, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "min_tokens": output_len},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    first = first or end
    return {"ttft": first - start, "tpot": (end - first) / max(1, tokens - 1), "tokens": tokens}


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    try:
        from openai import AsyncOpenAI
    except ImportError as e:
        raise ValueError("bench serve needs the openai package: pip install openai") from e

    client = AsyncOpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key or "none",
                         timeout=3600)
    names = args.served_model or [(await client.models.list()).data[0].id]
    if isinstance(names, str):
        names = [names]
    prompts = [(names[i % len(names)], bench_prompt(i)) for i in range(args.num_prompts)]
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[dict[str, float]] = []

    async def worker() -> None:
        while not queue.empty():
            model, prompt = queue.get_nowait()
            results.append(await timed_request(client, model, prompt, args.output_len,
                                               args.temperature))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    elapsed = time.perf_counter() - start
    total = sum(r["tokens"] for r in results)
    return {
        "url": args.url, "model": names[0] if len(names) == 1 else names,
        "concurrency": args.concurrency,
        "temperature": args.temperature,
        "requests": len(results), "output_tokens": total, "seconds": elapsed,
        "output_tok_per_s": total / elapsed,
        "ttft_median_s": statistics.median(r["ttft"] for r in results),
        "tpot_median_s": statistics.median(r["tpot"] for r in results),
    }


def run_serve_bench(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_run(args))
