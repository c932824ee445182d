"""The server under pressure and failure, in-process (uvicorn in a thread over a real AsyncEngine
that runs one sequence at a time): queue-full 503 + Retry-After, request timeouts, and a real
engine failure (a parameter buffer deleted under the running engine) giving errors, not hangs.

The last test kills the module's engine.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import jax
import pytest
from local_server import serving
from prometheus_client.parser import text_string_to_metric_families

from jengine.async_engine import AsyncEngine
from jengine.config import ServerConfig
from jengine.server.app import create_app

MODEL = "SmolLM2-135M-Instruct"
LONG = {"model": MODEL, "prompt": "Tell me a very long story:", "max_tokens": 400,
        "ignore_eos": True}


class Local:
    def __init__(self, app, engine: AsyncEngine, url: str):
        self.app = app
        self.engine = engine
        self.url = url

    @property
    def state(self):
        return self.app.state.server

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        values = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                values[s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))] = (
                    s.value)
        return values

    def wait_for(self, name: str, value: float, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.metrics().get(name) != value:
            assert time.monotonic() < deadline, f"{name} never reached {value}: {self.metrics()}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def local():
    engine = AsyncEngine(config="test", progress=False, max_num_seqs=1)
    app = create_app(engine, ServerConfig(max_queue=1))
    with serving(app) as url:
        yield Local(app, engine, url)
    engine.shutdown()


def assert_error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    return err


class Background:
    """An HTTP request running in a thread, so the test can act while it waits."""

    def __init__(self, url: str, body: dict):
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            self.response = httpx.post(url, json=body, timeout=120)
        except BaseException as e:  # noqa: BLE001 - reported by result()
            self.error = e

    def result(self, timeout: float = 120) -> httpx.Response:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the request hung"
        assert self.error is None, self.error
        return self.response


def first_event(lines) -> str:
    for line in lines:
        if line.startswith("data: "):
            return line
    raise AssertionError("stream ended before any event")


def test_queue_full_is_503_with_retry_after(local):
    rejected = local.metrics().get("jengine_requests_rejected_total{reason=queue_full}", 0)
    with httpx.stream("POST", local.url + "/v1/completions", json={**LONG, "stream": True},
                      timeout=120) as running:
        lines = running.iter_lines()  # keep it: a dropped line iterator closes the connection
        first_event(lines)  # the one sequence slot is taken
        queued = Background(local.url + "/v1/completions",
                            {"model": MODEL, "prompt": "Hi", "max_tokens": 3})
        local.wait_for("jengine_num_requests_queued", 1)
        local.wait_for("jengine_num_requests_waiting", 1)
        r = httpx.post(local.url + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "One more", "max_tokens": 3})
        err = assert_error(r, 503, "queue_full")
        assert err["type"] == "server_error"
        assert int(r.headers["retry-after"]) >= 1
        chat = httpx.post(local.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert_error(chat, 503, "queue_full")
        assert queued.thread.is_alive()
    # closing the running stream frees the slot: the queued request now completes
    done = queued.result()
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3
    after = local.metrics()
    assert after["jengine_requests_rejected_total{reason=queue_full}"] - rejected == 2
    local.wait_for("jengine_kv_pages_used", 0)
    local.wait_for("jengine_num_requests_queued", 0)


def test_a_simultaneous_burst_cannot_pass_the_queue_limit(local):
    """30 requests sent at once while the one sequence slot is busy: the queue (max_queue 1)
    takes exactly one, the other 29 get 503 + Retry-After, though all of them were checked
    before any had finished tokenizing or compiling its grammar. Every slot comes back: after
    the burst, and after requests that fail between admission and their first token."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    completion = {"model": MODEL, "prompt": "Hi", "max_tokens": 3}
    bodies = [("/v1/chat/completions", chat), ("/v1/completions", completion),
              ("/v1/completions", {**completion, "structured_outputs": {"regex": "[ab]{3}"}})]

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=local.url, timeout=120, limits=limits) as client:
            async with client.stream("POST", "/v1/completions",
                                     json={**LONG, "stream": True}) as running:
                lines = running.aiter_lines()
                async for line in lines:  # the one sequence slot is taken
                    if line.startswith("data: "):
                        break
                tasks = [asyncio.create_task(client.post(*bodies[i % 3][:1],
                                                         json=bodies[i % 3][1]))
                         for i in range(30)]
                pending = set(tasks)
                while len(pending) > 1:
                    done, pending = await asyncio.wait(pending, timeout=60,
                                                       return_when=asyncio.FIRST_COMPLETED)
                    assert done, "the burst hung"
                await asyncio.to_thread(local.wait_for, "jengine_num_requests_queued", 1)
            # the running stream closed: the admitted request runs now
            await asyncio.wait(pending, timeout=120)
            return [t.result() for t in tasks]

    responses = asyncio.run(burst())
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert len(ok) == 1, [r.status_code for r in responses]
    for r in refused:
        assert_error(r, 503, "queue_full")
        assert int(r.headers["retry-after"]) >= 1
    local.wait_for("jengine_num_requests_queued", 0)
    # failures after admission give the slot back: with a queue of one, a leak is a 503 next
    bad = [{**completion, "structured_outputs": {"regex": "("}},  # grammar compile: 400
           {**completion, "max_tokens": 10**9},  # over the per-request token bound: 400
           {**completion, "prompt": [10**8]}]  # out-of-vocabulary id, refused by the engine
    for body in bad:
        r = httpx.post(local.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        r = httpx.post(local.url + "/v1/completions", json=completion, timeout=60)
        assert r.status_code == 200, r.text
    local.wait_for("jengine_num_requests_queued", 0)


def test_request_timeout(local):
    local.state.request_timeout = 1.5
    try:
        start = time.monotonic()
        r = httpx.post(local.url + "/v1/completions", json=LONG, timeout=60)
        assert_error(r, 504, "timeout")
        assert time.monotonic() - start < 15
        streamed = httpx.post(local.url + "/v1/completions", json={**LONG, "stream": True},
                              timeout=60)
        assert streamed.status_code == 200
        events = [e for e in streamed.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: "):])
        assert error["error"]["code"] == "timeout"
        assert len(events) > 3  # tokens streamed before the timeout hit
    finally:
        local.state.request_timeout = None
    local.wait_for("jengine_kv_pages_used", 0)
    ok = httpx.post(local.url + "/v1/completions", timeout=60,
                    json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_engine_failure_gives_errors_not_hangs(local):
    assert httpx.get(local.url + "/health").status_code == 200
    with httpx.stream("POST", local.url + "/v1/completions", json={**LONG, "stream": True},
                      timeout=60) as streaming:
        lines = streaming.iter_lines()
        first_event(lines)
        waiting = Background(local.url + "/v1/completions",
                             {"model": MODEL, "prompt": "Hi", "max_tokens": 3})
        local.wait_for("jengine_num_requests_queued", 1)
        # A real fault under the running engine: a weight buffer vanishes from the device, so
        # the next step fails inside the jitted call, in the engine thread.
        jax.tree.leaves(local.engine.core.runner.params)[0].delete()
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert error["type"] == "server_error" and error["code"] == "engine_error"
    assert_error(waiting.result(timeout=60), 500, "engine_error")
    health = httpx.get(local.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "engine_dead"
    for path, body in [("/v1/completions", {"model": MODEL, "prompt": "x"}),
                       ("/v1/chat/completions",
                        {"model": MODEL, "messages": [{"role": "user", "content": "x"}]})]:
        assert_error(httpx.post(local.url + path, json=body, timeout=30), 500, "engine_error")
    assert local.metrics()["jengine_engine_ready"] == 0
