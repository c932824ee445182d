"""The session's `jengine serve` under load: 32 concurrent streams, 100 disconnecting clients
(every KV page freed), metrics, cached-prefix reporting; then SIGTERM, which stops the server
after every other user of it (conftest orders `stops_server` tests last)."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest
from serve_process import KEY, MODEL  # tests/serve_process.py

# -- load: concurrency, disconnects, metrics ----------------------------------------------------

PROMPTS = [f"Write one sentence about {topic}." for topic in (
    "rivers", "mountains", "owls", "bread", "trains", "the moon", "glass", "chess")]


def test_32_concurrent_streams_complete_correctly(server):
    params = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    # the reference: one non-streamed batch (greedy outputs do not depend on the batch)
    batch = server.client().completions.create(model=MODEL, prompt=PROMPTS, **params)
    expected = {p: c.text for p, c in zip(PROMPTS, batch.choices)}

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[str, list, int]:
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, stream=True, stream_options={"include_usage": True},
            **params)
        text, finishes, usage = "", [], None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                if c.finish_reason:
                    finishes.append(c.finish_reason)
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, finishes, usage

    async def all_of_them():
        async with server.async_client() as aclient:
            return await asyncio.gather(*(one(aclient, PROMPTS[i % 8]) for i in range(32)))

    results = asyncio.run(all_of_them())
    for i, (text, finishes, usage) in enumerate(results):
        assert finishes == ["length"] and usage == 12
        assert text == expected[PROMPTS[i % 8]]


def test_100_disconnecting_clients_free_every_kv_page(server):
    before = server.metrics()

    async def hang_up_streaming(client: httpx.AsyncClient, i: int) -> bool:
        body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return True  # leaving the block closes the connection mid-stream
        return False

    async def hang_up_waiting(client: httpx.AsyncClient, i: int) -> bool:
        body = {"model": MODEL, "prompt": f"Essay {i}:", "max_tokens": 400, "ignore_eos": True}
        try:
            await client.post("/v1/completions", json=body, timeout=1.0)
        except httpx.TimeoutException:
            return True
        return False

    async def run():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=300,
                                     headers={"Authorization": f"Bearer {KEY}"}) as client:
            jobs = [hang_up_streaming(client, i) for i in range(80)]
            jobs += [hang_up_waiting(client, i) for i in range(20)]
            return await asyncio.gather(*jobs)

    assert all(asyncio.run(run()))
    deadline = time.monotonic() + 60
    while True:
        m = server.metrics()
        idle = (m["jengine_kv_pages_used"] == 0 and m["jengine_num_requests_running"] == 0
                and m["jengine_num_requests_waiting"] == 0
                and m["jengine_num_requests_queued"] == 0)
        if idle:
            break
        assert time.monotonic() < deadline, f"pages still in use: {m}"
        time.sleep(0.2)
    aborted = m["jengine_requests_total{finish_reason=abort}"] - before.get(
        "jengine_requests_total{finish_reason=abort}", 0)
    assert aborted == 100
    r = server.client().completions.create(model=MODEL, prompt="Still there?", max_tokens=3,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_metrics_parse_and_move(server):
    before = server.metrics()
    for name in ("jengine_num_requests_running", "jengine_num_requests_waiting",
                 "jengine_kv_pages_used", "jengine_kv_pages_total", "jengine_compiles_since_ready",
                 "jengine_compiles_after_ready_total",
                 "jengine_time_to_first_token_seconds_count",
                 "jengine_inter_token_latency_seconds_count", "jengine_prompt_tokens_total",
                 "jengine_generation_tokens_total", "jengine_spec_decode_num_drafts_total",
                 "jengine_spec_decode_num_draft_tokens_total",
                 "jengine_spec_decode_num_accepted_tokens_total",
                 "jengine_spec_decode_acceptance_rate"):
        assert name in before, name
    assert before["jengine_kv_pages_total"] > 0
    r = server.client().completions.create(model=MODEL, prompt="One two three", max_tokens=5,
                                           extra_body={"ignore_eos": True})
    after = server.metrics()

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0)

    assert moved("jengine_prompt_tokens_total") == r.usage.prompt_tokens
    assert moved("jengine_generation_tokens_total") == 5
    assert moved("jengine_time_to_first_token_seconds_count") == 1
    assert moved("jengine_inter_token_latency_seconds_count") == 4
    assert moved("jengine_requests_total{finish_reason=length}") == 1
    assert moved("jengine_e2e_request_latency_seconds_count") == 1
    assert moved("jengine_compiles_after_ready_total") == 0  # warm-up built the base programs


def test_repeated_prefix_reports_cached_tokens_and_metrics(server):
    """The second chat with the same long system prompt reuses its pages: the SDK sees
    `prompt_tokens_details.cached_tokens`, and /metrics counts the hit tokens."""
    client = server.client()
    system = "You answer in one short sentence and never use lists. " * 8
    before = server.metrics()
    usages = []
    for question in ("What is rain?", "What is snow?"):
        r = client.chat.completions.create(
            model=MODEL, max_tokens=3, temperature=0,
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": question}])
        usages.append(r.usage)
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    cached = usages[1].prompt_tokens_details.cached_tokens
    assert 64 <= cached < usages[1].prompt_tokens and cached % 16 == 0
    after = server.metrics()
    for name in ("jengine_prefix_cache_hit_rate", "jengine_prefix_cache_pages"):
        assert name in after, name
    assert after["jengine_prefix_cache_queries_total"] - before[
        "jengine_prefix_cache_queries_total"] == 2
    assert after["jengine_prefix_cache_hit_tokens_total"] - before[
        "jengine_prefix_cache_hit_tokens_total"] == cached
    assert after["jengine_prefix_cache_query_tokens_total"] > before[
        "jengine_prefix_cache_query_tokens_total"]
    assert "jengine_prefix_cache_evicted_pages_total" in after
    assert "jengine_prefix_cache_duplicate_pages_total" in after


# -- shutdown (conftest runs it after every other user of the server: it stops it) ---------------

@pytest.mark.stops_server
def test_sigterm_lets_the_stream_finish_then_exits(server):
    # short enough to finish within the 30 s drain bound even on a busy CPU
    body = {"model": MODEL, "prompt": "Tell me a long story:", "max_tokens": 30,
            "ignore_eos": True, "stream": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}"}
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers,
                      timeout=120) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line)
                break
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        try:  # admission is closed: refused at the socket, or 503 on a kept-alive connection
            late = httpx.post(server.url + "/v1/completions", headers=headers, timeout=10,
                              json={"model": MODEL, "prompt": "late", "max_tokens": 2})
            assert late.status_code == 503
        except httpx.TransportError:
            pass
        after_signal = [line for line in lines if line.startswith("data: ")]
    assert len(after_signal) > 2 and after_signal[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events + after_signal[:-1]]
    assert sum(len(p["choices"][0]["text"]) for p in payloads) > 30
    assert [p["choices"][0]["finish_reason"] for p in payloads][-1] == "length"
    assert server.proc.wait(timeout=60) == 0
    assert "draining" in server.log.read_text()
