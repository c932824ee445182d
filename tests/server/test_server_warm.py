"""A server is warm when `/health` turns 200: its start-up requests have run through the request
path and left nothing behind, and it builds no step program afterwards, whatever a request asks
for: every public sampling and output feature, alone and mixed in one batch, runs on the
programs `serve` built before it was ready (conftest's shared `server`, `--config test`).
A start-up request that fails stops the start (in-process, over the fake runner)."""

from __future__ import annotations

import asyncio
import datetime
import threading

import httpx
from fake_runner import fake_async_engine
from local_server import free_port, serving
from serve_process import MODEL  # tests/serve_process.py

from jengine.config import ServerConfig
from jengine.server.app import create_app

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"]}}}
CHAT = [{"role": "user", "content": "Tell me about a person."}]
# Each one a public feature (or a mix), as the OpenAI SDK sends it.
COMPLETIONS = [
    dict(prompt="Counting: one two", max_tokens=4, logprobs=5),
    dict(prompt="Counting: one two", max_tokens=4, echo=True, logprobs=2),  # prompt logprobs
    dict(prompt="Counting: one two", max_tokens=4, echo=True, logprobs=0, presence_penalty=0.5),
    dict(prompt="The sky is", max_tokens=6, frequency_penalty=1.0, presence_penalty=0.3),
    dict(prompt="The sky is", max_tokens=6, logit_bias={"13": -100, "42": 5}),
    dict(prompt="The sky is", max_tokens=6, n=3, temperature=0.8, seed=3),
    dict(prompt="The sky is", max_tokens=6, stop=[" blue", "."], temperature=0),
    dict(prompt="The sky is", max_tokens=6, top_p=0.5, extra_body={
        "min_tokens": 4, "repetition_penalty": 1.2, "top_k": 5, "min_p": 0.1}),
    dict(prompt="The sky is", max_tokens=6, extra_body={"bad_words": [" blue"]}),
    dict(prompt="The sky is", max_tokens=3, extra_body={"allowed_token_ids": [13, 42, 100]}),
    dict(prompt="The sky is", max_tokens=3, extra_body={"prompt_logprobs": 3}),
]
CHATS = [
    dict(messages=CHAT, max_tokens=40, response_format=SCHEMA),
    dict(messages=CHAT, max_tokens=40, response_format={"type": "json_object"}),
    dict(messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=30,
         tools=[WEATHER], tool_choice="required"),
    dict(messages=CHAT, max_tokens=8, logprobs=True, top_logprobs=20, stream=True),
    dict(messages=CHAT, max_tokens=8, n=2, extra_body={"guided_regex": "[a-z]{3,6}"}),
]


def _count(server) -> float:
    return server.metrics()["jengine_compiles_after_ready_total"]


async def _send_all(server) -> None:
    client = server.async_client()

    async def completion(kwargs):
        return await client.completions.create(model=MODEL, **kwargs)

    async def chat(kwargs):
        out = await client.chat.completions.create(model=MODEL, **kwargs)
        if kwargs.get("stream"):
            return [chunk async for chunk in out]
        return out

    # Mixed into shared batches: every request in flight at once.
    await asyncio.gather(*(completion(k) for k in COMPLETIONS), *(chat(k) for k in CHATS))
    await client.close()


def test_no_step_program_is_built_after_ready(server):
    """Every request feature the warm-up claims to cover (logprobs, penalties, structured
    output, n > 1, streaming, prompt logprobs...) compiles nothing once /health said ready: the
    promise "a compile while serving is a bug" checked on the session server."""
    assert _count(server) == 0
    client = server.client()
    for kwargs in COMPLETIONS:  # each feature alone in its batch
        client.completions.create(model=MODEL, **kwargs)
    for kwargs in CHATS:
        out = client.chat.completions.create(model=MODEL, **kwargs)
        if kwargs.get("stream"):
            list(out)
    asyncio.run(_send_all(server))
    assert _count(server) == 0


def _logged_at(log: str, text: str) -> float:
    """The time (epoch seconds) of the server's first log line that contains `text`."""
    line = next(line for line in log.splitlines() if text in line)
    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


def test_start_up_requests_ran_before_ready_and_left_nothing(server):
    log = server.log.read_text()
    # A streamed chat completion and a completion, through the socket, all the way...
    assert "warmup-chat POST /v1/chat/completions 200" in log
    assert "warmup-completion POST /v1/completions 200" in log
    assert "request warmup-chat-0 done: finish=length" in log
    # ... before /health answered 200 (and it said "loading" until then).
    assert _logged_at(log, "start-up requests served in") <= server.ready_at
    assert (503, {"status": "loading"}) in server.health_seen
    # At ready, the served metrics show no trace of them.
    m = server.metrics_at_ready
    assert not [k for k in m if k.startswith("jengine_requests_total")]
    for name in ("jengine_time_to_first_token_seconds_count", "jengine_e2e_request_latency"
                 "_seconds_count", "jengine_prompt_tokens_total", "jengine_generation_tokens_total",
                 "jengine_num_requests_queued", "jengine_num_requests_running",
                 "jengine_num_requests_waiting", "jengine_kv_pages_used",
                 "jengine_prefix_cache_pages", "jengine_prefix_cache_queries_total",
                 "jengine_prefix_cache_hit_tokens_total", "jengine_compiles_after_ready_total"):
        assert m[name] == 0, name


def test_a_failed_start_up_request_stops_the_start():
    failing = "{{ raise_exception('no chat today') }}"  # renders only at request time
    app = create_app(config=ServerConfig(chat_template=failing), load_engine=fake_async_engine)
    state = app.state.server
    stopped = threading.Event()
    state.on_load_error = stopped.set  # `serve` stops uvicorn here
    port = free_port()
    state.warmup_url = f"http://127.0.0.1:{port}"
    with serving(app, port) as url:
        assert stopped.wait(120)
        r = httpx.get(url + "/health", timeout=30)
    assert r.status_code == 503 and r.json()["status"] == "failed"
    error = r.json()["error"]
    assert "start-up request /v1/chat/completions failed: HTTP 400" in error
    assert "no chat today" in error
    assert state.engine is None
