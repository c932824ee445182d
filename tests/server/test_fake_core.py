"""The real engine core, `AsyncEngine` and OpenAI server over a runner with predictable
arithmetic (tests/fake_runner.py): no model, no compile, so the orchestration is checked exactly
and in seconds. Every output must equal what its prompt and seed generate alone, however the
server interleaves, batches or cuts the requests; the real model adds nothing to that."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
from fake_runner import expected_ids, fake_async_engine
from local_server import serving

from jengine.async_engine import AsyncEngine
from jengine.config import ServerConfig
from jengine.server.app import create_app

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def fake_engine():
    engine = fake_async_engine()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def url(fake_engine):
    with serving(create_app(fake_engine, ServerConfig())) as base:
        yield base


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _ids(engine: AsyncEngine, prompt: str) -> list[int]:
    return engine.core.encode_prompt(prompt)[1]


def _wait_idle(engine: AsyncEngine) -> None:
    deadline = time.monotonic() + 30
    while (s := engine.stats()).num_requests_running or s.kv_pages_used:
        assert time.monotonic() < deadline, f"left behind: {s}"
        time.sleep(0.02)


def test_completions_are_what_each_prompt_and_seed_generate(fake_engine, url):
    client, tok = _client(url), fake_engine.tokenizer
    for prompt, seed, n in [("The capital of France is", 7, 12), ("Hi", 1, 3)]:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, seed=seed,
                                      temperature=0, extra_body={"ignore_eos": True})
        want = expected_ids(_ids(fake_engine, prompt), seed, n)
        assert r.choices[0].text == tok.decode(want)
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == n
    _wait_idle(fake_engine)


def test_32_concurrent_streams_each_get_their_own_tokens(fake_engine, url):
    """Continuous batching, chunked prefill and async scheduling under the real server: each
    stream's text is what its prompt and seed make alone."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    prompts = [f"Request number {i} says" + " more" * (i % 7) for i in range(32)]

    async def one(i: int) -> str:
        stream = await client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=5 + i % 9, seed=100 + i,
            temperature=0.8, stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run() -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(32)))

    texts = asyncio.run(run())
    tok = fake_engine.tokenizer
    for i, text in enumerate(texts):
        want = expected_ids(_ids(fake_engine, prompts[i]), 100 + i, 5 + i % 9)
        assert text == tok.decode(want), i
    assert fake_engine.core.runner.steps < sum(5 + i % 9 for i in range(32))  # it batched
    _wait_idle(fake_engine)


def test_n_samples_and_a_stop_string(fake_engine, url):
    client, tok = _client(url), fake_engine.tokenizer
    ids = _ids(fake_engine, "Count:")
    r = client.completions.create(model=MODEL, prompt="Count:", max_tokens=6, n=3, seed=40,
                                  extra_body={"ignore_eos": True})
    texts = sorted((c.index, c.text) for c in r.choices)
    assert [t for _, t in texts] == [tok.decode(expected_ids(ids, 40 + i, 6)) for i in range(3)]
    # A stop string ends the text before it, with finish_reason "stop".
    full = tok.decode(expected_ids(ids, 40, 6))
    stop = full[len(full) // 2:][:3]
    cut = client.completions.create(model=MODEL, prompt="Count:", max_tokens=6, seed=40,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    _wait_idle(fake_engine)
