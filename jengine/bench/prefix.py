"""`jengine bench prefix-cache`: the same workloads with the prefix cache off, then on, in one run.

Two scenarios, each timed on the offline engine (requests added at once, stepped to the end):

- *shared system prompt*: `--num-requests` chat requests that share a system prompt of about
  `--system-len` tokens and differ in their user message. Reports TTFT (median, p90) and the
  total time; with the cache, the system prompt is computed about once instead of per request.
- *multi-turn chat*: `--conversations` chats of `--turns` turns, each turn's prompt holding the
  earlier turns and the model's replies. Reports per turn the TTFT median and the hit rate (prompt
  tokens whose K/V came from the cache).

The two engines are built one after the other from the same flags but `enable_prefix_caching`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Any

from jengine.engine import Engine
from jengine.engine_flags import engine_kwargs
from jengine.sampling_params import SamplingParams
from jengine.text.chat import render_chat

_RULES = (
    "Greet the customer by name when it is known", "Never promise a delivery date",
    "Quote prices in the customer's currency", "Escalate refunds above fifty euros",
    "Summarise the order before confirming it", "Offer the loyalty discount once per order",
    "Answer in the language of the question", "Ask one clarifying question at most",
    "Keep replies under five sentences", "Point to the returns page for damaged goods",
)
_QUESTIONS = (
    "Where is my parcel?", "Can I change the delivery address?", "Do you ship to Norway?",
    "My mug arrived broken.", "How do I use my discount code?", "Is the blue kettle in stock?",
    "Can I pay by invoice?", "What is your returns window?",
)
_TOPICS = ("tide pools", "old maps", "bread baking", "bicycle repair", "star charts",
           "bee keeping", "glass blowing", "river ferries")


def system_prompt(tokenizer, num_tokens: int) -> str:
    """A support-desk system prompt of about `num_tokens` tokens."""
    lines, i = ["You are the support assistant of a small online shop. Follow these rules."], 0
    while len(tokenizer("\n".join(lines), add_special_tokens=False).input_ids) < num_tokens:
        lines.append(f"Rule {i + 1}: {_RULES[i % len(_RULES)]} (case {i // len(_RULES)}).")
        i += 1
    ids = tokenizer("\n".join(lines), add_special_tokens=False).input_ids[:num_tokens]
    return tokenizer.decode(ids)


def run_batch(engine, prompts: list[list[int]], output_len: int, tag: str) -> dict[str, Any]:
    """Adds every prompt at once and steps to the end; TTFT per request, cached tokens."""
    core = engine.core
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    states = [core.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
    while core.has_unfinished:
        core.step()
    seconds = time.perf_counter() - start
    ttft = sorted(s.first_token_time - s.arrival for s in states)
    prompt_tokens = sum(len(p) for p in prompts)
    cached = sum(s.num_cached_tokens for s in states)
    return {
        "requests": len(prompts), "prompt_tokens": prompt_tokens, "seconds": seconds,
        "ttft_median_s": statistics.median(ttft), "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
        "cached_tokens": cached, "hit_rate": cached / prompt_tokens,
        "replies": [engine.tokenizer.decode(s.samples[0].seq.output_ids) for s in states],
    }


def shared_system(engine, args: argparse.Namespace) -> dict[str, Any]:
    tok = engine.tokenizer
    system = system_prompt(tok, args.system_len)
    prompts = [render_chat(tok, [{"role": "system", "content": system},
                              {"role": "user", "content": f"{_QUESTIONS[i % len(_QUESTIONS)]} "
                                                          f"(ticket {i})"}])
               for i in range(args.num_requests)]
    result = run_batch(engine, prompts, args.output_len, "system")
    result.pop("replies")
    return result


def multi_turn(engine, args: argparse.Namespace) -> list[dict[str, Any]]:
    tok = engine.tokenizer
    chats = [[{"role": "user", "content": f"Tell me something about {_TOPICS[c % len(_TOPICS)]}."}]
             for c in range(args.conversations)]
    turns = []
    for turn in range(args.turns):
        prompts = [render_chat(tok, chat) for chat in chats]
        result = run_batch(engine, prompts, args.output_len, f"turn{turn}")
        for chat, reply in zip(chats, result.pop("replies")):
            chat += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": "Go on, and give one more example."}]
        turns.append({"turn": turn + 1, **result})
    return turns


def run_prefix_bench(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = engine_kwargs(args)
    model = kwargs.pop("model")
    result: dict[str, Any] = {}
    for caching in (False, True):
        kwargs["enable_prefix_caching"] = caching
        engine = Engine(model, warmup=True, **kwargs)
        name = "cache_on" if caching else "cache_off"
        print(f"bench: prefix cache {'on' if caching else 'off'}", file=sys.stderr)
        result[name] = {"shared_system_prompt": shared_system(engine, args),
                        "multi_turn": multi_turn(engine, args)}
        stats = engine.stats()
        result[name]["stats"] = {"hit_rate": stats.prefix_cache_hit_rate,
                                 "evicted_pages": stats.prefix_cache_evicted_pages,
                                 "cached_pages": stats.prefix_cache_pages,
                                 "duplicate_pages": stats.prefix_cache_duplicate_pages,
                                 "recompiles": stats.compiles_since_ready}
        del engine
        gc.collect()
    off, on = (result[k]["shared_system_prompt"] for k in ("cache_off", "cache_on"))
    result["shared_system_prompt_ttft_speedup"] = off["ttft_median_s"] / on["ttft_median_s"]
    result["shared_system_prompt_time_speedup"] = off["seconds"] / on["seconds"]
    result["multi_turn_ttft_speedup"] = [
        a["ttft_median_s"] / b["ttft_median_s"]
        for a, b in zip(result["cache_off"]["multi_turn"], result["cache_on"]["multi_turn"])
    ]
    return result
