"""Prefix caching end to end on the real SmolLM2 (f32): greedy outputs with the cache on equal
those with it off over shared system prompts, multi-turn chats and random prompts; hits are
counted and reported; eviction under a tiny pool keeps outputs exact."""

from __future__ import annotations

import random

import pytest
from kv_pool import prefix_caching, small_kv_pool  # tests/kv_pool.py

from jengine import SamplingParams
from jengine.engine import build_config
from jengine.text.chat import render_chat

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SYSTEMS = [
    "You are a meticulous librarian. Answer every question with a short citation, name the "
    "shelf where the book lives, and never invent titles. " * 3,
    "You are a ship's navigator in the age of sail. Speak plainly, give bearings in degrees, "
    "and warn about weather before anything else. " * 3,
]
QUESTIONS = ["Where is the map room?", "What should I read about tides?",
             "Is a storm coming tonight?", "Which way is north?"]


def workload(engine) -> list[list[int]]:
    """Shared system prompts x questions, two-turn chats built on a greedy first reply, and
    random token prompts."""
    tok = engine.tokenizer
    prompts = [render_chat(tok, [{"role": "system", "content": s}, {"role": "user", "content": q}])
               for s in SYSTEMS for q in QUESTIONS]
    for q in QUESTIONS[:2]:
        first = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": q}]
        reply = engine.generate([render_chat(tok, first)], GREEDY)[0].outputs[0].text
        prompts.append(render_chat(tok, first + [{"role": "assistant", "content": reply},
                                              {"role": "user", "content": "Say more."}]))
    rng = random.Random(3)
    prompts += [[rng.randrange(100, 40_000) for _ in range(rng.randint(5, 60))] for _ in range(4)]
    return prompts


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def uncached(smol_engine):
    core = smol_engine.core
    with prefix_caching(core, False):
        prompts = workload(smol_engine)
        return prompts, token_ids(smol_engine.generate(prompts, GREEDY))


def test_greedy_outputs_equal_with_the_cache_on_and_off(smol_engine, uncached):
    prompts, expected = uncached
    core = smol_engine.core
    with prefix_caching(core, True) as cache:
        first = smol_engine.generate(prompts, GREEDY)  # all at once: shared prefixes in flight
        again = smol_engine.generate(prompts, GREEDY)  # everything cached but the last pages
        stats = smol_engine.stats()
        assert stats.prefix_cache_pages > 0 and cache.num_pages == stats.prefix_cache_pages
    assert token_ids(first) == expected
    assert token_ids(again) == expected
    ps = core.allocator.page_size
    for out, prompt in zip(again, prompts):
        assert out.num_cached_tokens == (len(prompt) - 1) // ps * ps
        assert out.usage.cached_tokens == out.num_cached_tokens
    assert stats.prefix_cache_hit_tokens > 0.5 * stats.prefix_cache_query_tokens
    assert stats.prefix_cache_queries == 2 * len(prompts)
    assert stats.kv_pages_used == 0  # cached pages are not "used": they are evictable


def test_system_prompt_pages_are_shared_not_copied(smol_engine, uncached):
    prompts, expected = uncached
    core = smol_engine.core
    with prefix_caching(core, True):
        smol_engine.generate(prompts[:1], GREEDY)
        outs = smol_engine.generate(prompts[1:4], GREEDY)  # the same system prompt
        assert core.allocator.num_used == core.prefix_cache.num_pages
    assert token_ids(outs) == expected[1:4]
    shared = min(len(p) for p in prompts[:4]) // 16 * 16 - 16
    assert all(o.num_cached_tokens >= shared for o in outs)


def test_eviction_and_preemption_under_a_tiny_pool_keep_outputs(smol_engine, uncached):
    """A 19-page pool forces cache eviction and preemption on the session engine: outputs stay
    the uncached ones and nothing but the cache holds pages afterwards."""
    prompts, expected = uncached
    core = smol_engine.core
    before = core.scheduler.num_preemptions
    with small_kv_pool(core, 20) as pool:  # 19 pages: a few requests' worth
        outs = smol_engine.generate(prompts, GREEDY)
        again = smol_engine.generate(prompts[::-1], GREEDY)
        stats = smol_engine.stats()
        assert pool.num_used == core.prefix_cache.num_pages  # nothing but the cache holds pages
    assert token_ids(outs) == expected
    assert token_ids(again) == expected[::-1]
    assert stats.prefix_cache_evicted_pages > 0 and stats.prefix_cache_hit_tokens > 0
    assert core.scheduler.num_preemptions > before


def test_prompt_logprobs_bypass_the_cache(smol_engine, uncached):
    prompts, _ = uncached
    core = smol_engine.core
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0)
    with prefix_caching(core, True):
        smol_engine.generate(prompts[:1], GREEDY)
        out = smol_engine.generate(prompts[:1], params)[0]
    assert out.num_cached_tokens == 0
    assert out.prompt_logprobs[0] is None
    assert all(entry is not None for entry in out.prompt_logprobs[1:])


def test_enable_prefix_caching_reaches_the_engine_config():
    assert build_config(None, None).cache.enable_prefix_caching is True
    for preset in (None, "test"):
        cfg = build_config(None, preset, enable_prefix_caching=False)
        assert cfg.cache.enable_prefix_caching is False
